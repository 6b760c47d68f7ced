#!/usr/bin/env bash
# Ray (the version rdmamw[ray] pins) for tests/integrations/test_ray.py and bench/ray_bench.py: one
# ~70 MB wheel and a few small dependencies (under a minute here). Optional:
# RDMAMW_RAY=0 skips it, and without it those tests skip with a reason.
# Usage: bash scripts/setup_ray.sh VENV_PYTHON
set -euo pipefail
exec bash "$(dirname "$0")/setup_optional.sh" "${1:?usage: scripts/setup_ray.sh VENV_PYTHON}" \
    ray "ray==2.60.0" RDMAMW_RAY
