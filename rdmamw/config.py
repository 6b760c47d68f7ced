"""Every ``RDMAMW_*`` setting, declared once: name, type, default and a one-line doc;
and, in a section of their own, the variables launchers set (torchrun's, MPI's,
Slurm's, ps-lite's), which the bootstrap reads through the same table.

As UCX declares each component's settings in one table (``ucs_config_field_t``) and
NCCL reads each variable through one parser, the package reads its environment only
through :func:`get`, at the moment a value is used (never at import, so a bad value
fails the call that needs it, with a :class:`~rdmamw.errors.ConfigError` naming the
variable and the value). Sizes take units (``64K``, ``1G``), durations too
(``250ms``, ``10s``, ``2m``). ``rdmamw info --config`` prints the effective values and
where each came from; docs/config.md is the table, kept in step by a test.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rdmamw import vocabulary
from rdmamw.errors import ConfigError
from rdmamw.vocabulary import AUTO, RNDV_STRATEGIES

# ---- parsers: the text of a variable (or an option) -> a value -------------------------

_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SECOND_UNITS = {"": 1.0, "S": 1.0, "MS": 1e-3, "US": 1e-6, "M": 60.0, "MIN": 60.0, "H": 3600.0}
_TRUE = ("1", "on", "yes", "true")
_FALSE = ("0", "off", "no", "false")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """``"4096"``, ``"64K"``, ``"64KiB"``, ``"1g"`` -> bytes (binary multiples), else
    ConfigError naming ``what``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        unit = s[-1:] if s[-1:] in _BYTE_UNITS and s[-1:] else ""
        digits = s[: len(s) - len(unit)].strip()
        try:
            number = float(digits) if digits else -1.0
        except ValueError:
            number = -1.0
        value = int(number * _BYTE_UNITS[unit]) if math.isfinite(number) else -1
        if value < 0:
            raise ConfigError(f"{what}: {text!r} is not a byte size "
                              "(examples: 65536, 64K, 256M, 1G)")
    if value < 0:
        raise ConfigError(f"{what}: {text!r} must not be negative")
    return value


def parse_seconds(text: str | float, what: str = "duration", *, zero: bool = False) -> float:
    """``"10"``, ``"0.5"``, ``"250ms"``, ``"2m"`` -> seconds, positive (or zero if
    ``zero``) and finite; else ConfigError naming ``what``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().upper()
        digits = s.rstrip("SMINHU")
        unit = s[len(digits):]
        try:
            value = float(digits) * _SECOND_UNITS[unit]
        except (KeyError, ValueError):
            value = -1.0
    ok = (0 <= value if zero else 0 < value) and math.isfinite(value)
    if not ok:
        noun = "a non-negative" if zero else "a positive"
        raise ConfigError(f"{what}: {text!r} is not {noun} duration (examples: 10, 0.5, "
                          "250ms, 2m)")
    return value


def parse_number(text: str, what: str, kind: type = float, minimum: float = 0,
                 maximum: float = math.inf) -> float:
    """``text`` as ``kind`` (int or float) within [minimum, maximum], else ConfigError."""
    try:
        value = kind(str(text).strip())
    except ValueError:
        value = None
    if value is None or value != value or not minimum <= value <= maximum:   # NaN != NaN
        noun = "an integer" if kind is int else "a number"
        bound = f" from {minimum:g} to {maximum:g}" if maximum < math.inf else f" >= {minimum:g}"
        raise ConfigError(f"{what}={text!r} is not {noun}{bound}")
    return value


def parse_bool(text: str, what: str) -> bool:
    s = str(text).strip().lower()
    if s in _TRUE or s in _FALSE:
        return s in _TRUE
    raise ConfigError(f"{what}={text!r} is not a yes/no value (1/0, on/off, yes/no, "
                      "true/false)")


class LazyChoices(Sequence):
    """A setting's choices read when checked (from a registry that may grow after
    import: the allreduce algorithms)."""

    def __init__(self, read: Callable[[], tuple[str, ...]]) -> None:
        self._read = read

    def __getitem__(self, i: Any) -> Any:
        return self._read()[i]

    def __len__(self) -> int:
        return len(self._read())

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __contains__(self, value: object) -> bool:
        return value in self._read()

    def __repr__(self) -> str:
        return repr(self._read())


# ---- the table ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One variable: how its text is read and what holds without it."""

    name: str
    kind: str                   # int float bytes seconds bool str choice path
    default: Any
    doc: str
    component: str
    minimum: float = 0
    maximum: float = math.inf
    choices: Sequence[str] = ()
    secret: bool = False        # never printed (rdmamw info, the log)
    set_by: str = ""            # a launcher's variable: the launchers that set it
    check: Callable[[Any, str], Any] | None = None   # a further check of the parsed value

    def parse(self, text: str) -> Any:
        what = self.name
        if self.kind == "int":
            value = parse_number(text, what, int, self.minimum, self.maximum)
        elif self.kind == "float":
            value = parse_number(text, what, float, self.minimum, self.maximum)
        elif self.kind == "bytes":
            value = parse_bytes(text, what)
            if not self.minimum <= value <= self.maximum:
                raise ConfigError(f"{what}={text!r} is out of range "
                                  f"[{self.minimum:.0f}, {self.maximum:.0f}] bytes")
        elif self.kind == "seconds":
            value = parse_seconds(text, what, zero=self.minimum == 0)
            if not self.minimum <= value <= self.maximum:
                raise ConfigError(f"{what}={text!r} is out of range "
                                  f"[{self.minimum:g}, {self.maximum:g}] seconds")
        elif self.kind == "bool":
            value = parse_bool(text, what)
        elif self.kind == "choice":
            value = text.strip().lower()
            if value not in self.choices:
                raise ConfigError(f"{what}={text!r} is not one of {', '.join(self.choices)}")
        else:                                   # str, path
            value = text.strip()
        return self.check(value, what) if self.check else value


