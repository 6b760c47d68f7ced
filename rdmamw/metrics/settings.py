"""The metrics' settings, declared into the one table of rdmamw/config.py when
rdmamw.metrics is imported; ``rdmamw info --config`` lists them under [metrics]."""

from __future__ import annotations

from rdmamw.config import MAX_RANKS, declare

declare("metrics", "RDMAMW_METRICS_PORT", "int", None,
        "serve Prometheus metrics over HTTP on this port + the local rank, from "
        "rdmamw.init() or the first channel on (default: off)", minimum=1, maximum=65535)
declare("metrics", "RDMAMW_METRICS_HOST_PORT", "int", None,
        "serve the metrics of every rank of this host at one endpoint on this port "
        "(every rank accepts on one shared socket), from rdmamw.init() or the first channel on "
        "(default: off)", minimum=1, maximum=65535)
declare("metrics", "RDMAMW_METRICS_ADDR", "str", "0.0.0.0",
        "the address the metrics endpoints listen on")
declare("metrics", "RDMAMW_METRICS_MAX_PEERS", "int", 64,
        "peers with series of their own; the channels to later ones are summed under "
        "peer=\"other\"", minimum=0, maximum=MAX_RANKS)
declare("metrics", "RDMAMW_METRICS_TIMEOUT", "seconds", 5.0,
        "seconds an endpoint's connection may wait on its client (for each read of the "
        "request, for the whole write of the answer) before it is closed", minimum=0.1,
        maximum=3600.0)
declare("metrics", "RDMAMW_METRICS_MAX_CONNECTIONS", "int", 64,
        "connections an endpoint serves at once (each a thread); a newcomer beyond them "
        "closes the oldest one still waiting for its request, or is closed itself",
        minimum=1, maximum=4096)
