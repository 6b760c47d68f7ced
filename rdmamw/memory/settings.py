"""The memory layer's settings (the registration caches, the buffer pools, the rendezvous
thresholds), declared into the one table of rdmamw/config.py when rdmamw.memory is
imported; ``rdmamw info --config`` lists them under [memory]."""

from __future__ import annotations

from rdmamw.config import G, M, declare
from rdmamw.vocabulary import RNDV_STRATEGIES

declare("memory", "RDMAMW_REGCACHE_BYTES", "bytes", G,
        "registered bytes each registration cache keeps (verbs with windows: the process's "
        "caches, else each channel's)")
declare("memory", "RDMAMW_POOL_BYTES", "bytes", 256 * M, "bytes a buffer pool keeps")
declare("memory", "RDMAMW_POOL_SHARDS", "int", None,
        "per-thread shards of a buffer pool (default min(8, CPUs))", minimum=1, maximum=1024)
declare("memory", "RDMAMW_RNDV_STRATEGY", "choice", "",
        "rendezvous strategy for large messages, over the tuning file",
        choices=(*RNDV_STRATEGIES, ""))
declare("memory", "RDMAMW_RNDV_THRESHOLD", "bytes", None,
        "size from which messages go by rendezvous, over the tuning file")
declare("memory", "RDMAMW_TUNE_FILE", "path", "",
        "rendezvous tuning file (default ~/.config/rdmamw/rendezvous.json)")
