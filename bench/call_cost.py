"""CPU time per engine call, in one process: robust to a loaded machine.

    python bench/call_cost.py [--n 200000] [--json]

A channel pair over shm in one process, one thread: send a batch, receive it, release
it, and count this thread's CPU time (``time.thread_time_ns``) per message for
batches of 1, 16 and 256 messages of 8 B (``send_batch`` / ``recv_batch``), and for
the one-message calls a user makes by default, ``send(msg)`` / ``recv()`` ("one"),
and, asked for (``--batches many256``), ``send_many`` of one buffer of k messages /
``recv_many_into`` ("manyK").
Wall-clock rates (bench/run.py) need a quiet machine; CPU time per call does not,
since other processes' time is not counted. The before/after tool (bench/ab.py) uses
it to compare two builds of the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np

import rdmamw

BATCHES = ("1", "16", "256", "one")     # "one": send(msg) / recv(), not the batch calls


def pair(slots: int = 1024, slot_size: int = 4096):
    lst = rdmamw.listen(f"shm://call-cost-{os.getpid()}", slots=slots, slot_size=slot_size)
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("ch", lst.accept(timeout=10)))
    t.start()
    a = rdmamw.Channel.open(lst.address, timeout=10, slots=slots, slot_size=slot_size)
    t.join(10)
    return a, got["ch"], lst


def per_message_ns(a, b, batch: int, n: int) -> float:
    msgs = [b"x" * 8] * batch
    rounds = max(1, n // batch)
    t0 = time.thread_time_ns()
    for _ in range(rounds):
        a.send_batch(msgs)
        got = 0
        while got < batch:
            ms = b.recv_batch()
            got += len(ms)
            del ms
    return (time.thread_time_ns() - t0) / (rounds * batch)


def per_many_ns(a, b, batch: int, n: int) -> float:
    """per_message_ns of ``send_many`` (one buffer of ``batch`` 8 B messages) and
    ``recv_many_into`` (copied into one buffer, no object per message)."""
    data, buf, lens = b"x" * (8 * batch), bytearray(1 << 20), np.zeros(1 << 14, np.uint32)
    send_many, recv_many_into = a.send_many, b.recv_many_into
    rounds = max(1, n // batch)
    t0 = time.thread_time_ns()
    for _ in range(rounds):
        send_many(data, size=8)
        got = 0
        while got < batch:
            got += recv_many_into(buf, lens)
    return (time.thread_time_ns() - t0) / (rounds * batch)


def per_one_ns(a, b, n: int) -> float:
    """per_message_ns of the one-message calls: ``send(msg)``, ``recv()``, the
    Message dropped (released)."""
    msg = b"x" * 8
    t0 = time.thread_time_ns()
    for _ in range(n):
        a.send(msg)
        b.recv()
    return (time.thread_time_ns() - t0) / n


def key(batch: str) -> str:
    if batch == "one" or batch.startswith("many"):
        return f"cpu_ns_{batch}"
    return f"cpu_ns_batch{batch}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="messages per batch size")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (median)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="batch sizes, comma-separated; 'one': send()/recv() (default "
                         "%(default)s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    a, b, lst = pair()
    try:
        per_message_ns(a, b, 16, 20_000)        # warm up: free lists, page faults
        out = {}
        for k in args.batches.split(","):       # (the timed loop called from here, as
            if k == "one":                      # bench/instructions.py expects it)
                got = [per_one_ns(a, b, args.n) for _ in range(args.reps)]
            elif k.startswith("many"):
                got = [per_many_ns(a, b, int(k[4:]), args.n) for _ in range(args.reps)]
            else:
                got = [per_message_ns(a, b, int(k), args.n) for _ in range(args.reps)]
            out[key(k)] = statistics.median(got)
    finally:
        a.close(), b.close(), lst.close()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:20s} {v:8.1f} ns per message (send + receive + release)")


if __name__ == "__main__":
    main()
