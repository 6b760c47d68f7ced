"""Large messages: rendezvous bandwidth per strategy against memcpy and mpi4py, one run.

    python bench/rendezvous_bench.py                  # shm, 64 KiB .. 64 MiB, ~2-3 min
    python bench/rendezvous_bench.py --quick          # fewer bytes per point
    python bench/rendezvous_bench.py --wait-quiet 120 # on a shared box: wait for idle cores
    python bench/rendezvous_bench.py --rounds 3       # medians over 3 interleaved rounds
    python bench/rendezvous_bench.py --only regcost --provider verbs   # in the VM
                                                      # (make bench-rndv-verbs)

Phases, all in this one run and each in fresh processes pinned to their own cores:

* ``memcpy``: single-thread ``numpy.copyto`` between page-aligned buffers, per size;
* ``rdmamw``: streaming per strategy (``eager``, ``read``, ``write``), exactly as
  ``rdmamw tune rndv`` measures it (rdmamw/apps/tune_rndv.py: the receiver lands every
  message in its own preallocated buffer and checks the bytes), plus the peak RSS of
  each side while streaming up to 64 MiB;
* ``mpi4py``: MPICH ``Isend``/persistent ``Recv`` streams of the same sizes
  (bench/peers/mpi_peer.py);
* ``regcost``: registering a buffer per send against the registration cache
  (rdmamw/memory/regcache.py), per size, as microseconds per MB. On the host there
  is no RDMA registration: ``mlock``/``munlock`` (what ``ibv_reg_mr`` spends most of
  its time on: pinning pages) stands in, and the cache's own lookup cost is shown;
  in the VM (``--provider verbs``) it is the real ``ibv_reg_mr``/``ibv_dereg_mr``.

Then the issue's targets as PASS/FAIL lines: shm 4 MiB and 64 MiB streaming >= 60 %
of memcpy and >= 1.5x mpi4py; peak RSS of a 64 MiB stream <= 2x the message size per
channel; a repeated send of one buffer registers it once. The load average is printed
with the figures; raw results go to bench/results/rendezvous-*.json.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import machine, parse, reap, spawn, wait_quiet  # noqa: E402

from rdmamw.apps import tune_rndv as tune  # noqa: E402
from rdmamw.memory.pool import aligned_empty  # noqa: E402
from rdmamw.memory.regcache import RegCache  # noqa: E402
from rdmamw.memory.units import human  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
PHASES = ("memcpy", "rdmamw", "mpi4py", "regcost")
RESULTS = HERE / "results"


# ---- memcpy --------------------------------------------------------------------------

def _memcpy_child(sizes: list[int], runs: int, seconds: float, core: int, out) -> None:
    os.sched_setaffinity(0, {core})
    res = {}
    for size in sizes:
        src, dst = aligned_empty(size), aligned_empty(size)
        src.fill(7)
        dst.fill(0)
        per = max(1, (64 * MiB) // size)
        rates = []
        for r in range(runs + 1):
            n, t0 = 0, time.perf_counter()
            while True:
                for _ in range(per):
                    np.copyto(dst, src)
                n += per
                t1 = time.perf_counter()
                if t1 - t0 >= seconds:
                    break
            if r:
                rates.append(n * size / (t1 - t0) / 1e9)
        res[size] = statistics.median(rates)
    out.put(res)


def run_memcpy(sizes: list[int], runs: int, seconds: float, core: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_memcpy_child, args=(sizes, runs, seconds, core, q))
    p.start()
    res = q.get(timeout=600)
    p.join(30)
    return res


# ---- rdmamw --------------------------------------------------------------------------

def _rdmamw_child(strategy: str, plan: list, provider: str, cores: tuple, out) -> None:
    try:
        out.put(tune.measure_all(strategy, plan, provider, cores))
    except BaseException as e:   # noqa: BLE001 - reported to the parent
        out.put({"error": f"{type(e).__name__}: {e}"})


def run_rdmamw(strategy: str, sizes: list[int], provider: str, bytes_per_run: int,
               runs: int, cores: tuple) -> dict:
    """One strategy in a fresh sender process (so its peak RSS is its own)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    plan = tune.schedule(sizes, bytes_per_run, runs, min_messages=8)
    p = ctx.Process(target=_rdmamw_child, args=(strategy, plan, provider, cores, q))
    p.start()
    try:
        return q.get(timeout=900)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()


