"""A rank of a 3-rank job in which one rank falls behind: every rank runs one allreduce
(the channels open), then rank ``SLOW`` sleeps ``SLEEP`` s (user code) before its next
allreduce while the others enter theirs at once, each with its own deadline (argv:
``SLOW SLEEP T0,T1,T2 [aio]``; ``aio``: that allreduce is awaited,
rdmamw.aio.collectives). Prints one JSON line per rank: the error of that allreduce
(type, ``.rank``, message) and ``t``, seconds from its start to the error."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import rdmamw
import rdmamw.collectives as coll


def report(rank: int, call: Callable[[], Any]) -> None:
    """Run ``call`` (one collective) and print rank ``rank``'s JSON line: its error
    (type, ``.rank``, message; None) and ``t``, seconds from its start to the end."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"rank": rank}
    try:
        call()
        out.update(error=None)
    except rdmamw.RdmamwError as e:
        out.update(error=type(e).__name__, named=getattr(e, "rank", None), msg=str(e))
    out["t"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


def main() -> None:
    slow, sleep = int(sys.argv[1]), float(sys.argv[2])
    timeouts = [float(t) for t in sys.argv[3].split(",")]
    w = rdmamw.init(timeout=60)
    a = np.ones(1000, np.float32)
    coll.allreduce(a, timeout=30)
    if w.rank == slow:
        time.sleep(sleep)
    if sys.argv[4:] == ["aio"]:
        from rdmamw.aio import collectives as acoll
        report(w.rank, lambda: asyncio.run(acoll.allreduce(a, timeout=timeouts[w.rank])))
    else:
        report(w.rank, lambda: coll.allreduce(a, timeout=timeouts[w.rank]))


if __name__ == "__main__":
    main()
