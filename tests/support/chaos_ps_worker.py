"""A rank of a chaos trial in the ``ps`` layer (bench/chaos.py): rank 0 is the
parameter server (rdmamw.ps, BSP, lr 0.5, no momentum, rounds closed without a
silent worker after TIMEOUT s), the others workers (their calls' deadline 3 x
TIMEOUT) looping push + pull of one key.
Every worker pushes a gradient of ones, so every round moves the model by exactly
-0.5 whoever is in it: a worker's pull after its i-th push must read -0.5 * i.

docs/ps.md "Faults" promises: a worker that dies, goes silent or leaves is dropped and
the others go on; a server that dies fails the workers' next call (no hang). So:

* a worker prints ``{"rank", "ready"}`` after its first round, then loops; after
  SIGUSR2 (the driver's "report", once the fault is past), at the end of its round,
  ``{"rank", "t", "calls", "wrong", "error": None, "t_last"}`` (``t_last``: when its
  last round ended), says goodbye and exits; on an error ``{"rank", "t", "calls",
  "wrong", "error", "named", "msg"}``;
* the server prints ``{"rank", "ready"}`` and serves until every worker said goodbye
  or was lost, then ``{"rank", "served", "lost"}``;
* SIGUSR1 (the ``close`` fault): a worker says goodbye and closes its channels, the
  server closes its channels, wherever they are; then either idles, alive.

argv: ``ps SEED TIMEOUT STREAM_TIMEOUT`` (the last two as chaos_worker.py's; the
stream's unused)."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from typing import Any, NoReturn

import numpy as np

from rdmamw import ps
from rdmamw.ps.consistency import Consistency

N = 1000
LR = 0.5
#: a worker's calls' deadline, in rounds' deadlines
CALL_DEADLINE = 3


class Closing(BaseException):
    """SIGUSR1: the ``close`` fault."""


#: SIGUSR2 came: the driver asks a surviving worker for its line (taken between rounds)
report: list[bool] = []


#: SIGUSR1 came (its exception may be swallowed where it lands, in a finalizer, say:
#: a worker then raises it before its next call, the server's channels are closed for
#: it from a thread)
close_asked: list[bool] = []


def closing(signum: int, frame: object) -> None:
    close_asked.append(True)
    raise Closing


def closer(node: ps.KVServer) -> None:
    """The server's fallback: its channels closed from this thread once SIGUSR1 came."""
    while not close_asked:
        time.sleep(0.05)
    time.sleep(0.5)
    for ch in list(node.chans.values()):
        ch.close()


def idle(node: Any, me: int) -> NoReturn:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if isinstance(node, ps.KVWorker):
        node.close()
    else:
        for ch in node.chans.values():
            ch.close()
    print(json.dumps({"rank": me, "closed": time.time()}), flush=True)
    while True:
        time.sleep(3600)


def serve(node: ps.KVServer, me: int) -> dict:
    print(json.dumps({"rank": me, "ready": True}), flush=True)
    threading.Thread(target=closer, args=(node,), daemon=True).start()
    try:
        node.serve()
    except Closing:
        idle(node, me)
    if close_asked:             # (served: the closer thread closed every channel)
        idle(node, me)
    return {"rank": me, "served": time.time(), "lost": node.stats().get("lost")}


def work(node: ps.KVWorker, me: int) -> dict:
    out = np.zeros(N, np.float32)
    grad = np.ones(N, np.float32)
    node.init(["w"], [np.zeros(N, np.float32)])
    node.pull_start(["w"], out=[out])
    calls = wrong = 0
    t_last = time.time()
    try:
        while not report:
            if close_asked:
                raise Closing
            node.push(["w"], [grad])
            node.pull(["w"], out=[out])
            calls += 1
            wrong += not np.array_equal(out, np.full(N, -LR * calls, np.float32))
            t_last = time.time()
            if calls == 1:
                print(json.dumps({"rank": me, "ready": True}), flush=True)
    except Closing:
        idle(node, me)
    except BaseException as e:      # noqa: BLE001 - typed or not, the driver judges
        return {"rank": me, "t": time.time(), "calls": calls, "wrong": wrong,
                "error": type(e).__name__, "named": getattr(e, "rank", None),
                "msg": str(e)[:300]}
    line = {"rank": me, "t": time.time(), "calls": calls, "wrong": wrong, "error": None,
            "t_last": t_last}
    print(json.dumps(line), flush=True)
    node.close()
    return line


def main() -> None:
    timeout = float(sys.argv[3])
    bsp = dataclasses.replace(Consistency.parse("bsp"), round_timeout=timeout)
    signal.signal(signal.SIGUSR1, closing)
    signal.signal(signal.SIGUSR2, lambda signum, frame: report.append(True))
    # (a worker's calls wait out a round held by a silent worker: their deadline is
    # longer than the round's)
    node = ps.start(servers=1, consistency=bsp, lr=LR, momentum=0.0,
                    timeout=CALL_DEADLINE * timeout)
    me = ps.worker_index(1) + 1
    if isinstance(node, ps.KVServer):
        print(json.dumps(serve(node, me)), flush=True)
    else:
        line = work(node, me)
        if line["error"] is not None:
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