# ---- mpi4py --------------------------------------------------------------------------

def run_mpi(sizes: list[int], runs: int, seconds: float) -> dict[int, float] | str:
    mpiexec = shutil.which("mpiexec")
    if not mpiexec:
        return "mpiexec not found: run bash bench/setup.sh .venv/bin/python"
    cfg = {"phases": ["bw_sizes"], "bw_sizes": sizes, "bw_batch": 16,
           "bw_batch_bytes": 8 * MiB, "bw_runs": runs, "bw_seconds": seconds}
    p = spawn([mpiexec, "-n", "2", sys.executable, str(HERE / "peers" / "mpi_peer.py"),
               json.dumps(cfg)])
    out, err, timed_out = reap(p, 900)
    res = parse(out, err, p.returncode, timed_out)
    if "error" in res:
        return res["error"]
    return {int(s): v["gb_per_s"] for s, v in res["bw_sizes"].items()}


# ---- registration cost -------------------------------------------------------------

def _mlock_pair():
    libc = ctypes.CDLL(None, use_errno=True)

    def register(addr: int, length: int) -> tuple[int, int]:
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)):
            raise OSError(ctypes.get_errno(), "mlock failed (RLIMIT_MEMLOCK?)")
        return addr, length

    def deregister(h: tuple[int, int]) -> None:
        libc.munlock(ctypes.c_void_p(h[0]), ctypes.c_size_t(h[1]))
    return register, deregister


def _verbs_pair():
    import pyverbs.enums as e
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    ctx = Context(name=os.environ.get("RXEVM_DEV", "rxe0"))
    pd = PD(ctx)
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE

    def register(addr: int, length: int):
        return MR(pd, length, access, address=addr)

    def deregister(mr) -> None:
        mr.close()
    register.keep = (ctx, pd)        # the PD must outlive the MRs
    return register, deregister


def run_regcost(sizes: list[int], provider: str, seconds: float) -> dict:
    """Microseconds per send spent on registration, per size: register+deregister on
    every send, against the cache (one miss, then hits)."""
    if provider == "verbs":
        sys.path.append("/usr/lib/python3/dist-packages")
        register, deregister = _verbs_pair()
        kind = "ibv_reg_mr/ibv_dereg_mr"
    else:
        register, deregister = _mlock_pair()
        kind = "mlock/munlock (stands in for pinning; shm itself registers nothing)"
    out: dict = {"kind": kind, "sizes": {}}
    for size in sizes:
        buf = aligned_empty(size)
        buf.fill(1)
        addr = buf.__array_interface__["data"][0]
        n, t0 = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t0 < seconds:
            deregister(register(addr, size))
            n += 1
        per_send = (time.perf_counter() - t0) / n
        cache = RegCache(register, deregister, max_bytes=1 << 30)
        m, t0 = 0, time.perf_counter()
        while m < 3 or time.perf_counter() - t0 < seconds:
            cache.acquire(buf).release()
            m += 1
        cached = (time.perf_counter() - t0) / m
        st = cache.stats()
        cache.close()
        out["sizes"][size] = {"uncached_us": per_send * 1e6, "cached_us": cached * 1e6,
                              "uncached_us_per_mb": per_send * 1e6 / (size / MiB),
                              "cached_us_per_mb": cached * 1e6 / (size / MiB),
                              "sends": m, "registrations": st["registrations"]}
    if provider == "verbs":
        out["channel"] = {size: {how: _channel_sends(size, how == "cached", seconds)
                                 for how in ("uncached", "cached")}
                          for size in sizes if size <= 16 * MiB}
    return out


