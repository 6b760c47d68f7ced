"""Remote memory, same run: a one-sided ``read`` of a peer's exposed buffer against a
single-thread ``np.copyto`` of the same size and against a two-sided pull of it on the
same channel (docs/remote-memory.md).

    python bench/rmem_bench.py                      # shm, 64 KiB and 4 MiB
    python bench/rmem_bench.py --provider tcp
    python bench/rmem_bench.py --provider verbs --reps 5 --iters 8   # soft-RoCE VM
    python bench/rmem_bench.py --sizes 64K --reps 9

An owner process exposes one buffer per size and then waits in ``recv`` (idle in the
engine: on shm it may help copy a large read, as for rendezvous); this process reads
the whole buffer into a reused destination, ``--iters`` times per rep, and times
``np.copyto`` between two warm arrays of the size the same number of times, the two
interleaved rep by rep. Medians of the per-rep means; ``ratio`` = copyto time / read
time (>= 1: the read is at least as fast). The pull: this process sends the owner a
request, the owner's application thread answers with the buffer as a message, received
with ``recv_into`` into the same destination (what a read saves on tcp: the owner's
thread and a message's way); ``pull/read`` = pull time / read time. Also batched 8 B
writes into one region (``--batch`` per chain): operations per second; and, where the
provider has atomics (tcp, verbs: the regions are then exposed "atomic"), fetch_adds
on one word a second beside single 8-byte reads of it, interleaved rep by rep
(``atomic/read`` = read time / fetch_add time: both are one round trip on tcp). The box
is shared: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = {"64K": 64 << 10, "4M": 4 << 20}
#: the providers with fetch_add / compare_swap (docs/remote-memory.md)
ATOMICS = ("tcp", "verbs")

OWNER = r"""
import sys, numpy as np, rdmamw
lst = rdmamw.listen(sys.argv[1])
print(lst.address, flush=True)  # tcp: the port it was given
ch = lst.accept(timeout=60)
sizes = [int(s) for s in sys.argv[2].split(",")]
bufs = [np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8) for n in sizes]
regs = [ch.expose(b, sys.argv[3]) for b in bufs]
ch.send_batch([bytes(r.ref) for r in regs])
while True:                     # idle in the engine (reads), or answering pulls
    ask = bytes(ch.recv(timeout=600))
    if ask == b"done":
        break
    ch.send(bufs[int(ask)])
ch.close()
"""


def _mean_s(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _atomics(ch: Any, region: Any, reps: int, iters: int = 200) -> dict[str, Any]:
    """fetch_adds on the region's first word against 8-byte reads of it, interleaved
    rep by rep; the word's total checked at the end."""
    before = ch.fetch_add(region, 0, 0).wait()
    dst = np.zeros(8, np.uint8)
    fadds, reads = [], []
    for _ in range(reps):
        fadds.append(_mean_s(lambda: ch.fetch_add(region, 0, 1), iters))
        reads.append(_mean_s(lambda: ch.read(region, dst), iters))
    after = ch.fetch_add(region, 0, 0).wait()
    assert (after - before) % 2**64 == reps * iters, "fetch_adds lost"
    f, r = statistics.median(fadds), statistics.median(reads)
    return {"size": "fetch_add", "ops_per_s": 1 / f, "fadd_us": f * 1e6,
            "read8_us": r * 1e6, "atomic_ratio": r / f}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", choices=("shm", "tcp", "verbs"), default="shm")
    ap.add_argument("--sizes", default="64K,4M")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--iters", type=int, default=0, help="per rep (default: ~64 MiB)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import rdmamw

    names = args.sizes.split(",")
    sizes = [SIZES[n] if n in SIZES else int(n) for n in names]
    addr = {"shm": f"shm://rmem-bench-{os.getpid()}", "tcp": "tcp://127.0.0.1:0",
            "verbs": "verbs://127.0.0.1:0"}[args.provider]
    atomics = args.provider in ATOMICS
    owner = subprocess.Popen([sys.executable, "-c", OWNER, addr, ",".join(map(str, sizes)),
                              "atomic" if atomics else "rw"],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        assert owner.stdout is not None
        ch = rdmamw.Channel.open(owner.stdout.readline().strip(), timeout=30)
        refs = [bytes(m) for m in ch.recv_batch(max_messages=len(sizes), timeout=30)]
        while len(refs) < len(sizes):
            refs += [bytes(m) for m in ch.recv_batch(timeout=30)]
        for i, (name, n, ref) in enumerate(zip(names, sizes, refs, strict=True)):
            iters = args.iters or max(8, (64 << 20) // n)
            dst = np.zeros(n, np.uint8)
            a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)
            region = rdmamw.channel.remote.RegionRef.from_bytes(ref)

            def read(dst=dst, region=region) -> None:
                ch.read(region, dst)

            def copy(a=a, b=b) -> None:
                np.copyto(b, a)

            def pull(dst=dst, ask=b"%d" % i) -> None:
                ch.send(ask)
                ch.recv_into(dst, timeout=30)

            read()
            copy()
            pull()
            reads, copies, pulls = [], [], []
            for _ in range(args.reps):
                reads.append(_mean_s(read, iters))
                copies.append(_mean_s(copy, iters))
                pulls.append(_mean_s(pull, iters))
            r, c, p = (statistics.median(x) for x in (reads, copies, pulls))
            rows.append({"size": name, "read_us": r * 1e6, "copyto_us": c * 1e6,
                         "pull_us": p * 1e6, "read_GBps": n / r / 1e9,
                         "copyto_GBps": n / c / 1e9, "ratio": c / r, "pull_ratio": p / r})
        region = rdmamw.channel.remote.RegionRef.from_bytes(refs[0])
        word = np.ones(8, np.uint8)

        def writes() -> None:
            ops = ch.batch()
            for k in range(args.batch):
                ops.write(word, region, offset=(k * 8) % (region.length - 8))
            ops.post()

        writes()
        per = [(_mean_s(writes, 20)) for _ in range(args.reps)]
        rows.append({"size": f"{args.batch} x 8 B writes", "ops_per_s":
                     args.batch / statistics.median(per)})
        if atomics:
            rows.append(_atomics(ch, region, args.reps))
        ch.send(b"done")
        ch.close()
    finally:
        owner.wait(30)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{args.provider}; load {os.getloadavg()[0]:.2f}; medians of {args.reps} reps")
    for row in rows:
        if "ratio" in row:
            print(f"{row['size']:>6}: read {row['read_us']:9.2f} us ({row['read_GBps']:5.2f} "
                  f"GB/s)  np.copyto {row['copyto_us']:9.2f} us ({row['copyto_GBps']:5.2f} "
                  f"GB/s)  ratio copyto/read {row['ratio']:.2f}  two-sided pull "
                  f"{row['pull_us']:9.2f} us, pull/read {row['pull_ratio']:.2f}")
        elif "atomic_ratio" in row:
            print(f"fetch_add: {row['ops_per_s'] / 1e3:.1f} k ops/s ({row['fadd_us']:.1f} us)"
                  f"  8 B read {row['read8_us']:.1f} us  ratio read/fetch_add "
                  f"{row['atomic_ratio']:.2f}")
        else:
            print(f"{row['size']}: {row['ops_per_s'] / 1e6:.4f} M ops/s")


if __name__ == "__main__":
    main()
