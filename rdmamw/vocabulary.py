"""The words several layers spell, declared once with their checks: the channel modes,
the rendezvous strategies (how a message above the eager limit travels) and the
allreduce algorithms (the built-in ones' names, and those registered since, which
rdmamw/collectives/algorithms/'s registry adds). Every layer may import this module
(it imports nothing of the package): the settings table
takes its choices from here, the wire check of a peer's hello, the channel's options,
the engine, the tuning file and ``rdmamw tune rndv`` too. (The provider names are the
provider registry's, ``rdmamw.providers``.)"""

from __future__ import annotations

#: the bitmap protocol (batched acknowledgements), and the per-message acknowledged
#: baseline
BATCHED, ACK = "batched", "ack"
MODES = (BATCHED, ACK)

#: the receiver READs from the sender's buffer; the sender WRITEs into a buffer the
#: receiver posted (else the receiver READs); no rendezvous: every message is eager
READ, WRITE, OFF = "read", "write", "off"
#: what the engine runs (and RDMAMW_RNDV_STRATEGY and the tuning file may say)
RNDV_STRATEGIES = (READ, WRITE, OFF)
#: the choice the tuning (a file, a cost model) or the built-in default makes
AUTO = "auto"
#: what ``Channel.open(rendezvous=...)`` and ``listen(rendezvous=...)`` take
RNDV_OPTIONS = (AUTO, *RNDV_STRATEGIES)
#: the strategies that move data by rendezvous (``OFF`` does not)
RNDV_TRANSFERS = (READ, WRITE)



#: the built-in allreduce algorithms, each a module of rdmamw/collectives/algorithms/
#: (whose registry imports it by this name)
ALLREDUCE_BUILTIN = ("ring", "rhd", "hierarchical")
#: the ones registered since (``rdmamw.collectives.algorithms.register`` names them
#: here, so the layers below the collectives, the settings table, know them too)
_allreduce_registered: list[str] = []


def allreduce_algorithms() -> tuple[str, ...]:
    """The allreduce algorithms one may force (``AUTO``: the tuned cost model chooses):
    the built-in ones, then those registered (``ALLREDUCE_ALGORITHMS`` reads this too)."""
    return tuple(dict.fromkeys([*ALLREDUCE_BUILTIN, *_allreduce_registered]))


def name_allreduce_algorithm(name: str, known: bool = True) -> None:
    """Add (``known``) or drop a registered algorithm's name: only the registry calls
    this."""
    if known and name not in _allreduce_registered:
        _allreduce_registered.append(name)
    elif not known and name in _allreduce_registered:
        _allreduce_registered.remove(name)


def __getattr__(name: str) -> object:
    if name == "ALLREDUCE_ALGORITHMS":
        return allreduce_algorithms()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_mode(mode: object, error: type[Exception] = ValueError,
               what: str = "mode") -> str:
    """``mode`` if it is one of :data:`MODES`, else ``error`` naming ``what``."""
    if mode not in MODES:
        raise error(f"{what} must be one of {', '.join(MODES)}, not {mode!r}")
    return mode        # type: ignore[return-value]


def check_rendezvous(value: object, error: type[Exception] = ValueError,
                     what: str = "rendezvous",
                     allowed: tuple[str, ...] = RNDV_OPTIONS) -> str:
    """``value`` if it is one of ``allowed`` (default :data:`RNDV_OPTIONS`; the engine
    and the tuning file take :data:`RNDV_STRATEGIES`), else ``error`` naming ``what``."""
    if value not in allowed:
        raise error(f"{what} must be one of {', '.join(allowed)}, not {value!r}")
    return value       # type: ignore[return-value]
