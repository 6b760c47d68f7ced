"""One rank of a status test job (tests/integrations/test_status.py, started through
rdmamw.bootstrap.launch with RDMAMW_METRICS_HOST_PORT or RDMAMW_METRICS_PORT set).
Rank 0 opens a channel to rank 1, and every rank runs one allreduce; then it prints
"ready" and:

- the last rank (the straggler) waits for a line on stdin before its second allreduce,
- rank 0 waits (blocking) for a message from rank 1 on their channel, then joins the
  second allreduce, in which it and the others wait for the straggler,
- rank 1 sends rank 0 that message after its line on stdin.

Each prints "done" after the second allreduce (or the error that ended it, if the
straggler died) and exits after one more line."""

from __future__ import annotations

import sys

import numpy as np

import rdmamw
from rdmamw.collectives import allreduce


def main() -> None:
    w = rdmamw.init()
    me, last = w.rank, w.world_size - 1
    ch = rdmamw.Channel.open(1 - me) if me in (0, 1) else None
    allreduce(np.ones(4, np.float32))
    print("ready", flush=True)
    if me == last:
        sys.stdin.readline()
    if me == 0 and ch is not None:
        ch.recv(timeout=120).release()
    if me == 1 and ch is not None:
        sys.stdin.readline()
        ch.send(b"go")
    try:
        allreduce(np.ones(4, np.float32), timeout=120)
        print("done", flush=True)
    except rdmamw.RdmamwError as e:
        print(f"failed: {type(e).__name__}", flush=True)
    sys.stdin.readline()
    if ch is not None:
        ch.close()


if __name__ == "__main__":
    main()
