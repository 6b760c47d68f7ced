"""A rank of a 3-rank job in which ranks 0 and 1 are blocked *sending* to a rank that
stopped: every rank runs one gather to rank 2 (the channels open) on a communicator of
small rings (4 slots of 64 KiB, chunks of 64 KiB: RDMAMW_COLL_CHUNK set by the test),
then a gather of 4 MiB to rank 2, each with its own deadline; rank 2 stops itself
(SIGSTOP) as that gather's header round ends, so the others' sends fill its rings and
block (argv: ``T0,T1 blocking|aio``; ``aio``: the gather is awaited,
rdmamw.aio.collectives). Ranks 0 and 1 print one JSON line: the error of that gather
(type, ``.rank``, message) and ``t``, seconds from its start to the error
(behind_worker.report)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import numpy as np
from behind_worker import report  # (run as a script: tests/support is sys.path[0])

import rdmamw
import rdmamw.collectives as coll

STOPPED = 2


def stop_after_header(comm: coll.Communicator) -> None:
    """Make this rank stop itself once the next collective's header round is over."""
    agree = comm.agree

    def stopping(header: list[Any]) -> Any:
        out = yield from agree(header)
        os.kill(os.getpid(), signal.SIGSTOP)
        return out
    comm.agree = stopping       # type: ignore[method-assign]


def main() -> None:
    timeouts = [float(t) for t in sys.argv[1].split(",")]
    w = rdmamw.init(timeout=60)
    comm = coll.Communicator(w, slots=4, slot_size=64 * 1024, timeout=30)
    coll.gather(np.ones(1000, np.float32), root=STOPPED, comm=comm)
    a = np.ones(1 << 20, np.float32)
    if w.rank == STOPPED:
        stop_after_header(comm)
        timeouts.append(60.0)
    if sys.argv[2] == "aio":
        from rdmamw.aio import collectives as acoll
        report(w.rank, lambda: asyncio.run(acoll.gather(a, root=STOPPED, comm=comm,
                                                        timeout=timeouts[w.rank])))
    else:
        report(w.rank, lambda: coll.gather(a, root=STOPPED, comm=comm,
                                           timeout=timeouts[w.rank]))


if __name__ == "__main__":
    main()
