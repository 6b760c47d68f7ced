#!/usr/bin/env bash
# Install the benchmark peers (MPICH + mpi4py, pyzmq, rich) into a venv.
# Idempotent: each step runs only when its piece is missing, so `make bench`
# stays fast on the second run. Usage: bash bench/setup.sh VENV_PYTHON
set -euo pipefail

PY="${1:?usage: bench/setup.sh VENV_PYTHON}"

# (a machine may have MPICH's runtime without its headers: mpi4py is built against them)
if ! command -v mpiexec >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1 \
        || ! echo '#include <mpi.h>' | mpicc -E - >/dev/null 2>&1; then
    echo "bench/setup.sh: installing MPICH (mpiexec, mpicc or mpi.h missing)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq mpich libmpich-dev >/dev/null
fi

# UCX's own benchmark (ucx_perftest) is the ucx column of bench/run.py.
if ! command -v ucx_perftest >/dev/null 2>&1; then
    echo "bench/setup.sh: installing ucx-utils (ucx_perftest missing)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq ucx-utils >/dev/null
fi

missing=()
"$PY" -c "import zmq" 2>/dev/null || missing+=("pyzmq>=25")
"$PY" -c "import rich" 2>/dev/null || missing+=("rich")
if ! "$PY" -c "import mpi4py" 2>/dev/null; then
    # Built from source so it links against the system MPICH, not a bundled MPI wheel.
    missing+=("mpi4py>=3.1")
fi
if [ "${#missing[@]}" -gt 0 ]; then
    echo "bench/setup.sh: pip installing ${missing[*]}"
    MPICC="$(command -v mpicc)" "$PY" -m pip install --quiet --no-binary mpi4py "${missing[@]}"
fi

# Warn (do not fail) when mpi4py links against something other than MPICH.
"$PY" - <<'PYEOF'
from mpi4py import MPI

lib = MPI.Get_library_version()
if "MPICH" not in lib:
    print("bench/setup.sh: warning: mpi4py is not built against MPICH:", lib.splitlines()[0])
PYEOF

# torch.distributed's gloo is the allreduce bench's second baseline (CPU torch).
bash "$(dirname "$0")/../scripts/setup_torch.sh" "$PY"

# Ray for bench/ray_bench.py (rdmamw's ray.util.collective group against Ray's gloo one).
bash "$(dirname "$0")/../scripts/setup_ray.sh" "$PY"

# The one-sided peers of bench/rmem_bench.py, in a venv of their own (their wheels pin
# numpy and bundle libraries of their own; none goes into the project's venv):
# Mooncake's Transfer Engine (the CPU build) and NIXL (nixl-cu12 bundles UCX; --no-deps:
# its declared torch is a multi-GB CUDA build that DRAM transfers never import).
# RDMAMW_PEERS=0 skips; RDMAMW_PEERS_VENV moves it (bench/rmem_bench.py reads
# RDMAMW_PEERS_PY, default .venv-peers/bin/python). A failed install only warns: the
# bench then names the peer it could not run and why.
if [ "${RDMAMW_PEERS:-1}" != 0 ]; then
    PEERS_VENV="${RDMAMW_PEERS_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-peers}"
    [ -x "$PEERS_VENV/bin/python" ] || "$PY" -m venv "$PEERS_VENV"
    PPY="$PEERS_VENV/bin/python"
    if ! "$PPY" -c "import mooncake.engine" 2>/dev/null; then
        echo "bench/setup.sh: installing mooncake-transfer-engine-non-cuda into $PEERS_VENV"
        "$PPY" -m pip install --quiet numpy mooncake-transfer-engine-non-cuda || \
            echo "bench/setup.sh: warning: Mooncake not installed" >&2
    fi
    if ! "$PPY" -c "import nixl_cu12" 2>/dev/null; then
        echo "bench/setup.sh: installing nixl-cu12 (--no-deps) into $PEERS_VENV"
        "$PPY" -m pip install --quiet numpy && "$PPY" -m pip install --quiet --no-deps nixl-cu12 || \
            echo "bench/setup.sh: warning: NIXL not installed" >&2
    fi
fi

# ucxx (RAPIDS' Python binding of UCX) for the ucxx column of bench/run.py, in a venv of
# its own: ucxx-cu12 needs numpy >= 2 and pulls rmm-cu12 and the CUDA Python bindings
# (about 350 MB), none of which the project's venv wants; on DRAM it runs without a GPU.
# RDMAMW_UCXX_VENV moves it (bench/run.py reads RDMAMW_UCXX_PY, default
# .venv-ucxx/bin/python); a failed install only warns: the column then says why.
if [ "${RDMAMW_PEERS:-1}" != 0 ]; then
    UCXX_VENV="${RDMAMW_UCXX_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-ucxx}"
    [ -x "$UCXX_VENV/bin/python" ] || "$PY" -m venv "$UCXX_VENV"
    if ! "$UCXX_VENV/bin/python" -c "import ucxx" 2>/dev/null; then
        echo "bench/setup.sh: installing ucxx-cu12 into $UCXX_VENV"
        "$UCXX_VENV/bin/python" -m pip install --quiet numpy ucxx-cu12 || \
            echo "bench/setup.sh: warning: ucxx not installed" >&2
    fi
fi
