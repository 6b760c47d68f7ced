"""The parameter server's settings, declared into the one table of rdmamw/config.py when
rdmamw.ps is imported; ``rdmamw info --config`` lists them under [ps]."""

from __future__ import annotations

from rdmamw.config import MAX_RING_SLOTS, G, M, declare

declare("ps", "RDMAMW_PS_SLOTS", "int", 16, "slots of a parameter-server channel's ring", minimum=1,
        maximum=MAX_RING_SLOTS)
declare("ps", "RDMAMW_PS_SLOT_SIZE", "bytes", M, "slot bytes of a parameter-server channel",
        minimum=64, maximum=G)
declare("ps", "RDMAMW_PS_INIT_TIMEOUT", "seconds", 60.0,
        "how long a read of a key waits for the rest of initial values a worker began to send; "
        "then the read is refused (PSError) instead of waiting for ever")
declare("ps", "RDMAMW_PS_REPLY_TIMEOUT", "seconds", 10.0,
        "seconds a server's reply may wait for its worker to take it (the ring full: the worker "
        "sends and never reads); then that worker is dropped and the others served",
        minimum=0.1, maximum=3600.0)
declare("ps", "RDMAMW_PS_PULL", "choice", "two-sided",
        "how a worker pulls: 'two-sided' (asks the server) or 'one-sided' (READs the "
        "server's exposed shard, no server CPU; consistency 'asp' only, docs/ps.md)",
        choices=("two-sided", "one-sided"))
declare("ps", "RDMAMW_PS_PULL_TRIES", "int", 8,
        "reads of a shard a one-sided pull makes while the server keeps changing it; then "
        "it pulls two-sided (counted)", minimum=1, maximum=10000)
