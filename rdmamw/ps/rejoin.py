"""A lost worker's replacement joins the running job (``ps.start(rejoin=True)``).

When a server loses worker ``w`` (rank ``servers + w``) it counts the rank out of the
job (``World.depart``: on rank 0, a server, the store then takes a new process of that
rank, rdmamw/bootstrap/rejoin.py) and a thread waits for the replacement: once its new
descriptor is in rank 0's store (``World.refresh``), the thread opens the channel to
it and hands it to the server (``KVServer.admit``), which takes it in at a round
boundary. The replacement itself runs the same program: ``rdmamw.init()`` re-joins,
``ps.start`` opens its channels, ``init`` + ``pull_start`` get it the current model."""

from __future__ import annotations

import logging
import threading
import time

import rdmamw
from rdmamw.errors import RdmamwError, Timeout
from rdmamw.ps.server import KVServer

log = logging.getLogger("rdmamw.ps")

#: seconds of each wait for a replacement (between them the thread checks whether the
#: server has finished: nobody left to join)
SLICE = 1.0


class Rejoins:
    """Waits for the replacement of every worker ``server`` loses (see module doc)."""

    def __init__(self, server: KVServer, servers: int, *, slots: int, slot_size: int,
                 open_timeout: float) -> None:
        self.server, self.servers = server, servers
        self.slots, self.slot_size = slots, slot_size
        self.open_timeout = open_timeout
        server.on_lost.append(self.lost)

    def lost(self, w: int) -> None:
        rank = self.servers + w
        world = rdmamw.world()
        world.depart({rank})
        threading.Thread(target=self._wait, args=(w, rank), daemon=True,
                         name=f"rdmamw-ps-rejoin-{w}").start()

    def _wait(self, w: int, rank: int) -> None:
        world = rdmamw.world()
        while not self.server.finished:
            try:
                world.refresh({rank}, time.monotonic() + SLICE)
            except Timeout:
                continue
            except RdmamwError as e:
                log.warning("rdmamw.ps: no replacement of worker %d can join: %s", w, e)
                return
            try:
                ch = rdmamw.Channel.open(rank, timeout=self.open_timeout, slots=self.slots,
                                         slot_size=self.slot_size)
            except RdmamwError as e:
                log.warning("rdmamw.ps: worker %d's replacement did not connect: %s", w, e)
                continue
            self.server.admit(w, ch)
            return