SETTINGS: dict[str, Setting] = {}


def _declare(component: str, name: str, kind: str, default: Any, doc: str, **kw: Any) -> None:
    if name in SETTINGS:
        raise AssertionError(f"{name} declared twice")
    if "maximum" not in kw and kind in ("seconds", "bytes", "float"):
        kw["maximum"] = {"seconds": MAX_SECONDS, "bytes": MAX_BYTES, "float": MAX_SPIN_US}[kind]
    if kind in ("int", "float", "bytes", "seconds") and not kw.get("maximum", math.inf) < math.inf:
        raise AssertionError(f"{name}: a number needs a maximum the code can honour")
    SETTINGS[name] = Setting(name, kind, default, doc, component, **kw)


def _uid_list(value: str, what: str) -> frozenset[int] | None:
    if value.lower() in ("any", "*"):
        return None
    try:
        uids = frozenset(int(u) for u in value.split(",") if u.strip())
    except ValueError:
        uids = frozenset([-1])
    if any(u < 0 for u in uids):
        raise ConfigError(f"{what}: {value!r} is not a comma list of uids or 'any'")
    return uids


def _topology(value: str, what: str) -> str:
    if value in ("host", "hostname", "probe") or "," in value:
        return value
    raise ConfigError(f"{what}={value!r} is not host, hostname, probe or comma-separated "
                      "labels (one per rank)")


K, M, G = 1 << 10, 1 << 20, 1 << 30
#: the bounds every setting of a kind gets unless it declares its own: what the code
#: can honour (a C poll() takes int milliseconds and a deadline must fit a time_t; a
#: byte count must fit the size_t it is handed to); tests/channel/test_settings_range.py sets
#: every setting to its minimum and maximum and runs the path that uses it
MAX_SECONDS = 1e6               # 11.6 days
MAX_BYTES = 1 << 50             # 1 PiB
MAX_SPIN_US = 1e6               # one second of spinning before a sleep
MAX_RANKS = 1 << 20             # ranks of a job: what rank 0's bootstrap serves in time
MAX_RING_SLOTS = 1 << 20        # rdmamw/transport/layout.py MAX_SLOTS
MAX_PEER_HEARTBEAT = 60.0       # the largest heartbeat a tcp peer accepts (tcp/provider.py)
MAX_UNPROVEN = 1 << 16          # unproven connections a listener holds (each an fd; a
                                # newcomer at the cap scans them: rdmamw/listener.py)
D = _declare
# channel
D("channel", "RDMAMW_SLOTS", "int", 128, "slots in the ring a channel receives on", minimum=1,
  maximum=MAX_RING_SLOTS)
