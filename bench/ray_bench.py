"""Ray's collective allreduce, the "rdmamw" group (rdmamw.ray) against Ray's own
"gloo" group, in one run on the same two actors (issue 31 item 4; docs/ray.md).

Two Ray actors (``ray.init(num_cpus=2)``, this host) join both groups. For each size
(float32 arrays of 1 MiB and 64 MiB) both actors run ``ray.util.collective.allreduce``
``--reps`` times after a barrier and a warm-up, in blocks that alternate between the
backends (rdmamw, gloo, rdmamw, gloo) so a noisy neighbour hurts both alike. A rep's
time is the slower rank's; reported: the medians and gloo/rdmamw. Only same-run
ratios mean anything.

    python bench/ray_bench.py [--reps N] [--sizes 1MiB,64MiB] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"1MiB": 1 << 20, "64MiB": 64 << 20}
BACKENDS = ("rdmamw", "gloo")


def _actor_class():
    import ray

    @ray.remote(num_cpus=1)
    class Member:
        def __init__(self) -> None:
            import rdmamw.ray
            rdmamw.ray.register()

        def join(self, rank: int) -> None:
            import ray.util.collective as col
            for b in BACKENDS:
                col.init_collective_group(2, rank, backend=b, group_name=b)

        def allreduce(self, backend: str, nbytes: int, reps: int, warm: int) -> list[float]:
            import ray.util.collective as col
            x = np.zeros(nbytes // 4, np.float32)       # zeros: the sums stay finite
            for _ in range(warm):
                col.allreduce(x, backend)
            times = []
            for _ in range(reps):
                col.barrier(backend)
                t = time.perf_counter()
                col.allreduce(x, backend)
                times.append(time.perf_counter() - t)
            return times

    return Member


def main() -> None:
    sys.path.insert(0, ROOT)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="rows as JSON")
    ap.add_argument("--sizes", default=",".join(SIZES), help="of " + ",".join(SIZES))
    ap.add_argument("--reps", type=int, default=40, help="allreduces per size and backend "
                    "(64 MiB: a quarter, at least 6), in two blocks each")
    args = ap.parse_args()
    import ray

    import rdmamw.ray
    rdmamw.ray.register()
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        Member = _actor_class()
        ms = [Member.remote() for _ in range(2)]
        ray.get([m.join.remote(r) for r, m in enumerate(ms)])
        rows = []
        for name in args.sizes.split(","):
            n = SIZES[name]
            reps = args.reps if n < (8 << 20) else max(6, args.reps // 4)
            got: dict[str, list[float]] = {b: [] for b in BACKENDS}
            for _ in range(2):
                for b in BACKENDS:
                    per_rank = ray.get([m.allreduce.remote(b, n, reps // 2, 2) for m in ms])
                    got[b] += [max(ts) for ts in zip(*per_rank, strict=True)]
            row = {"size": name, "reps": len(got["rdmamw"])}
            for b in BACKENDS:
                row[f"{b}_ms"] = statistics.median(got[b]) * 1e3
                row[f"{b}_GBps"] = n / statistics.median(got[b]) / 1e9
            row["gloo_over_rdmamw"] = row["gloo_ms"] / row["rdmamw_ms"]
            rows.append(row)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"ray {ray.__version__}, 2 actors on this host, float32 allreduce (sum), medians")
    print(f"{'size':>6} | {'rdmamw (ms)':>12} {'gloo (ms)':>10} | {'rdmamw GB/s':>11} "
          f"{'gloo GB/s':>10} | speed-up")
    for r in rows:
        print(f"{r['size']:>6} | {r['rdmamw_ms']:>12.2f} {r['gloo_ms']:>10.2f} | "
              f"{r['rdmamw_GBps']:>11.2f} {r['gloo_GBps']:>10.2f} | "
              f"{r['gloo_over_rdmamw']:>6.2f}x")


if __name__ == "__main__":
    main()
