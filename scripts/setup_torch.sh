#!/usr/bin/env bash
# torch (CPU) for the tests and benches that use it: the real torchrun launch, the
# torch tensor example and the gloo allreduce baseline. torch==2.13.0 is the CPU
# build this kind of machine keeps on disk (pip's find-links); a plain `torch` would
# pull a multi-GB CUDA build. Optional: RDMAMW_TORCH=0 skips it, and without it those
# tests skip with a reason. Usage: bash scripts/setup_torch.sh VENV_PYTHON
set -euo pipefail
exec bash "$(dirname "$0")/setup_optional.sh" "${1:?usage: scripts/setup_torch.sh VENV_PYTHON}" \
    torch "torch==2.13.0" RDMAMW_TORCH