D("channel", "RDMAMW_SLOT_SIZE", "bytes", 64 * K, "bytes per slot: the largest eager message",
  minimum=64, maximum=G)
D("channel", "RDMAMW_SPIN_US", "float", 100.0,
  "microseconds a wait spins before it sleeps")
D("channel", "RDMAMW_AIO_SPIN_US", "float", 20.0,
  "microseconds an rdmamw.aio receive polls before it yields to the event loop, "
  "when no other channel of the loop is waiting (0: never)", minimum=0.0)
D("channel", "RDMAMW_OPEN_TIMEOUT", "seconds", 30.0,
  "seconds Channel.open / accept wait for the peer (timeout=None)", minimum=1e-3)
D("channel", "RDMAMW_MAX_MESSAGE_SIZE", "bytes", G,
  "largest message a channel accepts (above 4 GiB - 1: the wire's limit)", minimum=1)
D("channel", "RDMAMW_MAX_PEER_RING", "bytes", 256 * M,
  "largest ring (slots x stride) a peer's hello may ask us to hold for it")
D("channel", "RDMAMW_HANDSHAKE_TIMEOUT", "seconds", 10.0,
  "seconds one incoming connection may take to finish its handshake", minimum=1e-3)
D("channel", "RDMAMW_PROOF_TIMEOUT", "seconds", 3.0,
  "seconds an incoming connection has to prove the token (at most the handshake's)",
  minimum=1e-3)
D("channel", "RDMAMW_UNPROVEN_PER_SOURCE", "int", 8,
  "connections from one address a listener holds unproven once they are "
  "RDMAMW_UNPROVEN_GRACE s old (a newcomer pushes out the oldest)", minimum=1,
  maximum=MAX_UNPROVEN)
D("channel", "RDMAMW_UNPROVEN_GRACE", "seconds", 1.0,
  "seconds a burst of unproven connections from one address is held whole (a job's "
  "ranks joining at once)", minimum=0.0)
D("channel", "RDMAMW_UNPROVEN_MAX", "int", 256,
  "unproven connections a listener holds in all (a newcomer pushes out the busiest "
  "address's oldest)", minimum=1, maximum=MAX_UNPROVEN)
D("channel", "RDMAMW_LISTEN_BACKLOG", "int", 16,
  "connections a listener holds in a handshake or unaccepted", minimum=1, maximum=4096)
D("channel", "RDMAMW_TOKEN", "str", "",
  "the job's shared secret (default: ~/.config/rdmamw/token, made on first use)", secret=True)
# memory
D("memory", "RDMAMW_REGCACHE_BYTES", "bytes", G,
  "registered bytes each registration cache keeps (verbs with windows: the process's "
  "caches, else each channel's)")
D("memory", "RDMAMW_POOL_BYTES", "bytes", 256 * M, "bytes a buffer pool keeps")
D("memory", "RDMAMW_POOL_SHARDS", "int", None,
  "per-thread shards of a buffer pool (default min(8, CPUs))", minimum=1, maximum=1024)
D("memory", "RDMAMW_RNDV_STRATEGY", "choice", "",
  "rendezvous strategy for large messages, over the tuning file",
  choices=(*RNDV_STRATEGIES, ""))
D("memory", "RDMAMW_RNDV_THRESHOLD", "bytes", None,
  "size from which messages go by rendezvous, over the tuning file")
D("memory", "RDMAMW_TUNE_FILE", "path", "",
  "rendezvous tuning file (default ~/.config/rdmamw/rendezvous.json)")
# shm
D("shm", "RDMAMW_SHM_STAGING", "bytes", G,
  "size of the staging area for rendezvous when CMA is not permitted (the largest "
  "rendezvous message then; a peer takes at most 1 TiB)", minimum=1, maximum=1 << 40)
D("shm", "RDMAMW_SHM_CMA", "bool", True,
  "use process_vm_readv/writev (CMA) for rendezvous between processes")
D("shm", "RDMAMW_SHM_ASSIST", "bytes", M,
  "messages from this size on are copied with the peer's help")
D("shm", "RDMAMW_SHM_ASSIST_CHUNK", "bytes", 256 * K, "piece of an assisted copy",
  minimum=1)
