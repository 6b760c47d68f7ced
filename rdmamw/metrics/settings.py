"""The metrics' settings, declared into the one table of rdmamw/config.py when
rdmamw.metrics is imported; ``rdmamw info --config`` lists them under [metrics]."""

from __future__ import annotations

from rdmamw.config import MAX_RANKS, declare

declare("metrics", "RDMAMW_METRICS_PORT", "int", None,
        "serve Prometheus metrics over HTTP on this port + the local rank, from "
        "rdmamw.init() or the first channel on (default: off)", minimum=1, maximum=65535)
declare("metrics", "RDMAMW_METRICS_HOST_PORT", "int", None,
        "serve the metrics of every rank of this host at one endpoint on this port "
        "(the ranks take turns serving it), from rdmamw.init() or the first channel on "
        "(default: off)", minimum=1, maximum=65535)
declare("metrics", "RDMAMW_METRICS_ADDR", "str", "0.0.0.0",
        "the address the metrics endpoints listen on")
declare("metrics", "RDMAMW_METRICS_MAX_PEERS", "int", 64,
        "peers with series of their own; the channels to later ones are summed under "
        "peer=\"other\"", minimum=0, maximum=MAX_RANKS)
