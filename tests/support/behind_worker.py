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

import numpy as np

import rdmamw
import rdmamw.collectives as coll


def main() -> None:
    slow, sleep = int(sys.argv[1]), float(sys.argv[2])
    timeouts = [float(t) for t in sys.argv[3].split(",")]
    w = rdmamw.init(timeout=60)
    a = np.ones(1000, np.float32)
    coll.allreduce(a, timeout=30)
    if w.rank == slow:
        time.sleep(sleep)
    t0 = time.monotonic()
    out = {"rank": w.rank}
    try:
        if sys.argv[4:] == ["aio"]:
            from rdmamw.aio import collectives as acoll
            asyncio.run(acoll.allreduce(a, timeout=timeouts[w.rank]))
        else:
            coll.allreduce(a, timeout=timeouts[w.rank])
        out.update(error=None)
    except rdmamw.RdmamwError as e:
        out.update(error=type(e).__name__, named=getattr(e, "rank", None), msg=str(e))
    out["t"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
