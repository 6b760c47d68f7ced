"""A rank of a 5-rank job that loses rank 4, then its coordinator inside the shrink:
every rank runs small allreduces; rank 4 kills itself before the third; the
survivors shrink, rank 0 (the agreement's coordinator) with the test-only hooks of
tests/support/shrink_hooks.py (argv: TIMEOUT HOOKS, JSON), which kill it at a step of
the agreement. Each other survivor prints one JSON line: the members it got, then
the result of the next allreduce (every rank's ``data``) on them, whole; if that
allreduce names a member lost (the coordinator, when it died after its decision went
out), how long that took, the members of a second shrink and its allreduce's result."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
from shrink_hooks import install  # (run as a script: tests/support is sys.path[0])

import rdmamw
import rdmamw.collectives as coll

N = 1000


def data(rank: int) -> np.ndarray:
    return np.arange(N, dtype=np.float64) * (rank + 1) + rank


def step(comm: coll.Communicator, timeout: float) -> dict:
    """The next allreduce on ``comm`` (and, if it names a lost member, a shrink and
    another)."""
    out: dict = {"members": comm.members}
    t0 = time.monotonic()
    try:
        out["result"] = coll.allreduce(data(comm.world.rank), comm=comm,
                                       timeout=timeout).tolist()
    except (rdmamw.PeerLost, rdmamw.Timeout) as e:
        out["lost"] = comm.members[e.rank] if getattr(e, "rank", None) is not None else None
        out["named_after"] = time.monotonic() - t0
        out["again"] = step(comm.shrink(), timeout)
    return out


def main() -> None:
    timeout, hooks = float(sys.argv[1]), json.loads(sys.argv[2])
    w = rdmamw.init(timeout=60)
    x = np.ones(100, np.float32)
    try:
        for call in range(10):
            if call == 2 and w.rank == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            coll.allreduce(x, timeout=timeout)
        raise AssertionError("rank 4 was not lost")
    except rdmamw.PeerLost as e:
        named = e.rank
    install(hooks, w.rank)
    out = {"rank": w.rank, "named": named}
    try:
        out.update(step(coll.shrink(), timeout))
    except rdmamw.RdmamwError as e:
        out.update(error=type(e).__name__, msg=str(e))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
