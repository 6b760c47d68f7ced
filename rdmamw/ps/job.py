"""Roles in a launched job: ranks ``0 .. servers-1`` serve, the others work.

Every server opens a channel to every worker and every worker to every server, in
ascending rank order on both sides (the rule of ``Channel.open(rank)``)."""

from __future__ import annotations

import rdmamw
from rdmamw.ps.consistency import Consistency
from rdmamw.ps.server import KVServer
from rdmamw.ps.worker import KVWorker
from rdmamw.sched import Dsana


def start(servers: int, *, consistency: Consistency | str = "bsp", lr: float = 0.1,
          momentum: float = 0.9, timeout: float | None = None,
          open_timeout: float = 60.0, sched: str = "none", global_batch: int = 0,
          chunk: int | None = None, send_thread: bool = False) -> KVServer | KVWorker:
    """Join the job (``rdmamw.init()``) and return this rank's KVServer or KVWorker.
    The servers' worker indices are ``rank - servers``.

    ``sched="dsana"``: server 0 runs the DSANA scheduler over ``global_batch`` samples
    per round (workers read their share from ``KVWorker.assignment``). ``chunk``: the
    workers' block size in bytes (None: the channels' eager limit); ``send_thread``:
    their ``push_part`` copies out on a thread."""
    if sched not in ("none", "dsana"):
        raise ValueError(f"sched must be 'none' or 'dsana', not {sched!r}")
    w = rdmamw.init()
    if not 0 < servers < w.world_size:
        raise ValueError(f"need 1 .. {w.world_size - 1} servers in a world of "
                         f"{w.world_size}, not {servers}")
    if w.rank < servers:
        chans = {r - servers: rdmamw.Channel.open(r, timeout=open_timeout)
                 for r in range(servers, w.world_size)}
        plan = None
        if sched == "dsana" and w.rank == 0:
            plan = Dsana(sorted(chans), global_batch)
        return KVServer(chans, consistency=consistency, lr=lr, momentum=momentum,
                        scheduler=plan)
    return KVWorker([rdmamw.Channel.open(r, timeout=open_timeout) for r in range(servers)],
                    timeout=timeout, chunk=chunk, send_thread=send_thread)


def worker_index(servers: int) -> int:
    """This worker's index (0-based), as the servers number it."""
    return rdmamw.world().rank - servers