def _channel_sends(size: int, cached: bool, seconds: float) -> dict:
    """The same buffer sent again and again over a verbs channel (READ rendezvous into
    one recv_into buffer; 16 KiB slots, so 64 KiB is above the eager limit):
    microseconds per send and the sender's registration counters, with the channel's
    cache, or with RDMAMW_REGCACHE_BYTES=0 (register per send)."""
    import threading

    import rdmamw
    old = os.environ.get("RDMAMW_REGCACHE_BYTES")
    if not cached:
        os.environ["RDMAMW_REGCACHE_BYTES"] = "0"
    try:
        lst = rdmamw.listen("verbs://127.0.0.1:0", slots=8, slot_size=16 * KiB,
                            rendezvous="read")
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("b", lst.accept(timeout=30)))
        t.start()
        a = rdmamw.Channel.open(lst.address, timeout=30, slots=8, slot_size=16 * KiB,
                                rendezvous="read")
        t.join(30)
        b = got["b"]
    finally:
        if old is None:
            os.environ.pop("RDMAMW_REGCACHE_BYTES", None)
        else:
            os.environ["RDMAMW_REGCACHE_BYTES"] = old
    try:
        src, dst = aligned_empty(size), aligned_empty(size)
        src.fill(3)
        n, t0 = 0, time.perf_counter()
        while n < 5 or time.perf_counter() - t0 < seconds:
            h = a.send(src)
            b.recv_into(dst, timeout=60)
            h.wait(timeout=60)
            n += 1
        per = (time.perf_counter() - t0) / n
        s = a.stats()
        return {"us": per * 1e6, "sends": n, "registrations": s["registrations"],
                "hits": s["regcache_hits"], "ok": bool(np.array_equal(src, dst))}
    finally:
        a.close(), b.close(), lst.close()


# ---- report --------------------------------------------------------------------------

def combine(rounds: list[dict]) -> dict:
    """Medians over the rounds, per system and size; the rdmamw counters of the last
    round and its largest RSS growth; an error of any round stays visible."""
    def med(tables: list[dict]) -> dict:
        sizes = set().union(*(t.keys() for t in tables))
        return {n: statistics.median(t[n] for t in tables if n in t) for n in sorted(sizes)}

    out: dict = {}
    if any("memcpy" in r for r in rounds):
        out["memcpy"] = med([r["memcpy"] for r in rounds])
    mpis = [r["mpi4py"] for r in rounds if "mpi4py" in r]
    if mpis:
        ok = [m for m in mpis if isinstance(m, dict)]
        out["mpi4py"] = med(ok) if ok else mpis[-1]
    if any("rdmamw" in r for r in rounds):
        out["rdmamw"] = {}
        for strategy in rounds[0]["rdmamw"]:
            runs = [r["rdmamw"][strategy] for r in rounds]
            bad = [x for x in runs if "error" in x]
            if bad:
                out["rdmamw"][strategy] = bad[-1]
                continue
            last = dict(runs[-1])
            last["gbps"] = med([x["gbps"] for x in runs])
            last["rss"] = {side: max((x["rss"][side] for x in runs),
                                     key=lambda v: v["peak"] - v["before"])
                           for side in runs[-1]["rss"]}
            out["rdmamw"][strategy] = last
    return out


def verdict(ok: bool | None) -> str:
    return "UNTESTED" if ok is None else ("PASS" if ok else "FAIL")


