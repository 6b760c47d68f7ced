"""Dask distributed's P2P shuffle of a dataframe of --gb GiB on a LocalCluster of 4
worker processes, rdmamw:// against tcp:// in one run (issue 31 item 4; docs/dask.md).

Two clusters, one per scheme (``LocalCluster(protocol=..., n_workers=4,
threads_per_worker=1, processes=True)``), stay up for the whole run. Each builds the
same random frame on its workers (``dd.from_map``: partition ``i`` comes from a
generator seeded with ``i``; nothing is shipped from the client) and persists it, so
the timed part is the shuffle only: ``shuffle("k", shuffle_method="p2p")`` followed by
a cheap reduction that forces it, one row of integer sums per output partition. The
reps alternate between the schemes (rdmamw, tcp, tcp, rdmamw, ...) so that a noisy
neighbour hurts both alike; reported: every rep's wall time, the medians and
rdmamw over tcp, and each rep's rdmamw over tcp (its two shuffles ran back to back) with their
median. Only same-run ratios mean anything.

The per-partition sums (row count, sums of the integer columns and of every float
column's bits as int64, which wrap) do not depend on the order of rows inside a
partition, and rows go to the same output partition on either scheme (a hash of
``k``): the run fails unless both schemes give the same sums, and their totals equal
the input's.

    python bench/dask_shuffle.py [--gb 1] [--reps 3] [--workers 4] [--part-mib 32]
                                 [--metrics] [--json]

P2P keeps its shards on disk (``dask.dataframe``'s shuffle asks for that whatever
``distributed.p2p.storage.disk`` says, in dask 2026.8).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMES = ("rdmamw", "tcp")
FLOATS = [f"f{j}" for j in range(6)]
ROW_BYTES = 8 * (2 + len(FLOATS))           # i, k and the floats: 64 B a row
SUMS = ["n", "i", "k", *FLOATS]


def make_part(i: int, rows: int):
    """Input partition ``i``: a global row id ``i``, a shuffle key ``k`` of 2**20
    values, random floats. Deterministic (seeded by ``i``), built on a worker."""
    import pandas as pd
    rng = np.random.default_rng(i)
    cols = {"i": np.arange(i * rows, (i + 1) * rows, dtype=np.int64),
            "k": rng.integers(0, 1 << 20, rows, dtype=np.int64)}
    cols.update({f: rng.random(rows) for f in FLOATS})
    return pd.DataFrame(cols)


def sums(df):
    """One row of order-independent, exact sums of a partition (int64, wrapping)."""
    import pandas as pd
    row = {"n": len(df), "i": int(df["i"].to_numpy().sum()),
           "k": int(df["k"].to_numpy().sum())}
    with np.errstate(over="ignore"):
        row.update({f: int(df[f].to_numpy().view(np.int64).sum()) for f in FLOATS})
    return pd.DataFrame({k: np.array([v], dtype=np.int64) for k, v in row.items()})


def _totals(frame) -> list[int]:
    with np.errstate(over="ignore"):
        return [int(frame[c].to_numpy().sum()) for c in SUMS]


class Side:
    """One scheme's cluster, client and persisted input."""

    def __init__(self, scheme: str, workers: int, nparts: int, rows: int) -> None:
        import dask.dataframe as dd
        from distributed import Client, LocalCluster

        self.scheme = scheme
        self.cluster = LocalCluster(protocol=f"{scheme}://", host="127.0.0.1",
                                    n_workers=workers, threads_per_worker=1,
                                    processes=True, dashboard_address=None,
                                    worker_dashboard_address=None,
                                    silence_logs=logging.ERROR)
        self.client = Client(self.cluster, set_as_default=False)
        addrs = list(self.client.scheduler_info()["workers"])
        assert len(addrs) == workers and all(a.startswith(scheme) for a in addrs), addrs
        meta = make_part(0, 0)
        self.src = self.client.persist(dd.from_map(make_part, range(nparts), rows=rows,
                                                   meta=meta, enforce_metadata=False))
        # their sums: the input is in memory once they are in
        self.input_sums = self.client.compute(
            self.src.map_partitions(sums, meta=sums(meta))).result()
        self.nparts = nparts

    def shuffle_once(self) -> tuple[float, object]:
        """Wall time of the shuffle + the per-partition sums, and those sums."""
        out = self.src.shuffle("k", shuffle_method="p2p", npartitions=self.nparts)
        expr = out.map_partitions(sums, meta=sums(make_part(0, 0)))
        graph = str(list(dict(expr.__dask_graph__()).keys()))
        assert "shuffle-transfer" in graph, "not a P2P shuffle"
        t = time.perf_counter()
        got = self.client.compute(expr).result()
        return time.perf_counter() - t, got

    def metrics(self) -> dict[str, float]:
        """The scheduler's cumulative fine performance metrics in seconds (what the
        workers' tasks and P2P's background comms/disk spent, by activity)."""
        def get(dask_scheduler):
            return {repr(k): v for k, v in dask_scheduler.cumulative_worker_metrics.items()
                    if isinstance(k, tuple) and k[-1] == "seconds"}
        return self.client.run_on_scheduler(get)

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