D("shm", "RDMAMW_SHM_ASSIST_STALL", "seconds", 10.0,
  "seconds an assisted copy may make no progress before it fails", minimum=1e-3)
D("shm", "RDMAMW_SHM_ALLOW_UIDS", "str", "",
  "other users' uids that may connect (comma list, or 'any'); our own always may",
  check=_uid_list)
# tcp
D("tcp", "RDMAMW_TCP_HEARTBEAT", "seconds", 0.25,
  "interval of heartbeats on an idle tcp connection (0: none; at most the 60 s a peer "
  "accepts)", maximum=MAX_PEER_HEARTBEAT)
D("tcp", "RDMAMW_TCP_PEER_TIMEOUT", "seconds", 30.0,
  "silence of a tcp peer process (stopped, starved) after which it is lost", minimum=1e-3)
D("tcp", "RDMAMW_TCP_HOST_TIMEOUT", "seconds", 1.5,
  "silence of a tcp peer whose host also acknowledges nothing (link down, power off) "
  "after which it is lost (0: only the peer timeout)")
# verbs
D("verbs", "RDMAMW_VERBS_LIBRARY", "str", "libibverbs.so.1",
  "the libibverbs to dlopen: a name or a path")
D("verbs", "RDMAMW_VERBS_FABRIC", "str", "",
  "declare this rank's fabric (net:NAME) instead of deriving it from its GID")
D("verbs", "RDMAMW_VERBS_DEVICE", "str", "", "RDMA device name (default: the first usable)")
D("verbs", "RDMAMW_VERBS_PORT", "int", 0, "device port (0: the first active)", maximum=255)
D("verbs", "RDMAMW_VERBS_GID_INDEX", "int", -1, "GID index (-1: chosen by link layer)",
  minimum=-1, maximum=(1 << 16) - 1)
D("verbs", "RDMAMW_VERBS_SQ_DEPTH", "int", 256, "send queue depth of a channel's QP", minimum=1,
  maximum=1 << 16)
D("verbs", "RDMAMW_VERBS_RQ_DEPTH", "int", 0, "receive queue depth (0: from the ring)",
  maximum=1 << 16)
D("verbs", "RDMAMW_VERBS_INLINE", "int", 256, "bytes sent inline in a work request",
  maximum=4096)
D("verbs", "RDMAMW_VERBS_EVENT", "int", 1,
  "1: a sleeper is woken by completion events (the peer's WRITE_WITH_IMM); 0: it also "
  "re-checks every RDMAMW_VERBS_POLL_MS", maximum=1)
D("verbs", "RDMAMW_VERBS_PINNED_BYTES", "bytes", 0,
  "registered (pinned) bytes the process's verbs channels may hold; 0: half the memory, "
  "at most `ulimit -l`", maximum=1 << 50)
D("verbs", "RDMAMW_VERBS_RING_START", "bytes", 64 << 10,
  "bytes of a channel's receive ring registered at connect (at least one slot); the "
  "device thread registers twice as much each time the peer runs short, up to the whole "
  "ring. 0: the whole ring at once", maximum=1 << 40)
D("verbs", "RDMAMW_VERBS_WINDOWS", "int", 1,
  "1: the keys a peer gets are type-2 memory windows bound to its channel's queue pair, "
  "where the device has them; 0: keys of MRs with remote access", maximum=1)
D("verbs", "RDMAMW_VERBS_POLL_MS", "int", 1, "re-check interval of a sleeper without events",
  maximum=60000)
D("verbs", "RDMAMW_VERBS_READ_CHUNK", "bytes", None,
  "longest RDMA READ one work request asks for; a longer one goes as several (0: no "
  "limit; default: 512 KiB on soft-RoCE devices, whose READ retry can stall, else no "
  "limit)", maximum=1 << 31)
D("verbs", "RDMAMW_VERBS_TIMEOUT", "int", 14, "QP local ACK timeout exponent (4.096 us x 2^n)",
  maximum=31)
# bootstrap (the launcher variables are read with torchrun's, MPI's and Slurm's)
OWN = "a launcher of one's own"
D("bootstrap", "RDMAMW_RANK", "int", None, "this process's rank (set by a launcher)",
  maximum=MAX_RANKS - 1, set_by=OWN)