def targets(res: dict) -> list[str]:
    lines = []
    mc, mpi = res.get("memcpy", {}), res.get("mpi4py")
    mpi = mpi if isinstance(mpi, dict) else {}
    for strategy in ("read", "write") if "rdmamw" in res else ():
        r = res["rdmamw"].get(strategy, {})
        g = r.get("gbps", {}) if "error" not in r else {}
        for size in (4 * MiB, 64 * MiB):
            v = g.get(size)
            m, p = mc.get(size), mpi.get(size)
            a = v / m if v and m else None
            b = v / p if v and p else None
            lines.append(f"{verdict(None if a is None else a >= 0.6)}  {strategy:5s} "
                         f"{human(size):>7} streaming >= 60% of memcpy: "
                         + (f"{v:.2f} / {m:.2f} GB/s = {a:.0%}" if a is not None else "n/a"))
            lines.append(f"{verdict(None if b is None else b >= 1.5)}  {strategy:5s} "
                         f"{human(size):>7} streaming >= 1.5x mpi4py: "
                         + (f"{v:.2f} / {p:.2f} GB/s = {b:.2f}x" if b is not None else "n/a"))
        rss = r.get("rss", {})
        if 64 * MiB in g:
            for side in ("sender", "receiver"):
                s = rss.get(side)
                if s:
                    grow = s["peak"] - s["before"]
                    lines.append(f"{verdict(grow <= 2 * 64 * MiB)}  {strategy:5s} peak RSS of "
                                 f"the 64 MiB stream, {side}: +{human(grow)} over its buffers "
                                 f"(limit 2 x 64 MiB)")
    rc = res.get("regcost", {}).get("sizes", {})
    ch = res.get("regcost", {}).get("channel", {})
    if ch:                          # verbs: counted on the channel itself
        size = max(ch)
        c = ch[size]["cached"]
        lines.append(f"{verdict(c['registrations'] == 1 and c['ok'])}  a repeated send of "
                     f"one {human(size)} buffer over a verbs channel registers it once: "
                     f"{c['registrations']} registration, {c['hits']} cache hits for "
                     f"{c['sends']} sends")
    elif rc:
        big = rc[max(rc)]
        lines.append(f"{verdict(big['registrations'] == 1)}  a repeated send of one "
                     f"{human(max(rc))} buffer registers it once: {big['registrations']} "
                     f"registration for {big['sends']} sends")
    return lines


def report(res: dict, sizes: list[int]) -> None:
    mc, mpi = res.get("memcpy", {}), res.get("mpi4py")
    rd = res.get("rdmamw", {})
    names = [s for s in ("eager", "read", "write") if s in rd]
    head = f"{'size':>8} {'memcpy':>8} {'mpi4py':>8} " + " ".join(f"{n:>8}" for n in names)
    if not (mc or mpi or rd):
        return report_tail(res)
    print("\nstreaming bandwidth, GB/s (median); ratio of the best rendezvous strategy")
    print(head + f" {'best/memcpy':>12} {'best/mpi4py':>12}")
    for size in sizes:
        row = [mc.get(size), mpi.get(size) if isinstance(mpi, dict) else None]
        vals = {n: rd[n].get("gbps", {}).get(size) for n in names if "error" not in rd[n]}
        cells = " ".join(f"{v:>8.2f}" if v else f"{'-':>8}" for v in row) + " " + " ".join(
            f"{vals.get(n):>8.2f}" if vals.get(n) else f"{'-':>8}" for n in names)
        best = max((vals.get(n) or 0 for n in ("read", "write")), default=0)
        r1 = f"{best / row[0]:>12.0%}" if best and row[0] else f"{'-':>12}"
        r2 = f"{best / row[1]:>11.2f}x" if best and row[1] else f"{'-':>12}"
        print(f"{human(size):>8} {cells} {r1} {r2}")
    for n in names:
        if "error" in rd[n]:
            print(f"  {n}: ERROR {rd[n]['error']}")
    ok = {n: rd[n]["sender"] for n in names if "error" not in rd[n]}
    for line in tune.counter_lines(ok):
        print("  " + line)
    if isinstance(mpi, str):
        print(f"  mpi4py: {mpi}")
    report_tail(res)


