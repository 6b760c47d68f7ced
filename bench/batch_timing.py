"""The cost of rdmamw_batch_completion_seconds: CPU time per 8 B message with the
batches timed (rdmamw.metrics.enable()) against not, in the same process and run.

    python bench/batch_timing.py [--n 100000] [--pairs 15] [--batches 1,16,256]

A channel pair over shm in one thread (bench/call_cost.py's): send a batch, wait for
its handle (so each batch is observed, as a program that learns its completion does),
receive and release it. Timed, each batch costs two clock reads and a histogram
update (rdmamw/engine/_messages.pyx); untimed, one branch at its handle's making and
one at its wait. Blocks alternate off/on (the order swapped from pair to pair); the
CPU time of this thread (``time.thread_time_ns``) does not count other processes, so
a loaded machine disturbs it less than a rate. Prints, per batch size, the median ns
per message of each side and the median of the per-pair ratios on/off with its
quartiles."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from call_cost import pair  # noqa: E402

from rdmamw.metrics import readings  # noqa: E402


def per_message_ns(a, b, batch: int, n: int) -> float:
    """CPU ns per message of ``n`` messages: each batch sent, waited, received."""
    msgs = [b"x" * 8] * batch
    send, recv, rounds = a.send_batch, b.recv_batch, max(1, n // batch)
    t0 = time.thread_time_ns()
    for _ in range(rounds):
        send(msgs).wait()
        left = batch
        while left:
            left -= len(recv())     # (released as the list goes)
    return (time.thread_time_ns() - t0) / (rounds * batch)


def block(a, b, batch: int, n: int, on: bool) -> float:
    (readings.enable if on else readings.disable)()
    try:
        return per_message_ns(a, b, batch, n)
    finally:
        readings.disable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="messages per block")
    ap.add_argument("--pairs", type=int, default=15, help="off/on pairs per batch size")
    ap.add_argument("--batches", default="1,16,256")
    args = ap.parse_args()
    a, b, lst = pair()
    try:
        per_message_ns(a, b, 16, 20_000)        # warm up: free lists, page faults
        for k in map(int, args.batches.split(",")):
            off, on, ratios = [], [], []
            for i in range(args.pairs):
                first = i % 2 == 1
                x = block(a, b, k, args.n, first)
                y = block(a, b, k, args.n, not first)
                t_on, t_off = (x, y) if first else (y, x)
                on.append(t_on), off.append(t_off), ratios.append(t_on / t_off)
            q = statistics.quantiles(ratios, n=4)
            print(f"batch {k:4d}: off {statistics.median(off):7.1f} ns/msg, on "
                  f"{statistics.median(on):7.1f} ns/msg, on/off CPU: median of paired "
                  f"ratios {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
        print(f"batches observed while on: {readings.batch_times().count}")
    finally:
        a.close(), b.close(), lst.close()


if __name__ == "__main__":
    main()
