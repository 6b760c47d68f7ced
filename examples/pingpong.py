"""Ping-pong between two processes over shm: the smallest complete rdmamw program.

    python examples/pingpong.py            # starts both sides itself
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import rdmamw

ADDRESS = f"shm://pingpong-{os.getpid()}"
ROUNDS = 10_000


def server() -> None:
    with rdmamw.listen(ADDRESS) as lst, lst.accept(timeout=30) as ch:
        while True:
            try:
                with ch.recv() as m:
                    ch.send(m)                 # echo the bytes back (copied on send)
            except rdmamw.ChannelClosed:
                return


def main() -> None:
    p = mp.get_context("fork").Process(target=server)
    p.start()
    with rdmamw.Channel.open(ADDRESS, timeout=30) as ch:
        rtts = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter_ns()
            ch.send(b"12345678")
            ch.recv().release()
            rtts.append(time.perf_counter_ns() - t0)
    p.join()
    print(f"8 B one-way latency: median {statistics.median(rtts) / 2000:.2f} us "
          f"over {ROUNDS} round trips")


if __name__ == "__main__":
    main()
