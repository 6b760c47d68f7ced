#!/usr/bin/env bash
# torch (CPU) for the tests and benches that use it: the real torchrun launch, the
# torch tensor example and the gloo allreduce baseline. torch==2.13.0 is the CPU
# build this kind of machine keeps on disk (pip's find-links); a plain `torch` would
# pull a multi-GB CUDA build. Optional: RDMAMW_TORCH=0 skips it, and without it those
# tests skip with a reason. Usage: bash scripts/setup_torch.sh VENV_PYTHON
set -euo pipefail
PY="${1:?usage: scripts/setup_torch.sh VENV_PYTHON}"
[ "${RDMAMW_TORCH:-1}" = 0 ] && exit 0
"$PY" -c "import torch" 2>/dev/null && exit 0
echo "setup_torch: pip installing torch==2.13.0 (CPU)"
"$PY" -m pip install --quiet "torch==2.13.0" || \
    echo "setup_torch: warning: torch not installed; the tests that need it skip" >&2
