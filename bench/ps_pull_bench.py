"""The parameter server's one-sided pull against its two-sided pull, same run.

    python bench/ps_pull_bench.py                       # 1 MiB shard, 4 workers, shm
    python bench/ps_pull_bench.py --rounds 3 --iters 100 --provider tcp

A job of 1 server and --workers workers (rdmamw.bootstrap.launch's environment, one
process each). Rounds alternate the two pulls (their order swapped every round): in
each, a fresh KVServer (ASP, ``pull=`` the mode) serves a shard of one float32 key of
--kib KiB and every worker pulls it --iters times as fast as it can, all at once.
Judged: the median pull latency (over every pull of every worker and round), one-sided
/ two-sided (target <= 0.7); and the server process's CPU time (``time.process_time``
over its ``serve()``, which also spans init, the start barrier and the goodbyes, the
same in both modes) per pull, one-sided / two-sided (target <= 0.1). The server's
loop is the library's own (it waits on its channels when idle): what it costs while
nobody asks it anything is part of what a one-sided pull leaves it.
Also printed: the server loop's own cost, measured in a phase where the workers
sleep (busy = CPU time / wall time of serve()); pulls that fell back to two-sided
and shard reads thrown away torn (none without pushes). The box is shared: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

KEY = "w"
MODES = ("two-sided", "one-sided")


def rank_main(cfg: dict[str, Any]) -> None:
    import rdmamw
    from rdmamw.ps import KVServer, KVWorker
    from rdmamw.ps.job import connect

    serving, chans = connect(1)
    res: dict[str, Any] = {m: {"lat": [], "cpu": 0.0, "pulls": 0, "wall": 0.0, "fallbacks": 0,
                     "torn": 0} for m in (*MODES, "idle")}
    n = cfg["kib"] << 8                                        # float32 elements
    for r in range(cfg["rounds"]):
        for mode in ((*MODES, "idle") if r % 2 == 0 else ("idle", *MODES[::-1])):
            if serving:
                srv = KVServer(chans, consistency="asp", lr=0.01,
                               pull="one-sided" if mode == "idle" else mode)
                c0, t0 = time.process_time(), time.perf_counter()
                srv.serve()
                res[mode]["cpu"] += time.process_time() - c0
                res[mode]["wall"] += time.perf_counter() - t0
                res[mode]["pulls"] += 0 if mode == "idle" else cfg["iters"] * len(chans)
                continue
            w = KVWorker([chans[0]], pull="one-sided" if mode == "idle" else mode)
            out = np.empty(n, np.float32)
            w.init([KEY], [np.ones(n, np.float32)])
            w.pull_start([KEY], [out])
            if mode == "idle":          # the server's loop with nothing to do
                time.sleep(cfg["idle_s"])
            for _ in range(0 if mode == "idle" else cfg["iters"]):
                t0 = time.perf_counter()
                w.pull([KEY], [out])
                res[mode]["lat"].append(time.perf_counter() - t0)
            c = w.pull_counts()
            res[mode]["fallbacks"] += c["fallbacks"]
            res[mode]["torn"] += c["torn"]
            assert (out == 1).all()
            w.done()
    print("RESULT " + json.dumps({"serving": serving, "rank": rdmamw.world().rank, **res}),
          flush=True)
    for ch in chans.values():
        ch.close()


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    from rdmamw.bootstrap.launch import free_port, job_env

    cfg = {"kib": a.kib, "iters": a.iters, "rounds": a.rounds, "idle_s": a.idle}
    port, token = free_port("127.0.0.1"), os.urandom(16).hex()
    n = a.workers + 1
    env_extra = {"RDMAMW_PROVIDER": a.provider}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", json.dumps(cfg)],
                              env={**job_env(r, n, "127.0.0.1", port, token), **env_extra},
                              stdout=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"job failed: {[p.returncode for p in procs]}")
    return [json.loads(next(x for x in o.splitlines() if x.startswith("RESULT "))[7:])
            for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=int, default=1024, help="shard size (one float32 key)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=200, help="pulls per worker, mode and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--provider", default="shm", choices=("shm", "tcp"))
    ap.add_argument("--idle", type=float, default=1.0,
                    help="seconds per round the server serves with nothing asked")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_of:
        rank_main(json.loads(a.rank_of))
        return
    print(f"load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    rows = run(a)
    srv = next(r for r in rows if r["serving"])
    workers = [r for r in rows if not r["serving"]]
    idle_rate = srv["idle"]["cpu"] / srv["idle"]["wall"]
    m: dict[str, Any] = {"idle_cpu_share": idle_rate}
    for mode in MODES:
        lat = [x for r in workers for x in r[mode]["lat"]]
        m[mode] = {"median_us": statistics.median(lat) * 1e6,
                   "p90_us": float(np.percentile(lat, 90)) * 1e6,
                   "cpu_per_pull_us": srv[mode]["cpu"] / srv[mode]["pulls"] * 1e6,
                   "server_cpu_share": srv[mode]["cpu"] / srv[mode]["wall"],
                   "fallbacks": sum(r[mode]["fallbacks"] for r in workers),
                   "torn": sum(r[mode]["torn"] for r in workers), "pulls": len(lat)}
    print(f"\n{a.kib} KiB shard, {a.workers} workers, {a.provider}, {a.rounds} rounds x "
          f"{a.iters} pulls per worker and mode")
    print(f"{'pull':>10} {'median':>10} {'p90':>10} {'server CPU/pull':>16} "
          f"{'server busy':>12} {'fallbacks':>9} {'torn':>5}")
    for mode in MODES:
        x = m[mode]
        print(f"{mode:>10} {x['median_us']:>8.0f}us {x['p90_us']:>8.0f}us "
              f"{x['cpu_per_pull_us']:>14.1f}us "
              f"{x['server_cpu_share']:>11.0%} {x['fallbacks']:>9} {x['torn']:>5}")
    print(f"the server's loop with nothing asked (workers asleep): {idle_rate:.0%} of a core")
    lat = m["one-sided"]["median_us"] / m["two-sided"]["median_us"]
    cpu = m["one-sided"]["cpu_per_pull_us"] / m["two-sided"]["cpu_per_pull_us"]
    print(f"target: pull latency one-sided / two-sided <= 0.7   {lat:.2f}   "
          f"{'PASS' if lat <= 0.7 else 'FAIL'}")
    print(f"target: server CPU per pull one-sided / two-sided <= 0.1   {cpu:.3f}   "
          f"{'PASS' if cpu <= 0.1 else 'FAIL'}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print("JSON " + json.dumps(m))


if __name__ == "__main__":
    main()