D("bootstrap", "RDMAMW_WORLD_SIZE", "int", None, "ranks in the job (set by a launcher)",
  minimum=1, maximum=MAX_RANKS, set_by=OWN)
D("bootstrap", "RDMAMW_MASTER_ADDR", "str", None,
  "rank 0's bootstrap address (wins over the launchers')", set_by=OWN)
D("bootstrap", "RDMAMW_MASTER_PORT", "int", None,
  "rank 0's bootstrap port (wins over the launchers')", minimum=1, maximum=65535,
  set_by=OWN)
D("bootstrap", "RDMAMW_SOCKET_IFNAME", "str", "",
  "interfaces for the tcp and bootstrap addresses: prefixes, =exact, ^ excludes")
D("bootstrap", "RDMAMW_INIT_TIMEOUT", "seconds", 60.0, "seconds rdmamw.init() waits for the job")
D("bootstrap", "RDMAMW_PROVIDER", "str", "",
  "force one provider (its scheme: shm, tcp, verbs or a plug-in's) for channels opened by rank",
  check=lambda v, what: v.lower())
D("bootstrap", "RDMAMW_PROVIDER_PLUGINS", "str", "",
  "more providers: module or module:attr (default attr PROVIDER), comma-separated")
# collectives
D("collectives", "RDMAMW_COLL_SLOTS", "int", 16, "slots of a collective channel's ring",
  minimum=1, maximum=MAX_RING_SLOTS)
D("collectives", "RDMAMW_COLL_SLOT_SIZE", "bytes", M, "slot bytes of a collective channel",
  minimum=64, maximum=G)
D("collectives", "RDMAMW_COLL_MIN_CHUNK", "bytes", 16 * K, "smallest pipeline chunk",
  minimum=1, maximum=G)
D("collectives", "RDMAMW_COLL_CHUNK", "bytes", 4 * M,
  "largest pipeline chunk on channels with rendezvous (others: their eager limit)",
  minimum=64, maximum=G)
D("collectives", "RDMAMW_COLL_SPIN_US", "float", None,
  "microseconds a collective's wait spins before it sleeps (default RDMAMW_SPIN_US; 0 "
  "when this host runs more ranks than it has CPUs)", minimum=0.0)
D("collectives", "RDMAMW_COLL_PIECES", "int", 1, "pipeline pieces per transfer", minimum=1,
  maximum=1 << 16)
D("collectives", "RDMAMW_COLL_RESULT_BYTES", "bytes", G,
  "idle bytes the pool of out-of-place collective results keeps")
D("collectives", "RDMAMW_ALLREDUCE_ALGORITHM", "choice", "",
  "force an allreduce algorithm",
  choices=LazyChoices(lambda: (AUTO, *vocabulary.allreduce_algorithms(), "")))
D("collectives", "RDMAMW_COLL_CONFIG", "path", "",
  "cost-model file of `rdmamw tune` (default ~/.config/rdmamw/collectives.json)")
D("collectives", "RDMAMW_COLL_TOPOLOGY", "str", "host",
  "how ranks group for hierarchical algorithms: host, hostname, probe, or labels "
  "(comma-separated, one per rank)", check=_topology)
# parameter server
D("ps", "RDMAMW_PS_SLOTS", "int", 16, "slots of a parameter-server channel's ring", minimum=1,
  maximum=MAX_RING_SLOTS)
D("ps", "RDMAMW_PS_SLOT_SIZE", "bytes", M, "slot bytes of a parameter-server channel",
  minimum=64, maximum=G)
D("ps", "RDMAMW_PS_INIT_TIMEOUT", "seconds", 60.0,
  "how long a read of a key waits for the rest of initial values a worker began to send; "
  "then the read is refused (PSError) instead of waiting for ever")
D("ps", "RDMAMW_PS_REPLY_TIMEOUT", "seconds", 10.0,
  "seconds a server's reply may wait for its worker to take it (the ring full: the worker "
  "sends and never reads); then that worker is dropped and the others served",
  minimum=0.1, maximum=3600.0)
# log
D("log", "RDMAMW_LOG_LEVEL", "str", "",
  "level of the 'rdmamw' logger: debug, info, warning (default), error, critical")
D("log", "RDMAMW_LOG_FILE", "path", "",
  "log to this file instead of stderr (%h: host name, %p: pid)")


