"""Roles in a launched job: ranks ``0 .. servers-1`` serve, the others work.

Every server opens a channel to every worker and every worker to every server, in
ascending rank order on both sides (the rule of ``Channel.open(rank)``)."""

from __future__ import annotations

import rdmamw
from rdmamw import config
from rdmamw.channel import Channel
from rdmamw.ps.consistency import Consistency
from rdmamw.ps.rejoin import Rejoins
from rdmamw.ps.server import KVServer
from rdmamw.ps.worker import KVWorker
from rdmamw.sched import Dsana


#: Ring of each parameter-server channel: 16 slots x 1 MiB, as the collectives'. Big
#: blocks cut the per-block Python cost of large tensors: a 4 MiB push+pull on shm
#: with 64 KiB blocks (the global default ring) took ~1.6-1.8x the two raw transfers,
#: with 1 MiB blocks ~1.15-1.3x (bench/ps_bench.py, loaded box). Small messages are
#: packed into one slot, so the few slots do not limit small tensors.
#: Those are RDMAMW_PS_SLOTS / RDMAMW_PS_SLOT_SIZE; RDMAMW_SLOTS / RDMAMW_SLOT_SIZE,
#: when set, win (as for every channel).
def ps_ring() -> tuple[int, int]:
    """(slots, slot_size) of a parameter-server channel's ring (docs/config.md)."""
    def pick(general: str, ps: str) -> int:
        return config.get(general if config.source(general) == "environment" else ps)
    return (pick("RDMAMW_SLOTS", "RDMAMW_PS_SLOTS"),
            pick("RDMAMW_SLOT_SIZE", "RDMAMW_PS_SLOT_SIZE"))


def connect(servers: int, open_timeout: float = 60.0, *, slots: int | None = None,
            slot_size: int | None = None) -> tuple[bool, dict[int, Channel]]:
    """Join the job (``rdmamw.init()``) and open this rank's channels: (True, worker
    index -> channel) on a server, (False, server index -> channel) on a worker. The
    channels can carry one KVServer / KVWorker pair after another (see ``done()``)."""
    default_slots, default_slot_size = ps_ring()
    slots = default_slots if slots is None else slots
    slot_size = default_slot_size if slot_size is None else slot_size
    w = rdmamw.init()
    if not 0 < servers < w.world_size:
        raise ValueError(f"need 1 .. {w.world_size - 1} servers in a world of "
                         f"{w.world_size}, not {servers}")
    if w.rank < servers:
        return True, {r - servers: rdmamw.Channel.open(r, timeout=open_timeout, slots=slots,
                                                       slot_size=slot_size)
                      for r in range(servers, w.world_size)}
    return False, {r: rdmamw.Channel.open(r, timeout=open_timeout, slots=slots,
                                          slot_size=slot_size) for r in range(servers)}


def start(servers: int, *, consistency: Consistency | str = "bsp", lr: float = 0.1,
          momentum: float = 0.9, timeout: float | None = None,
          open_timeout: float = 60.0, sched: str = "none", global_batch: int = 0,
          chunk: int | None = None, send_thread: bool = False,
          rejoin: bool = True) -> KVServer | KVWorker:
    """Join the job (``rdmamw.init()``) and return this rank's KVServer or KVWorker.
    The servers' worker indices are ``rank - servers``.

    ``sched="dsana"``: server 0 runs the DSANA scheduler over ``global_batch`` samples
    per round (workers read their share from ``KVWorker.assignment``). ``chunk``: the
    workers' block size in bytes (None: the channels' eager limit); ``send_thread``:
    their ``push_part`` copies out on a thread. ``rejoin``: a server waits for the
    replacement of each worker it loses and takes it into the running job
    (rdmamw/ps/rejoin.py); the replacement runs the same program (docs/ps.md)."""
    if sched not in ("none", "dsana"):
        raise ValueError(f"sched must be 'none' or 'dsana', not {sched!r}")
    serving, chans = connect(servers, open_timeout)
    if serving:
        plan = None
        if sched == "dsana" and rdmamw.world().rank == 0:
            plan = Dsana(sorted(chans), global_batch)
        server = KVServer(chans, consistency=consistency, lr=lr, momentum=momentum,
                          scheduler=plan)
        if rejoin:
            slots, slot_size = ps_ring()
            Rejoins(server, servers, slots=slots, slot_size=slot_size,
                    open_timeout=open_timeout)
        return server
    return KVWorker([chans[s] for s in sorted(chans)], timeout=timeout, chunk=chunk,
                    send_thread=send_thread)


def worker_index(servers: int) -> int:
    """This worker's index (0-based), as the servers number it."""
    return rdmamw.world().rank - servers
