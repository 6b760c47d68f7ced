"""Start an n-rank job on this host without a launcher (tests, ``rdmamw tune -n``,
benchmarks): each rank gets ``RDMAMW_RANK`` / ``RDMAMW_WORLD_SIZE`` and a free
rendezvous port, exactly what torchrun or mpirun would provide."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from rdmamw.bootstrap.launch import free_port

LAUNCH_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "DMLC_")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
               "RDMAMW_RANK", "RDMAMW_WORLD_SIZE", "RDMAMW_MASTER_ADDR", "RDMAMW_MASTER_PORT")


def spawn(n: int, cmd: Sequence[str], env: dict[str, str] | None = None,
          **popen) -> list[subprocess.Popen]:
    """Start ``cmd`` as ranks 0..n-1 (stdout/stderr as ``popen`` says)."""
    port = str(free_port())
    base = {k: v for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}
    base.update(env or {})
    return [subprocess.Popen(list(cmd), env={**base, "RDMAMW_RANK": str(r),
                                             "RDMAMW_WORLD_SIZE": str(n),
                                             "RDMAMW_MASTER_ADDR": "127.0.0.1",
                                             "RDMAMW_MASTER_PORT": port}, **popen)
            for r in range(n)]