# launchers: what torchrun, mpirun, srun, ps-lite (and rdmamw.bootstrap.launch) set for
# the processes they start; rdmamw.init() reads them (rdmamw/bootstrap/env.py)
def L(name: str, kind: str, set_by: str, doc: str, **kw: Any) -> None:
    _declare("launcher", name, kind, kw.pop("default", None), doc, set_by=set_by, **kw)


TORCHRUN, OMPI, MPICH, SLURM, PSLITE = "torchrun", "Open MPI", "MPICH", "Slurm", "ps-lite"
RK, WS = {"maximum": MAX_RANKS - 1}, {"minimum": 1, "maximum": MAX_RANKS}
L("RANK", "int", TORCHRUN, "this process's rank", **RK)
L("WORLD_SIZE", "int", TORCHRUN, "ranks in the job", **WS)
L("LOCAL_RANK", "int", TORCHRUN, "this process's rank on its host", **RK)
L("LOCAL_WORLD_SIZE", "int", TORCHRUN, "ranks on this host", **WS)
L("MASTER_ADDR", "str", TORCHRUN, "rank 0's host (also read under MPI and Slurm)")
L("MASTER_PORT", "int", TORCHRUN, "rank 0's port (torchrun's agent store; ours takes the "
  "next one when TORCHELASTIC_USE_AGENT_STORE=True)", minimum=1, maximum=65535)
L("TORCHELASTIC_USE_AGENT_STORE", "str", TORCHRUN,
  "True: torchrun's agent runs its own store on MASTER_PORT")
L("OMPI_COMM_WORLD_RANK", "int", OMPI, "this process's rank", **RK)
L("OMPI_COMM_WORLD_SIZE", "int", OMPI, "ranks in the job", **WS)
L("OMPI_COMM_WORLD_LOCAL_SIZE", "int", OMPI, "ranks on this host", **WS)
L("PMI_RANK", "int", MPICH, "this process's rank", **RK)
L("PMI_SIZE", "int", MPICH, "ranks in the job", **WS)
L("MPI_LOCALNRANKS", "int", MPICH, "ranks on this host", **WS)
L("SLURM_PROCID", "int", SLURM, "this process's rank", **RK)
L("SLURM_NTASKS", "int", SLURM, "ranks in the job", **WS)
L("SLURM_NTASKS_PER_NODE", "int", SLURM, "ranks per host", **WS)
L("SLURM_JOB_NODELIST", "str", SLURM, "the job's hosts: the first one runs rank 0's store")
L("SLURM_JOB_ID", "int", SLURM, "the job's id: rank 0's port is 20000 + id mod 20000",
  maximum=(1 << 63) - 1)
