"""A rank of a 4-rank job that loses rank 2 and takes a replacement back. The ranks
loop a ring allreduce until it fails, shrink, check one allreduce on the survivors and
print ``{"shrunk": ...}``; then they grow the communicator back and print the result
of an allreduce over the whole job. Started with ``replacement`` (rank 2's launcher
environment, after the kill), a process re-joins instead: ``rdmamw.init()``, then
``coll.join()`` and the same allreduce. argv: the collectives' timeout, the mode, and
how long a grow waits for the replacement (default 30 s; the VM's slow Python starts
need more)."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import rdmamw
import rdmamw.collectives as coll

#: the grown job's allreduce: rank r sends (r + 1) * arange(N)
N = 3000


def grown(w: rdmamw.World, comm: coll.Communicator, timeout: float) -> dict:
    x = np.arange(N, dtype=np.float64) * (w.rank + 1)
    got = coll.allreduce(x, comm=comm, timeout=timeout)
    return {"rank": w.rank, "members": comm.members, "new_rank": comm.rank,
            "result": got.tolist(), "t": time.time()}


def main() -> None:
    timeout, mode = float(sys.argv[1]), sys.argv[2]
    wait = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    if mode == "replacement":
        w = rdmamw.init(timeout=wait)
        comm = coll.join(timeout=wait)
        print(json.dumps(grown(w, comm, timeout)), flush=True)
        return
    w = rdmamw.init(timeout=60)
    a = np.ones(1 << 18, np.float32)
    coll.allreduce(a, algorithm="ring", timeout=timeout)
    print(json.dumps({"rank": w.rank, "ready": True}), flush=True)
    try:
        while True:
            coll.allreduce(a, algorithm="ring", timeout=timeout)
    except rdmamw.RdmamwError as e:
        named = getattr(e, "rank", None)
    comm = coll.shrink()
    x = np.full(1000, float(w.rank + 1), np.float64)
    got = coll.allreduce(x, comm=comm, timeout=timeout)
    print(json.dumps({"rank": w.rank, "named": named, "shrunk": comm.members,
                      "sum": float(got[0]), "same": bool((got == got[0]).all())}),
          flush=True)
    comm = coll.grow(timeout=wait)
    print(json.dumps(grown(w, comm, timeout)), flush=True)


if __name__ == "__main__":
    main()
