"""The collectives' settings, declared into the one table of rdmamw/config.py when
rdmamw.collectives is imported; ``rdmamw info --config`` lists them under [collectives]."""

from __future__ import annotations

from rdmamw import vocabulary
from rdmamw.config import MAX_RING_SLOTS, G, K, LazyChoices, M, declare
from rdmamw.errors import ConfigError
from rdmamw.vocabulary import AUTO


def _topology(value: str, what: str) -> str:
    if value in ("host", "hostname", "probe") or "," in value:
        return value
    raise ConfigError(f"{what}={value!r} is not host, hostname, probe or comma-separated "
                      "labels (one per rank)")


declare("collectives", "RDMAMW_COLL_SLOTS", "int", 16, "slots of a collective channel's ring",
        minimum=1, maximum=MAX_RING_SLOTS)
declare("collectives", "RDMAMW_COLL_SLOT_SIZE", "bytes", M, "slot bytes of a collective channel",
        minimum=64, maximum=G)
declare("collectives", "RDMAMW_COLL_MIN_CHUNK", "bytes", 16 * K, "smallest pipeline chunk",
        minimum=1, maximum=G)
declare("collectives", "RDMAMW_COLL_CHUNK", "bytes", 4 * M,
        "largest pipeline chunk on channels with rendezvous (others: their eager limit)",
        minimum=64, maximum=G)
declare("collectives", "RDMAMW_COLL_SPIN_US", "float", None,
        "microseconds a collective's wait spins before it sleeps (default RDMAMW_SPIN_US; 0 "
        "when this host runs more ranks than it has CPUs)", minimum=0.0)
declare("collectives", "RDMAMW_COLL_PIECES", "int", 1, "pipeline pieces per transfer", minimum=1,
        maximum=1 << 16)
declare("collectives", "RDMAMW_COLL_RESULT_BYTES", "bytes", G,
        "idle bytes the pool of out-of-place collective results keeps")
declare("collectives", "RDMAMW_ALLREDUCE_ALGORITHM", "choice", "",
        "force an allreduce algorithm",
        choices=LazyChoices(lambda: (AUTO, *vocabulary.allreduce_algorithms(), "")))
declare("collectives", "RDMAMW_COLL_CONFIG", "path", "",
        "cost-model file of `rdmamw tune` (default ~/.config/rdmamw/collectives.json)")
declare("collectives", "RDMAMW_COLL_TOPOLOGY", "str", "host",
        "how ranks group for hierarchical algorithms: host, hostname, probe, or labels "
        "(comma-separated, one per rank)", check=_topology)
declare("collectives", "RDMAMW_COLL_TIMEOUT", "seconds", 600.0,
        "seconds a collective may take before every member raises Timeout naming the rank "
        "it waited for (a communicator's default; timeout= of a call wins)", minimum=1e-3)