L("DMLC_ROLE", "str", PSLITE, "scheduler (rank 0), server or worker")
L("DMLC_NUM_SERVER", "int", PSLITE, "servers in the job (ranks 1..S)", default=0,
  maximum=MAX_RANKS // 2 - 1)
L("DMLC_NUM_WORKER", "int", PSLITE, "workers in the job (the ranks after the servers)",
  default=0, maximum=MAX_RANKS // 2)
L("DMLC_SERVER_ID", "int", PSLITE, "this server's index (else the next free server rank)",
  maximum=MAX_RANKS // 2 - 2)
L("DMLC_WORKER_ID", "int", PSLITE, "this worker's index (else the next free worker rank)",
  maximum=MAX_RANKS // 2 - 1)
L("DMLC_PS_ROOT_URI", "str", PSLITE, "the scheduler's host")
L("DMLC_PS_ROOT_PORT", "int", PSLITE, "the scheduler's port", minimum=1, maximum=65535)
# the job's identity: a rank of another job at rank 0's store is refused (the first set wins)
L("RDMAMW_JOB_ID", "str", OWN, "the job's id (wins over the launchers')")
L("TORCHELASTIC_RUN_ID", "str", TORCHRUN, "the job's id (--rdzv-id)")
L("SLURM_STEP_ID", "str", SLURM, "the job step's id (with SLURM_JOB_ID: the job's id)")
L("PMIX_NAMESPACE", "str", "PMIx (Open MPI 5, srun --mpi=pmix)", "the job's namespace")
L("OMPI_MCA_ess_base_jobid", "str", OMPI, "the job's id (Open MPI 4)")
del D, L, OWN, TORCHRUN, OMPI, MPICH, SLURM, PSLITE, RK, WS

#: any variable of these launchers, declared above or not, is theirs: a job that
#: rdmamw.bootstrap.launch starts does not inherit it
LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "DMLC_")


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of ``name`` now: the environment's (or ``env``'s, a launcher's
    variables given as a mapping), parsed, or the default."""
    setting = SETTINGS[name]
    text = (os.environ if env is None else env).get(name)
    if text is None or text.strip() == "":
        return setting.default
    return setting.parse(text)


def raw(name: str) -> str | None:
    """The environment's text of the declared setting ``name``, unparsed (None when
    unset): a cheap key for a cache that must see the variable change."""
    if name not in SETTINGS:
        raise KeyError(name)
    return os.environ.get(name)


def source(name: str, env: Mapping[str, str] | None = None) -> str:
    """"environment" or "default"."""
    text = (os.environ if env is None else env).get(name)
    return "default" if text is None or text.strip() == "" else "environment"


def launcher_variables() -> tuple[str, ...]:
    """The declared variables a launcher sets (the ``set_by`` ones: those of the
    launcher section, and ``RDMAMW_RANK`` ... for a launcher of one's own)."""
    return tuple(s.name for s in SETTINGS.values() if s.set_by)


def without_launchers(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment (or ``env``) without any launcher's variables (the declared
    ones and every one of :data:`LAUNCHER_PREFIXES`): what a job we start inherits."""
    drop = set(launcher_variables())
    return {k: v for k, v in (os.environ if env is None else env).items()
            if k not in drop and not k.startswith(LAUNCHER_PREFIXES)}


#: variables of the build, the test suite and the benchmarks, not of the library
NOT_LIBRARY = ("RDMAMW_NATIVE", "RDMAMW_VM", "RDMAMW_TORCH",
               "RDMAMW_TEST_PROVIDERS")


def unknown() -> list[str]:
    """``RDMAMW_*`` variables in the environment that no setting declares (typos)."""
    return sorted(k for k in os.environ
                  if k.startswith("RDMAMW_") and k not in SETTINGS and k not in NOT_LIBRARY)


def effective() -> list[dict[str, Any]]:
    """Every setting's current value and where it came from; a bad value is shown as
    the error it raises (``rdmamw info --config``)."""
    rows = []
    for s in SETTINGS.values():
        try:
            value = get(s.name)
            shown = "***" if s.secret and value else value
        except ConfigError as e:
            shown = f"ERROR: {e}"
        rows.append({"name": s.name, "component": s.component, "value": shown,
                     "source": source(s.name), "default": s.default, "kind": s.kind,
                     "doc": s.doc})
    return rows


def markdown_table() -> str:
    """The tables of docs/config.md: the library's settings, then the launchers'
    variables."""
    lines = ["| variable | type | default | range | what it sets |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        if s.component == "launcher":
            continue
        default = "-" if s.default in (None, "") else s.default
        if s.kind == "bytes" and isinstance(default, int):
            default = _human_bytes(default)
        lines.append(f"| `{s.name}` | {s.kind} | {default} | {_range(s)} | {s.doc} |")
    lines += ["", "Set by launchers (read by `rdmamw.init()`, docs/api.md \"Jobs\"):", "",
              "| variable | type | range | set by | what it says |", "|---|---|---|---|---|"]
    lines += [f"| `{s.name}` | {s.kind} | {_range(s)} | {s.set_by} | {s.doc} |"
              for s in SETTINGS.values() if s.component == "launcher"]
    return "\n".join(lines) + "\n"


def _range(s: Setting) -> str:
    """A numeric setting's bounds as the table shows them (``-`` for the others)."""
    if s.kind not in ("int", "float", "bytes", "seconds"):
        return "-"
    if s.kind == "bytes":
        return f"{_human_bytes(int(s.minimum))}..{_human_bytes(int(s.maximum))}"
    if s.kind == "int":
        return f"{int(s.minimum)}..{int(s.maximum)}"
    return f"{s.minimum:g}..{s.maximum:g}"


def _human_bytes(n: int) -> str:
    for unit, size in (("P", 1 << 50), ("T", 1 << 40), ("G", G), ("M", M), ("K", K)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
