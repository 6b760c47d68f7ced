"""Who am I? Rank, world size and the bootstrap address (rank 0's store) from the
launchers people already use, so ``rdmamw.init()`` needs no arguments under torchrun,
mpirun, srun or a ps-lite-style job. The first launcher whose variables are present
wins. Every variable is declared in the settings table (rdmamw/config.py, its
"launcher" section) and read through it, from the environment or a given mapping."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from rdmamw import config
from rdmamw.errors import RdmamwError

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
    #: ps-lite: the ranks each role's members without an id take (servers 1..S, then
    #: the workers); empty under the other launchers
    ranges: dict[str, range] = field(default_factory=dict)
    #: the job's id from the launcher (:func:`launcher_job`), None when it gives none
    job_id: str | None = None


def launcher_job(env: Mapping[str, str] | None = None) -> str | None:
    """The job's id as the launcher tells it, the first of: ``RDMAMW_JOB_ID``, torchrun's
    run id, Slurm's job id (and step), the PMIx namespace (Open MPI 5, srun --mpi=pmix),
    Open MPI 4's job id; None when none is set. Every rank of one job has the same; rank
    0's store refuses a rank whose id differs from its own."""
    for name, tag in (("RDMAMW_JOB_ID", "rdmamw"), ("TORCHELASTIC_RUN_ID", "torchrun"),
                      ("SLURM_JOB_ID", "slurm"), ("PMIX_NAMESPACE", "pmix"),
                      ("OMPI_MCA_ess_base_jobid", "openmpi")):
        value = config.get(name, env)
        if value is not None and value != "":
            step = config.get("SLURM_STEP_ID", env) if name == "SLURM_JOB_ID" else None
            return f"{tag}:{value}" + (f".{step}" if step else "")
    return None


def first_slurm_host(nodelist: str) -> str:
    """``"node[07-09,12],gpu1"`` -> ``"node07"`` (the first host of a Slurm list)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise RdmamwError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _ranks(env: Mapping[str, str] | None
           ) -> tuple[int | None, int, str, int | None, str | None, int]:
    """(rank, world size, launcher, local size, role, ps-lite servers)."""
    for launcher, rk, ws, ls in (
        ("rdmamw", "RDMAMW_RANK", "RDMAMW_WORLD_SIZE", None),
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
        ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"),
    ):
        rank, size = config.get(rk, env), config.get(ws, env)
        if rank is not None and size is not None:
            if not 0 <= rank < size:
                raise RdmamwError(f"{rk}={rank} is outside {ws}={size}")
            return rank, size, launcher, config.get(ls, env) if ls else None, None, 0
    role = config.get("DMLC_ROLE", env)
    if role:
        servers = config.get("DMLC_NUM_SERVER", env)
        workers = config.get("DMLC_NUM_WORKER", env)
        size = 1 + servers + workers
        ids = {"scheduler": (0, 0), "server": (1, config.get("DMLC_SERVER_ID", env)),
               "worker": (1 + servers, config.get("DMLC_WORKER_ID", env))}
        if role not in ids:
            raise RdmamwError(f"DMLC_ROLE={role!r} is not scheduler, server or worker")
        base, idx = ids[role]
        limit = {"scheduler": 1, "server": servers, "worker": workers}[role]
        if idx is not None and not 0 <= idx < limit:
            raise RdmamwError(f"{role} id {idx} is outside 0..{limit - 1}")
        rank = base + idx if idx is not None else (0 if role == "scheduler" else None)
        return rank, size, "ps-lite", None, role, servers
    raise RdmamwError(
        "rdmamw.init(): no launcher environment found. Start under torchrun (RANK, "
        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT), mpirun (OMPI_COMM_WORLD_* or PMI_*), srun "
        "(SLURM_PROCID, SLURM_NTASKS) or ps-lite (DMLC_*), or set RDMAMW_RANK and "
        "RDMAMW_WORLD_SIZE")


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's variables (``env`` defaults to os.environ)."""
    rank, size, launcher, local_size, role, servers = _ranks(env)
    addr = config.get("RDMAMW_MASTER_ADDR", env) or config.get("MASTER_ADDR", env) \
        or config.get("DMLC_PS_ROOT_URI", env)
    port = config.get("RDMAMW_MASTER_PORT", env) or config.get("MASTER_PORT", env) \
        or config.get("DMLC_PS_ROOT_PORT", env)
    if launcher == "slurm":
        nodes, job_id = config.get("SLURM_JOB_NODELIST", env), config.get("SLURM_JOB_ID", env)
        if not addr and nodes:
            addr = first_slurm_host(nodes)
        if port is None and job_id is not None:
            port = 20000 + job_id % 20000
    if not addr:
        if size == 1 or (local_size is not None and local_size == size):
            addr = "127.0.0.1"      # the whole job is on this host
        else:
            raise RdmamwError(f"rdmamw.init(): {launcher} gave no bootstrap address; set "
                              f"MASTER_ADDR (or RDMAMW_MASTER_ADDR) to rank 0's host")
    port = DEFAULT_PORT if port is None else port
    if (config.get("TORCHELASTIC_USE_AGENT_STORE", env) == "True"
            and config.get("RDMAMW_MASTER_PORT", env) is None):
        # torchrun's agent holds MASTER_PORT for its own TCPStore: ours takes the next
        port += 1
    if not 0 < port < 65536:
        raise RdmamwError(f"bootstrap port {port} is not a TCP port")
    ranges = {"server": range(1, 1 + servers),
              "worker": range(1 + servers, size)} if role is not None else {}
    return LaunchInfo(rank, size, addr, port, launcher, role, local_size, ranges, launcher_job(env))