def agree(results: dict[str, list], inputs: dict[str, list[int]], nparts: int) -> bool:
    """Every rep of every scheme gave the same per-partition sums (``nparts`` rows),
    and their totals are the input's."""
    ref = next(iter(results.values()))[0]
    return (all(r.equals(ref) for rs in results.values() for r in rs)
            and len(ref) == nparts
            and all(v == _totals(ref) for v in inputs.values()))


def run(gb: float, reps: int, workers: int = 4, part_mib: int = 32,
        metrics: bool = False) -> dict:
    """The whole comparison; raises if the schemes' results differ."""
    import dask
    sys.path.insert(0, ROOT)                    # this tree, here and in the workers
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    import rdmamw.dask
    rdmamw.dask.register()
    total_rows = int(gb * (1 << 30)) // ROW_BYTES
    rows = max(1, min(total_rows, (part_mib << 20) // ROW_BYTES))
    nparts = max(workers, -(-total_rows // rows))
    rows = -(-total_rows // nparts)
    times: dict[str, list[float]] = {s: [] for s in SCHEMES}
    results: dict[str, list] = {s: [] for s in SCHEMES}
    spent: dict[str, dict[str, float]] = {s: {} for s in SCHEMES}
    # forkserver: a worker starts in half the time spawn takes
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        sides = {}
        try:
            for s in SCHEMES:
                sides[s] = Side(s, workers, nparts, rows)
            for r in range(reps):
                for s in (SCHEMES if r % 2 == 0 else SCHEMES[::-1]):
                    before = sides[s].metrics() if metrics else {}
                    dt, got = sides[s].shuffle_once()
                    if metrics:
                        for k, v in sides[s].metrics().items():
                            spent[s][k] = spent[s].get(k, 0.0) + v - before.get(k, 0.0)
                    times[s].append(dt)
                    results[s].append(got.reset_index(drop=True))
            inputs = {s: _totals(side.input_sums) for s, side in sides.items()}
        finally:
            for side in sides.values():
                side.close()
    identical = agree(results, inputs, nparts)
    ref = results[SCHEMES[0]][0]
    med = {s: statistics.median(times[s]) for s in SCHEMES}
    # each rep's two shuffles ran back to back: their ratio sees the same neighbours
    paired = [a / b for a, b in zip(times["rdmamw"], times["tcp"], strict=True)]
    out = {"gib": nparts * rows * ROW_BYTES / (1 << 30), "rows": nparts * rows,
           "partitions": nparts, "workers": workers, "reps": reps,
           "times_s": times, "median_s": med,
           "rdmamw_over_tcp": med["rdmamw"] / med["tcp"],
           "paired": paired, "paired_median": statistics.median(paired),
           "identical": identical, "totals": dict(zip(SUMS, _totals(ref), strict=True))}
    if metrics:         # per scheme, summed over the reps and the workers
        out["metrics_s"] = {s: {k: v for k, v in sorted(m.items(), key=lambda kv: -kv[1])
                                if v >= 0.05} for s, m in spent.items()}
    if not identical:
        raise AssertionError(f"the schemes' shuffles differ: {json.dumps(out)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="GiB of data (64 B a row)")
    ap.add_argument("--reps", type=int, default=3, help="shuffles per scheme")
    ap.add_argument("--workers", type=int, default=4, help="worker processes")
    ap.add_argument("--part-mib", type=int, default=32, help="MiB per partition")
    ap.add_argument("--metrics", action="store_true", help="where the workers' time "
                    "went: distributed's fine performance metrics, per scheme")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.gb, args.reps, args.workers, args.part_mib, args.metrics)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(f"P2P shuffle of {res['gib']:.2f} GiB ({res['rows']} rows, {res['partitions']}"
          f" partitions), {res['workers']} worker processes")
    for s in SCHEMES:
        print(f"{s:>7}: " + " ".join(f"{t:7.2f}" for t in res["times_s"][s])
              + f"  | median {res['median_s'][s]:7.2f} s")
    print(f"rdmamw vs tcp: {res['rdmamw_over_tcp']:.2f}x of the medians (target <= 0.75x);"
          " per rep: " + " ".join(f"{r:.2f}" for r in res["paired"])
          + f", median {res['paired_median']:.2f}x; results identical: {res['identical']}")
    for s, m in res.get("metrics_s", {}).items():
        print(f"{s}: worker seconds by activity, all reps (>= 0.05 s)")
        for k, v in m.items():
            print(f"  {v:8.2f}  {k}")


if __name__ == "__main__":
    main()
