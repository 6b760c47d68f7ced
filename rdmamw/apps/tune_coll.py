"""Calibration: fit the policy's alpha-beta-gamma model on this job and store it.

    rdmamw tune -n 4                    # start 4 local ranks itself
    mpirun -n 8 rdmamw tune             # or under any launcher rdmamw.init() knows
    rdmamw tune -n 4 --out my.json --sizes 4096,1048576

Measures, with the Channel API the collectives use: one-way time of a ping-pong
between two ranks of a group (``intra``) and between two group leaders (``inter``,
when the topology has several groups) over 8 B .. 4 MiB, fitted as
``t = alpha + bytes * beta``; ``gamma`` from timing ``numpy.add`` in place. Then it
times every algorithm at a few sizes next to the model's prediction, and rank 0
writes the JSON (default ``$RDMAMW_COLL_CONFIG`` or
``~/.config/rdmamw/collectives.json``), which users may read and edit (for example
set ``"algorithm": "ring"`` to force one)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rdmamw.collectives import api, policy
from rdmamw.collectives.comm import Communicator

PING_SIZES = [8, 1024, 16384, 65536, 262144, 1 << 20, 4 << 20]
CHECK_SIZES = [4096, 65536, 1 << 20, 16 << 20]


def _pingpong(comm: Communicator, a: int, b: int, sizes: list[int]) -> list[float]:
    """Median one-way seconds per size between ranks ``a`` and ``b`` (others idle)."""
    me = comm.rank
    other = b if me == a else a
    out: list[float] = []

    def body() -> None:
        if me not in (a, b):
            out.extend([0.0] * len(sizes))
            return
        for size in sizes:
            buf = np.zeros(max(1, size // 8), np.float64)
            reps = max(5, min(200, (64 << 20) // max(size, 1) // 16))
            times = []
            for k in range(reps + 3):
                t0 = time.perf_counter()
                if me == a:
                    comm.exchange(other, buf, None, 0, None, buf.dtype)
                    comm.exchange(None, None, other, len(buf), None, buf.dtype)
                else:
                    comm.exchange(None, None, other, len(buf), None, buf.dtype)
                    comm.exchange(other, buf, None, 0, None, buf.dtype)
                if k >= 3:
                    times.append((time.perf_counter() - t0) / 2)
            out.append(float(np.median(times)))

    comm.run(["tune-link", "float64", [a, b], "", -1, ""], [other] if me in (a, b) else [],
             body)
    return out


def fit(sizes: list[int], times: list[float]) -> policy.Link:
    """alpha = the smallest message's time; beta = least-squares slope of the large ones."""
    big = [(s, t) for s, t in zip(sizes, times, strict=True) if s >= 65536]
    xs, ys = np.array([s for s, _ in big], float), np.array([t for _, t in big])
    beta = float(np.polyfit(xs, ys, 1)[0]) if len(big) >= 2 else ys[-1] / xs[-1]
    return policy.Link(alpha=float(times[0]), beta=max(beta, 1e-13))


def _gamma() -> float:
    x = np.ones(4 << 20, np.float32)
    y = np.ones_like(x)
    best = min(_timed(lambda: np.add(x, y, out=x)) for _ in range(7))
    return best / x.nbytes


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _agreed(comm: Communicator, values: list[float], root: int = 0) -> list[float]:
    """``root``'s values on every rank (so every rank holds the same model)."""
    return api.broadcast(np.array(values, np.float64), root=root, comm=comm).tolist()


