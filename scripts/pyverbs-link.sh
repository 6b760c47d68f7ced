#!/usr/bin/env bash
# Make Debian's pyverbs (python3-pyverbs) importable in the project's venv: a .pth
# names a folder holding only a link to the pyverbs package, so the rest of Debian's
# dist-packages (its numpy, ...) never shadows the venv's.
set -euo pipefail
VPY=${1:-.venv/bin/python}
SRC=/usr/lib/python3/dist-packages/pyverbs
[ -d "$SRC" ] || { echo "[pyverbs-link] $SRC missing (apt-get install python3-pyverbs)" >&2; exit 1; }
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
LINKDIR="$(dirname "$SITE")/rdmamw-pyverbs"
mkdir -p "$LINKDIR"
ln -sfn "$SRC" "$LINKDIR/pyverbs"
echo "$LINKDIR" >"$SITE/rdmamw-pyverbs.pth"
"$VPY" -c "import pyverbs.device" || { echo "[pyverbs-link] pyverbs does not import" >&2; exit 1; }
