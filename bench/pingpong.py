"""A short 8 B ping-pong on shm: one-way latency, for before/after comparisons.

    python bench/pingpong.py [--n 30000] [--json]

Two processes (this one and a forked echo), the default ``send``/``recv``/``release``
calls, blocks of 1,000 round trips after a warm-up; prints the median and the 10th
percentile of the blocks' one-way latency in microseconds. It takes well under a
second, so ``bench/ab.py`` can alternate it between two builds many times: on a
virtual machine the latency between two vCPUs jumps between levels as the host moves
them (0.55 / 0.75 / 1.15 us here), and only runs close together in time compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import rdmamw

WARMUP = 5_000
BLOCK = 1_000


def echo(address: str, count: int) -> None:
    ch = rdmamw.Channel.open(address, timeout=10)
    send, recv = ch.send, ch.recv
    for _ in range(count):
        m = recv(timeout=10)
        send(m)
        m.release()
    ch.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=30_000, help="measured round trips")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    blocks_n = max(1, a.n // BLOCK)
    lst = rdmamw.listen(f"shm://pingpong-{os.getpid()}")
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            lst.close()
            echo(lst.address, WARMUP + blocks_n * BLOCK)
        except BaseException:           # the parent sees the failure as a lost peer
            code = 1
        os._exit(code)
    try:
        ch = lst.accept(timeout=10)
        buf = memoryview(b"x" * 8)
        send, recv, clock = ch.send, ch.recv, time.perf_counter_ns
        for _ in range(WARMUP):
            send(buf)
            recv(timeout=10).release()
        blocks = []
        for _ in range(blocks_n):
            t0 = clock()
            for _ in range(BLOCK):
                send(buf)
                recv(timeout=10).release()
            blocks.append((clock() - t0) / (2 * BLOCK) / 1000)
        ch.close()
    finally:
        lst.close()
        _, status = os.waitpid(pid, 0)
    if status != 0:
        print("pingpong: the echo process failed", file=sys.stderr)
        return 1
    blocks.sort()
    out = {"lat8_p10": blocks[len(blocks) // 10], "lat8_block_med": statistics.median(blocks)}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"8 B one-way: median {out['lat8_block_med']:.3f} us, "
              f"p10 {out['lat8_p10']:.3f} us ({blocks_n} blocks of {BLOCK})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
