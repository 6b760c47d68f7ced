"""A rank of a job that loops a ring allreduce of 1 MiB until it fails, then prints
(one JSON line) when and how: the error's type, the rank it names (``.rank``) and its
message. Before the loop it prints ``{"ready": ...}`` so the test knows when to strike.
argv: the collective's timeout (seconds)."""

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
    try:
        while True:
            coll.allreduce(a, algorithm="ring", timeout=timeout)
            n += 1
    except rdmamw.RdmamwError as e:
        print(json.dumps({"rank": w.rank, "t": time.time(), "calls": n,
                          "error": type(e).__name__, "named": getattr(e, "rank", None),
                          "msg": str(e)}), flush=True)


if __name__ == "__main__":
    main()
