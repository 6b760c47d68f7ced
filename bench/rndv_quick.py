"""Quick same-run check of rendezvous streaming on shm: READ (CMA), WRITE, the staged
fallback and eager, against single-thread memcpy of the same size.

    python bench/rndv_quick.py                     # 4 MiB and 64 MiB
    python bench/rndv_quick.py --sizes 4M --reps 5

Each variant streams messages from one reused source buffer in a sender process to
``recv_into`` (write: ``post_recv``) a reused destination in a receiver process; the
receiver times the messages after two warm-up ones. memcpy is ``np.copyto`` between
two warm arrays of the size. Medians over ``--reps`` runs, interleaved, with the load
average printed (the box is shared: compare the ratios, not the absolute GB/s). Each
process also reports its peak RSS (VmHWM) above its RSS after start-up, in messages
(issue 5: <= 2x the message size per channel); it includes the receiver's own
destination buffers (1, or 4 posted with write) and, on shm, the staging area pages
each side touched (staged) or the ring (eager). The full strategy sweep with mpi4py
is the rendezvous bench of bench/ (issue 5, memory part).
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

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
from run import wait_quiet  # noqa: E402

SIZES = {"4M": 4 << 20, "64M": 64 << 20}
VARIANTS = ("read", "write", "staged", "eager")

PEER = r"""
import json, os, sys, time
import numpy as np, rdmamw
role, address, variant, size, count = sys.argv[1:6]
size, count = int(size), int(count)

def status(key):        # this process's own figures (ru_maxrss survives exec: not it)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

rss0 = status("VmRSS")
eager = variant == "eager"
opts = dict(rendezvous="off" if eager else ("write" if variant == "write" else "read"),
            slots=3 if eager else 64, slot_size=size if eager else 65536)
res = {}
if role == "recv":
    with rdmamw.listen(address, **opts) as lst:
        print("ready", flush=True)
        ch = lst.accept(timeout=60)
        bufs = [np.empty(size, np.uint8) for _ in range(4 if variant == "write" else 1)]
        for b in bufs:
            b.fill(1)                       # warm: the sender's figure is not page faults
        t0 = None
        for i in range(count):
            if i == 2:
                t0 = time.perf_counter()
            if variant == "write":      # posted 4 ahead: the sender has 2 in flight
                if i == 0:
                    for b in bufs:
                        ch.post_recv(b)
                m = ch.recv(timeout=60)
                assert len(m) == size
                m.release()
                ch.post_recv(bufs[i % 4])
            else:
                assert ch.recv_into(bufs[0], timeout=60) == size
        dt = time.perf_counter() - t0
        res = {"gbps": size * (count - 2) / dt / 1e9, "stats": ch.stats()}
        ch.close()
else:
    ch = rdmamw.Channel.open(address, timeout=60, **opts)
    src = np.ones(size, np.uint8)
    pending = []
    for i in range(count):
        pending.append(ch.send(src, timeout=60))
        if len(pending) >= 2:
            pending.pop(0).wait(timeout=60)
    for h in pending:
        h.wait(timeout=60)
    ch.close()
res["rss_peak_above_base"] = status("VmHWM") - rss0
print(json.dumps(res), flush=True)
"""


def memcpy_gbps(size: int, reps: int) -> float:
    a, b = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    np.copyto(b, a)
    n = max(3, (1 << 30) // size)
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            np.copyto(b, a)
        best.append(size * n / (time.perf_counter() - t0) / 1e9)
    return statistics.median(best)


def stream(variant: str, size: int, count: int, tag: str) -> dict:
    env = dict(os.environ)
    if variant == "staged":
        env["RDMAMW_SHM_CMA"] = "0"
    addr = f"shm://rndvq-{os.getpid()}-{tag}"
    cmd = [sys.executable, "-c", PEER]
    rx = subprocess.Popen(cmd + ["recv", addr, variant, str(size), str(count)],
                          stdout=subprocess.PIPE, text=True, env=env)
    assert rx.stdout.readline().strip() == "ready"
    tx = subprocess.Popen(cmd + ["send", addr, variant, str(size), str(count)],
                          stdout=subprocess.PIPE, text=True, env=env)
    r_out, _ = rx.communicate(timeout=300)
    t_out, _ = tx.communicate(timeout=300)
    if rx.returncode or tx.returncode:
        raise RuntimeError(f"{variant} {size}: peers failed ({rx.returncode}, {tx.returncode})")
    r, t = json.loads(r_out.splitlines()[-1]), json.loads(t_out.splitlines()[-1])
    return {"gbps": r["gbps"], "rss_recv": r["rss_peak_above_base"],
            "rss_send": t["rss_peak_above_base"], "stats": r["stats"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4M,64M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    busy = wait_quiet(20)
    print(f"load average {os.getloadavg()[0]:.2f} (other CPU use {busy:.0f}%), "
          f"{os.cpu_count()} cores")
    variants = args.variants.split(",")
    for name in args.sizes.split(","):
        size = SIZES.get(name) or int(name)
        count = max(6, min(200, (2 << 30) // size // 2))
        runs: dict = {v: [] for v in ["memcpy", *variants]}
        rss: dict = {}
        for rep in range(args.reps):
            runs["memcpy"].append(memcpy_gbps(size, 1))
            for v in variants:
                got = stream(v, size, count, f"{name}-{v}-{rep}")
                runs[v].append(got["gbps"])
                rss[v] = max(rss.get(v, (0, 0)), (got["rss_recv"], got["rss_send"]))
                if v == "write" and got["stats"]["rndv_reads"]:
                    print(f"  note: write fell back to READ for {got['stats']['rndv_reads']} "
                          f"of {count} messages (destination not posted in time)")
        mc = statistics.median(runs["memcpy"])
        print(f"\n{name} ({size} B) x {count} messages, median of {args.reps}:")
        print(f"  {'memcpy':8s} {mc:6.2f} GB/s")
        for v in variants:
            g = statistics.median(runs[v])
            r, s = rss[v]
            print(f"  {v:8s} {g:6.2f} GB/s  {g / mc:5.2f}x memcpy   peak RSS above base: "
                  f"recv {r / size:4.2f}x, send {s / size:4.2f}x the message")


if __name__ == "__main__":
    main()
