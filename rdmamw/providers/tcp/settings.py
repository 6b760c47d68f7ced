"""The tcp provider's settings, declared into the one table of rdmamw/config.py when the
provider's package is imported; ``rdmamw info --config`` lists them under [tcp]."""

from __future__ import annotations

from rdmamw.config import declare

MAX_PEER_HEARTBEAT = 60.0       # the largest heartbeat a tcp peer accepts (provider.py)

declare("tcp", "RDMAMW_TCP_HEARTBEAT", "seconds", 0.25,
        "interval of heartbeats on an idle tcp connection (0: none; at most the 60 s a peer "
        "accepts)", maximum=MAX_PEER_HEARTBEAT)
declare("tcp", "RDMAMW_TCP_PEER_TIMEOUT", "seconds", 30.0,
        "silence of a tcp peer process (stopped, starved) after which it is lost", minimum=1e-3)
declare("tcp", "RDMAMW_TCP_HOST_TIMEOUT", "seconds", 1.5,
        "silence of a tcp peer whose host also acknowledges nothing (link down, power off) "
        "after which it is lost (0: only the peer timeout)")
