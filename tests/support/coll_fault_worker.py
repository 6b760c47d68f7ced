"""A rank of a job that loops a ring allreduce of 1 MiB until it fails, then prints
(one JSON line) when and how: the error's type, the rank it names (``.rank``) and its
message. Before the loop it prints ``{"ready": ...}`` so the test knows when to strike.
argv: the collective's timeout (seconds), and ``shrink``: then the survivors shrink
the communicator and run one more allreduce on it (its result and the time printed);
``leave N``: rank 2 closes its communicator after its N-th allreduce (the others are
then in the next one) and stays alive, idle, until killed."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import rdmamw
import rdmamw.collectives as coll


def main() -> None:
    w = rdmamw.init(timeout=60)
    a = np.ones(1 << 18, np.float32)
    timeout = float(sys.argv[1])
    coll.allreduce(a, algorithm="ring", timeout=timeout)
    print(json.dumps({"rank": w.rank, "ready": True}), flush=True)
    n = 0
    leave = int(sys.argv[sys.argv.index("leave") + 1]) if "leave" in sys.argv else None
    try:
        while True:
            coll.allreduce(a, algorithm="ring", timeout=timeout)
            n += 1
            if n == leave and w.rank == 2:
                coll.default_comm().close()
                time.sleep(3600)
    except rdmamw.RdmamwError as e:
        out = {"rank": w.rank, "t": time.time(), "calls": n, "error": type(e).__name__,
               "named": getattr(e, "rank", None), "msg": str(e)}
    if "shrink" in sys.argv[2:]:
        comm = coll.shrink()
        out["t_shrunk"] = time.time()
        x = np.full(1000, float(w.rank + 1), np.float64)
        got = coll.allreduce(x, comm=comm, timeout=timeout)
        out.update(members=comm.members, new_rank=comm.rank, sum=float(got[0]),
                   same=bool((got == got[0]).all()), t_after=time.time())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
