"""Stream numpy gradients from one process to another and sum them zero-copy.

    python examples/numpy_stream.py
"""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np

import rdmamw

ADDRESS = f"shm://numpy-stream-{os.getpid()}"
STEPS, SHARDS, SIZE = 50, 8, 2048


def worker() -> None:
    ch = rdmamw.Channel.open(ADDRESS, timeout=30)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        grads = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(SHARDS)]
        ch.send_batch(grads).wait()        # one doorbell for all shards of a step
    ch.close()


def main() -> None:
    with rdmamw.listen(ADDRESS) as lst:
        p = mp.get_context("fork").Process(target=worker)
        p.start()
        ch = lst.accept(timeout=30)
        total = np.zeros(SIZE, np.float32)
        n = 0
        while True:
            try:
                msgs = ch.recv_batch()
            except rdmamw.ChannelClosed:
                break
            for m in msgs:
                total += np.frombuffer(m, dtype=np.float32)   # reads the ring in place
                n += 1
            del msgs                                          # slots go back to the sender
        p.join()
    print(f"summed {n} gradient shards; checksum {float(total.sum()):.3f}")


if __name__ == "__main__":
    main()