def calibrate(comm: Communicator, sizes: list[int] = CHECK_SIZES,
              ping_sizes: list[int] = PING_SIZES) -> dict:
    """Run the calibration on every rank; returns the config (the same on all ranks)."""
    groups = api.groups(comm)
    members = {g: [r for r, x in enumerate(groups) if x == g] for g in dict.fromkeys(groups)}
    big = next((m for m in members.values() if len(m) > 1), None)
    model = policy.Model(source="rdmamw tune")
    raw: dict = {}
    if big:
        t = _agreed(comm, _pingpong(comm, big[0], big[1], ping_sizes), big[0])
        model.intra, raw["intra"] = fit(ping_sizes, t), t
    leaders = [m[0] for m in members.values()]
    if len(leaders) > 1:
        t = _agreed(comm, _pingpong(comm, leaders[0], leaders[1], ping_sizes), leaders[0])
        model.inter, raw["inter"] = fit(ping_sizes, t), t
    else:
        model.inter = model.intra
    model.gamma = _agreed(comm, [_gamma()])[0]
    comm.model = model
    checks = []
    for size in sizes:
        x = np.ones(max(1, size // 4), np.float32)
        row = {"bytes": x.nbytes, "auto": policy.choose(x.nbytes, groups, model, "auto"),
               "predicted_s": policy.explain(x.nbytes, groups, model), "measured_s": {}}
        for alg in policy.candidates(groups):
            reps = 3 if x.nbytes >= 1 << 20 else 20
            best = np.inf
            for _ in range(reps):
                api.barrier(comm=comm)
                best = min(best, _timed(lambda a=alg, x=x: api.allreduce(x, algorithm=a,
                                                                     comm=comm)))
            slowest = api.allreduce(np.array([best]), op="max", comm=comm)[0]
            row["measured_s"][alg] = float(slowest)
        checks.append(row)
    return {
        "version": 1,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "source": "rdmamw tune",
        "world_size": comm.size,
        "groups": groups,
        "model": model.to_json(),
        "algorithm": None,
        "pingpong": {"sizes": ping_sizes, **raw},
        "checks": checks,
    }


def table(cfg: dict) -> str:
    m = cfg["model"]
    lines = [f"world {cfg['world_size']}, groups {cfg['groups']}"]
    for k in ("intra", "inter"):
        lines.append(f"{k:6s} alpha {m[k]['alpha'] * 1e6:8.1f} us   "
                     f"beta {1 / m[k]['beta'] / 1e9:6.2f} GB/s")
    lines.append(f"gamma  numpy.add {1 / m['gamma'] / 1e9:6.2f} GB/s")
    lines.append(f"{'bytes':>10s} {'auto':>13s}  algorithm: measured / predicted ms")
    for row in cfg["checks"]:
        cells = "  ".join(f"{a} {row['measured_s'][a] * 1e3:.3f}/{row['predicted_s'][a] * 1e3:.3f}"
                          for a in row["measured_s"])
        lines.append(f"{row['bytes']:>10d} {row['auto']:>13s}  {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rdmamw tune", description=__doc__.split("\n\n")[0],
                                 epilog="the eager/rendezvous threshold: rdmamw tune rndv -h")
    ap.add_argument("-n", "--nprocs", type=int, default=0,
                    help="start this many local ranks (without a launcher)")
    ap.add_argument("--out", default=None, help="config path (default: policy.default_path())")
    ap.add_argument("--sizes", default=",".join(map(str, CHECK_SIZES)),
                    help="comma-separated allreduce sizes in bytes to check the model at")
    ap.add_argument("--topology", default=None, help="'host', 'hostname', 'probe' or labels")
    args = ap.parse_args(argv)
    if args.nprocs:
        from rdmamw.bootstrap.launch import spawn
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        i = rest.index("-n") if "-n" in rest else rest.index("--nprocs")
        del rest[i:i + 2]
        procs = spawn(args.nprocs, [sys.executable, "-m", "rdmamw.apps.tune_coll", *rest],
                      stdout=None, stderr=subprocess.STDOUT)
        return max(p.wait() for p in procs)
    import rdmamw
    rdmamw.init()
    comm = Communicator(topology=args.topology)
    cfg = calibrate(comm, [int(s) for s in args.sizes.split(",") if s])
    if comm.rank == 0:
        path = Path(args.out) if args.out else policy.default_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=1) + "\n")
        print(table(cfg))
        print(f"written: {path}  (override: algorithm= argument, "
              f"{policy.ALGO_ENV}, or \"algorithm\" in the file)")
    comm.close()
    rdmamw.finalize()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
