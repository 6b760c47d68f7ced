#!/usr/bin/env bash
# pip install one optional heavy dependency the tests and benches use, unless it imports
# already or the switch variable says 0; a failed install only warns (those tests skip
# with a reason). Usage: bash scripts/setup_optional.sh VENV_PYTHON MODULE SPEC SWITCH
set -euo pipefail
PY="${1:?usage: scripts/setup_optional.sh VENV_PYTHON MODULE SPEC SWITCH}"
MODULE="$2" SPEC="$3" SWITCH="$4"
[ "${!SWITCH:-1}" = 0 ] && exit 0
"$PY" -c "import $MODULE" 2>/dev/null && exit 0
echo "setup: pip installing $SPEC"
"$PY" -m pip install --quiet "$SPEC" || \
    echo "setup: warning: $SPEC not installed; the tests that need it skip" >&2
