"""The words several layers spell, declared once with their checks: the channel modes,
the rendezvous strategies (how a message above the eager limit travels) and the
allreduce algorithms. Every
layer may import this module (it imports nothing of the package): the settings table
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

#: the allreduce algorithms one may force (``AUTO``: the tuned cost model chooses)
ALLREDUCE_ALGORITHMS = ("ring", "rhd", "hierarchical")


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