def report_tail(res: dict) -> None:
    rc = res.get("regcost")
    if rc:
        print(f"\nregistration per send ({rc['kind']}): microseconds, and per MB")
        print(f"{'size':>8} {'uncached':>10} {'cached':>10} {'us/MB unc.':>11} "
              f"{'us/MB cached':>13} {'speed-up':>9}")
        for size, v in sorted(rc["sizes"].items()):
            print(f"{human(size):>8} {v['uncached_us']:>10.1f} {v['cached_us']:>10.2f} "
                  f"{v['uncached_us_per_mb']:>11.2f} {v['cached_us_per_mb']:>13.3f} "
                  f"{v['uncached_us'] / v['cached_us']:>8.0f}x")
        ch = rc.get("channel")
        if ch:
            print("\nthe same buffer sent again and again over a verbs channel (READ into one "
                  "buffer): microseconds per send, the sender's registrations")
            print(f"{'size':>8} {'per-send reg.':>14} {'cached':>10} {'speed-up':>9} "
                  f"{'registrations (per-send / cached)':>34}")
            for size, v in sorted(ch.items()):
                u, c = v["uncached"], v["cached"]
                print(f"{human(size):>8} {u['us']:>14.0f} {c['us']:>10.0f} "
                      f"{u['us'] / c['us']:>8.2f}x {u['registrations']:>16} / "
                      f"{c['registrations']} ({c['sends']} sends)")
    print("\ntargets (same run):")
    for line in targets(res):
        print("  " + line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm", choices=("shm", "tcp", "verbs"))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--only", default=",".join(PHASES), help=f"subset of {PHASES}")
    ap.add_argument("--quick", action="store_true", help="fewer bytes per point")
    ap.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                    help="wait up to S seconds for the other load to drop first")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat memcpy, rdmamw and mpi4py this many times, interleaved, "
                         "and report medians over the rounds (steadier on a shared box)")
    ap.add_argument("--json", help="also write the raw results here")
    a = ap.parse_args(argv)
    sizes = sorted(int(s) for s in a.sizes.split(",") if s)
    phases = [p for p in a.only.split(",") if p]
    bad = set(phases) - set(PHASES)
    if bad:
        ap.error(f"unknown phases {bad}")
    busy = wait_quiet(a.wait_quiet) if a.wait_quiet else None
    cores = sorted(os.sched_getaffinity(0))
    pair = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    runs, seconds = (3, 0.15) if a.quick else (5, 0.4)
    per_run = (64 if a.quick else 256) * MiB
    meta = {**machine(), "busy_before_pct": busy, "provider": a.provider, "sizes": sizes,
            "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    load = os.getloadavg()
    print(f"rendezvous bench: {a.provider}, {len(cores)} cores, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
          + (f", other load {busy:.0f}% before start" if busy is not None else ""))
    rounds = []
    for r in range(a.rounds):
        one: dict = {"loadavg": os.getloadavg()[0]}
        if "memcpy" in phases:
            print(f"  round {r + 1}/{a.rounds}: memcpy ...", flush=True)
            one["memcpy"] = run_memcpy(sizes, runs, seconds, cores[0])
        if "rdmamw" in phases:
            one["rdmamw"] = {}
            for strategy in ("eager", "read", "write"):
                print(f"  round {r + 1}/{a.rounds}: rdmamw {strategy} ...", flush=True)
                one["rdmamw"][strategy] = run_rdmamw(strategy, sizes, a.provider, per_run,
                                                     runs, pair)
        if "mpi4py" in phases:
            print(f"  round {r + 1}/{a.rounds}: mpi4py ...", flush=True)
            one["mpi4py"] = run_mpi(sizes, runs, seconds)
        rounds.append(one)
    res: dict = combine(rounds)
    meta["rounds"] = rounds
    if "regcost" in phases:
        print("  registration cost ...", flush=True)
        res["regcost"] = run_regcost(sizes, a.provider, 0.2 if a.quick else 0.5)
    meta["loadavg_end"] = os.getloadavg()
    report(res, sizes)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in meta['loadavg_end'])}")
    RESULTS.mkdir(exist_ok=True)
    path = Path(a.json) if a.json else RESULTS / (
        f"rendezvous-{a.provider}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.write_text(json.dumps({"meta": meta, "results": res}, indent=1, default=str) + "\n")
    print(f"raw results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
