"""One trainer writes updated weights straight into N readers' buffers.

    python examples/weight_update.py                  # 3 readers, 4 MiB, 10 steps
    python examples/weight_update.py --readers 4 --mib 16 --steps 20

Each reader (an inference process, say) keeps its weights in one buffer and exposes
it, write-only, to the trainer's channel, sending the trainer the reference. Every
step the trainer WRITEs the new weights into each reader's buffer with ``notify=``:
the reader receives that small message only once the written bytes are visible to it,
checks the whole buffer against the step's weights, and says so. No thread of a reader
takes part in the write. The trainer prints the rate of one write (the median),
beside ``np.copyto`` of the same bytes in its own memory (the memory's own speed),
and of a whole step (the readers notified first check while the others are written:
on a busy machine they take the trainer's cores).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

import rdmamw


def weights(base: np.ndarray, step: int, out: np.ndarray) -> np.ndarray:
    """The model after ``step`` steps into ``out`` (each element different, every step
    different), in place, as a trainer updates its parameters."""
    np.add(base, np.float32(step), out=out)
    return out


def start(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * np.float32(1e-3)


def reader(address: str, n: int, steps: int) -> None:
    ch = rdmamw.Channel.open(address, timeout=30)
    buf = np.full(n, -1.0, np.float32)                  # touched: its pages are there
    region = ch.expose(buf, access="w")
    ch.send(bytes(region.ref))
    bad, base, expect = 0, start(n), np.empty(n, np.float32)
    for _ in range(steps):
        with ch.recv(timeout=60) as m:                    # the notification
            step = int(bytes(m).split()[1])
        bad += not np.array_equal(buf, weights(base, step, expect))  # visible once notified
        ch.send(f"checked {step} {'ok' if not bad else 'BAD'}".encode())
    region.revoke()
    ch.recv(timeout=60)                                   # the trainer's goodbye
    ch.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", type=int, default=3)
    ap.add_argument("--mib", type=int, default=4, help="weights per reader, MiB")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    n = a.mib << 18
    address = f"shm://weight-update-{os.getpid()}"
    with rdmamw.listen(address) as lst:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=reader, args=(address, n, a.steps))
                 for _ in range(a.readers)]
        for p in procs:
            p.start()
        chans = [lst.accept(timeout=30) for _ in procs]
        refs = []
        for ch in chans:
            with ch.recv(timeout=30) as m:
                refs.append(bytes(m))
        ok, spent, each = True, [], []
        base, w = start(n), np.empty(n, np.float32)     # the trainer's parameters
        for step in range(1, a.steps + 1):
            weights(base, step, w)
            t0 = time.perf_counter()
            for ch, ref in zip(chans, refs, strict=True):
                t1 = time.perf_counter()
                ch.write(w, ref, notify=f"step {step}".encode()).wait()
                each.append(time.perf_counter() - t1)
            spent.append(time.perf_counter() - t0)
            for ch in chans:
                with ch.recv(timeout=60) as m:
                    ok &= bytes(m).endswith(b"ok")
        local, copies = np.empty(n, np.float32), []
        for _ in range(a.steps * a.readers):
            t0 = time.perf_counter()
            np.copyto(local, w)
            copies.append(time.perf_counter() - t0)
        for ch in chans:
            ch.send(b"bye")
        for p in procs:
            p.join(30)
            ok &= p.exitcode == 0
        for ch in chans:
            ch.close()
    nbytes = n * 4
    dt, dl = statistics.median(each), statistics.median(copies)
    per_step = statistics.median(spent)
    print(f"weight_update: {a.steps} steps x {a.readers} readers x {a.mib} MiB written with "
          f"notify=: {'every reader checked its weights' if ok else 'A READER SAW WRONG WEIGHTS'}")
    print(f"weight_update: one write {nbytes / dt / 1e9:.2f} GB/s ({dt * 1e3:.2f} ms, median), "
          f"local np.copyto {nbytes / dl / 1e9:.2f} GB/s, ratio {dl / dt:.2f}; a step to every "
          f"reader {nbytes * a.readers / per_step / 1e9:.2f} GB/s (readers checking meanwhile)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
