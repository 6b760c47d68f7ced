"""Who am I? Rank, world size and the rendezvous address from the launchers people
already use, so ``rdmamw.init()`` needs no arguments under torchrun, mpirun, srun or
a ps-lite-style job. The first launcher whose variables are present wins."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from rdmamw.errors import ConfigError, RdmamwError

DEFAULT_PORT = 29500        # torchrun's default MASTER_PORT


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process. ``rank`` is None for a ps-lite server or
    worker without an id: the store then hands out the next free rank of its role."""

    rank: int | None
    world_size: int
    master_addr: str
    master_port: int
    launcher: str
    role: str | None = None
    local_size: int | None = None


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {key}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """``"node[07-09,12],gpu1"`` -> ``"node07"`` (the first host of a Slurm list)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise RdmamwError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _ranks(env: Mapping[str, str]) -> tuple[int | None, int, str, int | None, str | None]:
    """(rank, world size, launcher, local size, role)."""
    for launcher, rk, ws, ls in (
        ("rdmamw", "RDMAMW_RANK", "RDMAMW_WORLD_SIZE", None),
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
        ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"),
    ):
        rank, size = _int(env, rk), _int(env, ws)
        if rank is not None and size is not None:
            if not 0 <= rank < size:
                raise RdmamwError(f"{rk}={rank} is outside {ws}={size}")
            return rank, size, launcher, _int(env, ls) if ls else None, None
    role = env.get("DMLC_ROLE")
    if role:
        servers, workers = _int(env, "DMLC_NUM_SERVER") or 0, _int(env, "DMLC_NUM_WORKER") or 0
        size = 1 + servers + workers
        ids = {"scheduler": (0, 0), "server": (1, _int(env, "DMLC_SERVER_ID")),
               "worker": (1 + servers, _int(env, "DMLC_WORKER_ID"))}
        if role not in ids:
            raise RdmamwError(f"DMLC_ROLE={role!r} is not scheduler, server or worker")
        base, idx = ids[role]
        limit = {"scheduler": 1, "server": servers, "worker": workers}[role]
        if idx is not None and not 0 <= idx < limit:
            raise RdmamwError(f"{role} id {idx} is outside 0..{limit - 1}")
        rank = base + idx if idx is not None else (0 if role == "scheduler" else None)
        return rank, size, "ps-lite", None, role
    raise RdmamwError(
        "rdmamw.init(): no launcher environment found. Start under torchrun (RANK, "
        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT), mpirun (OMPI_COMM_WORLD_* or PMI_*), srun "
        "(SLURM_PROCID, SLURM_NTASKS) or ps-lite (DMLC_*), or set RDMAMW_RANK and "
        "RDMAMW_WORLD_SIZE")


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's variables (``env`` defaults to os.environ)."""
    env = os.environ if env is None else env
    rank, size, launcher, local_size, role = _ranks(env)
    addr = env.get("RDMAMW_MASTER_ADDR") or env.get("MASTER_ADDR") \
        or env.get("DMLC_PS_ROOT_URI")
    port = _int(env, "RDMAMW_MASTER_PORT") or _int(env, "MASTER_PORT") \
        or _int(env, "DMLC_PS_ROOT_PORT")
    if not addr and launcher == "slurm" and env.get("SLURM_JOB_NODELIST"):
        addr = first_slurm_host(env["SLURM_JOB_NODELIST"])
    if port is None and launcher == "slurm" and _int(env, "SLURM_JOB_ID") is not None:
        port = 20000 + (_int(env, "SLURM_JOB_ID") or 0) % 20000
    if not addr:
        if size == 1 or (local_size is not None and local_size == size):
            addr = "127.0.0.1"      # the whole job is on this host
        else:
            raise RdmamwError(f"rdmamw.init(): {launcher} gave no rendezvous address; set "
                              f"MASTER_ADDR (or RDMAMW_MASTER_ADDR) to rank 0's host")
    port = DEFAULT_PORT if port is None else port
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and _int(env, "RDMAMW_MASTER_PORT") is None):
        # torchrun's agent holds MASTER_PORT for its own TCPStore: ours takes the next
        port += 1
    if not 0 < port < 65536:
        raise RdmamwError(f"rendezvous port {port} is not a TCP port")
    return LaunchInfo(rank, size, addr, port, launcher, role, local_size)
