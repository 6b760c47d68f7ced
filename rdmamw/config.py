"""The one table of every ``RDMAMW_*`` setting, each declared once: name, type, default
and a one-line doc; and, in a section of their own, the variables launchers set
(torchrun's, MPI's, Slurm's, ps-lite's), which the bootstrap reads through the same
table.

As UCX has each component declare its own settings table (``ucs_config_field_t``), a
component declares its settings with :func:`declare` in a ``settings`` module of its own
(``rdmamw/providers/tcp/settings.py``, ``rdmamw/memory/settings.py`` ...) that its package
imports, so a setting is declared before its owner reads it; the core's settings
(channel, bootstrap, log) and the launchers' variables are declared here.
:data:`COMPONENTS` names every component with the module that declares it, and
:func:`declared` imports them all, by name as the provider registry does, for the full
listing.

As NCCL reads each variable through one parser, the package reads its environment only
through :func:`get`, at the moment a value is used (never at import, so a bad value
fails the call that needs it, with a :class:`~rdmamw.errors.ConfigError` naming the
variable and the value). Sizes take units (``64K``, ``1G``), durations too
(``250ms``, ``10s``, ``2m``). ``rdmamw info --config`` prints the effective values and
where each came from; docs/config.md is the table, kept in step by a test.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rdmamw.errors import ConfigError

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
    owner: str = ""             # the module that declared it (a component's settings module)

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


#: name -> setting, in the order declared: the core's, and those of the components
#: imported so far (:func:`declared` imports them all)
SETTINGS: dict[str, Setting] = {}


#: the components, in the order ``rdmamw info --config`` and docs/config.md list them,
#: each with the module that declares its settings (None: this one); a plug-in's own
#: components, declared when it is imported, come after them
COMPONENTS: tuple[tuple[str, str | None], ...] = (
    ("channel", None),
    ("memory", "rdmamw.memory.settings"),
    ("shm", "rdmamw.providers.shm.settings"),
    ("tcp", "rdmamw.providers.tcp.settings"),
    ("verbs", "rdmamw.providers.verbs.settings"),
    ("bootstrap", None),
    ("collectives", "rdmamw.collectives.settings"),
    ("ps", "rdmamw.ps.settings"),
    ("metrics", "rdmamw.metrics.settings"),
    ("trace", "rdmamw.trace.settings"),
    ("log", None),
    ("launcher", None),
)
_all_imported = False


def declare(component: str, name: str, kind: str, default: Any, doc: str, **kw: Any) -> None:
    """Add the setting ``name`` of ``component`` to the table (once: AssertionError the
    second time); a number needs a maximum the code can honour (seconds, bytes and
    floats get their kind's). Called at the import of the component's settings module,
    which is recorded as the setting's ``owner``."""
    if name in SETTINGS:
        raise AssertionError(f"{name} declared twice")
    if "maximum" not in kw and kind in ("seconds", "bytes", "float"):
        kw["maximum"] = {"seconds": MAX_SECONDS, "bytes": MAX_BYTES, "float": MAX_SPIN_US}[kind]
    if kind in ("int", "float", "bytes", "seconds") and not kw.get("maximum", math.inf) < math.inf:
        raise AssertionError(f"{name}: a number needs a maximum the code can honour")
    kw.setdefault("owner", sys._getframe(1).f_globals.get("__name__", ""))
    SETTINGS[name] = Setting(name, kind, default, doc, component, **kw)


def declared() -> dict[str, Setting]:
    """Every setting: the modules of :data:`COMPONENTS` imported (once), the table in
    their order, each component's settings in the order declared."""
    global _all_imported
    if not _all_imported:
        for _, module in COMPONENTS:
            if module is not None:
                importlib.import_module(module)
        _all_imported = True
    order = {component: i for i, (component, _) in enumerate(COMPONENTS)}
    for s in SETTINGS.values():
        order.setdefault(s.component, len(order))
    return dict(sorted(SETTINGS.items(), key=lambda item: order[item[1].component]))


def setting(name: str) -> Setting:
    """The declared setting ``name`` (every component's declared first if need be), else
    KeyError."""
    found = SETTINGS.get(name)
    return found if found is not None else declared()[name]


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
MAX_UNPROVEN = 1 << 16          # unproven connections a listener holds (each an fd; a
                                # newcomer at the cap scans them: rdmamw/listener.py)
D = declare
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
# log
D("log", "RDMAMW_LOG_LEVEL", "str", "",
  "level of the 'rdmamw' logger: debug, info, warning (default), error, critical")
D("log", "RDMAMW_LOG_FILE", "path", "",
  "log to this file instead of stderr (%h: host name, %p: pid)")


# launchers: what torchrun, mpirun, srun, ps-lite (and rdmamw.bootstrap.launch) set for
# the processes they start; rdmamw.init() reads them (rdmamw/bootstrap/env.py)
def L(name: str, kind: str, set_by: str, doc: str, **kw: Any) -> None:
    declare("launcher", name, kind, kw.pop("default", None), doc, set_by=set_by, **kw)


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
L("OMPI_COMM_WORLD_LOCAL_RANK", "int", OMPI, "this process's rank on its host", **RK)
L("PMI_RANK", "int", MPICH, "this process's rank", **RK)
L("PMI_SIZE", "int", MPICH, "ranks in the job", **WS)
L("MPI_LOCALNRANKS", "int", MPICH, "ranks on this host", **WS)
L("MPI_LOCALRANKID", "int", MPICH, "this process's rank on its host", **RK)
L("SLURM_PROCID", "int", SLURM, "this process's rank", **RK)
L("SLURM_NTASKS", "int", SLURM, "ranks in the job", **WS)
L("SLURM_NTASKS_PER_NODE", "int", SLURM, "ranks per host", **WS)
L("SLURM_LOCALID", "int", SLURM, "this process's rank on its host", **RK)
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
    s = setting(name)
    text = (os.environ if env is None else env).get(name)
    if text is None or text.strip() == "":
        return s.default
    return s.parse(text)


def raw(name: str) -> str | None:
    """The environment's text of the declared setting ``name``, unparsed (None when
    unset): a cheap key for a cache that must see the variable change."""
    setting(name)
    return os.environ.get(name)


def source(name: str, env: Mapping[str, str] | None = None) -> str:
    """"environment" or "default" (KeyError for an undeclared ``name``)."""
    setting(name)
    text = (os.environ if env is None else env).get(name)
    return "default" if text is None or text.strip() == "" else "environment"


def launcher_variables() -> tuple[str, ...]:
    """The declared variables a launcher sets (the ``set_by`` ones: those of the
    launcher section, and ``RDMAMW_RANK`` ... for a launcher of one's own)."""
    return tuple(s.name for s in declared().values() if s.set_by)


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
    table = declared()
    return sorted(k for k in os.environ
                  if k.startswith("RDMAMW_") and k not in table and k not in NOT_LIBRARY)


def effective() -> list[dict[str, Any]]:
    """Every setting's current value and where it came from; a bad value is shown as
    the error it raises (``rdmamw info --config``)."""
    rows = []
    for s in declared().values():
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
    table = declared()
    lines = ["| variable | type | default | range | what it sets |", "|---|---|---|---|---|"]
    for s in table.values():
        if s.component == "launcher":
            continue
        default = "-" if s.default in (None, "") else s.default
        if s.kind == "bytes" and isinstance(default, int):
            default = _human_bytes(default)
        lines.append(f"| `{s.name}` | {s.kind} | {default} | {_range(s)} | {s.doc} |")
    lines += ["", "Set by launchers (read by `rdmamw.init()`, docs/api.md \"Jobs\"):", "",
              "| variable | type | range | set by | what it says |", "|---|---|---|---|---|"]
    lines += [f"| `{s.name}` | {s.kind} | {_range(s)} | {s.set_by} | {s.doc} |"
              for s in table.values() if s.component == "launcher"]
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
