"""Allreduce benchmark: rdmamw collectives vs mpi4py (MPICH) Allreduce vs the
numpy.add floor, all in one run (torch.distributed gloo too when torch imports).

    python bench/allreduce_bench.py                      # 1 MiB and 64 MiB, 2 and 4 ranks
    python bench/allreduce_bench.py --sizes 1M --ranks 2 --reps 20
    python bench/allreduce_bench.py --only rdmamw,numpy  # subset of systems

Each measured allreduce is out of place on float32, preceded by a barrier; the time
is rank 0's median over the repetitions (the barrier starts the ranks within a
message latency of each other), next to rank 0's median CPU time per call (all its
threads: on a shared machine the wall time grows with the other jobs' load, the CPU
time much less). Processes are not pinned (what a user's job does; ``--pin`` pins
rank r to core ``r mod cores``, the floor to core 0). The floor is one
np.add(a, b, out=c) of the same size in one process, measured before and after the
others (the lower one counts, so load that inflates one floor measurement cannot
flatter the ratio). Prints a table of the times and the ratios the targets are
stated in, and writes the JSON to bench/results/. On a shared box, the other load is
flagged under the table.

Prerequisites: bash bench/setup.sh .venv/bin/python (MPICH + mpi4py); torch optional.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE)]
from common import emit, pin  # noqa: E402
from run import cpu_busy, finish_report, wait_quiet  # noqa: E402

SYSTEMS = ("numpy", "rdmamw", "mpi4py", "gloo")
SIZES = {"8": 8, "64K": 64 << 10, "1M": 1 << 20, "64M": 64 << 20}


def size_label(nbytes: int) -> str:
    """``  8 B``, `` 64 KiB``, ``  1 MiB``: what SIZES names, right-aligned."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift:>3d} {unit}"
    return f"{nbytes:>3d} B  "


def reps_for(nbytes: int, reps: int | None) -> int:
    return reps or (200 if nbytes <= 1 << 20 else 15)


def warmup_for(nbytes: int, reps: int | None) -> int:
    """Untimed calls first (every system alike): a tenth of the timed ones, at least 2,
    so the first algorithm measured does not also pay for page faults and caches."""
    return max(2, reps_for(nbytes, reps) // 10)


# ---- one rank of each system ----------------------------------------------------------


def rank_rdmamw(cfg: dict) -> None:
    import rdmamw
    import rdmamw.collectives as coll
    w = rdmamw.init()
    if cfg["pin"]:
        pin(w.rank)
    comm = coll.Communicator()
    out: dict = {}
    for nbytes in cfg["sizes"]:
        warm = warmup_for(nbytes, cfg["reps"])
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        for alg in cfg["algorithms"]:      # every algorithm warm before any is timed
            for _ in range(warm):
                y = call(coll, x, alg, y, comm)
        for alg in cfg["algorithms"]:
            times, cpu = [], []
            for k in range(reps_for(nbytes, cfg["reps"]) + warm):
                coll.barrier(comm=comm)
                t0, c0 = time.perf_counter(), time.process_time()
                y = call(coll, x, alg, y, comm)
                if k >= warm:
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
            assert y[0] == w.world_size and y[-1] == w.world_size
            out[f"{alg}/{nbytes}"] = statistics.median(times)
            out[f"{alg}/{nbytes}/cpu"] = statistics.median(cpu)
        out[f"choice/{nbytes}"] = coll.policy.choose(nbytes, coll.groups(comm), comm.model)
    if w.rank == 0:
        emit(out)
    comm.close()
    rdmamw.finalize()


def call(coll, x: np.ndarray, alg: str, y: np.ndarray, comm) -> np.ndarray:
    """One allreduce: into ``y``; "oop" is the training-loop form ``y = allreduce(x)``
    (a new result each call, from the collectives' result pool, algorithm auto);
    "fresh" the same into a new ``numpy.empty`` each call (the page faults the pool
    saves)."""
    if alg == "oop":
        return coll.allreduce(x, comm=comm)
    if alg == "fresh":          # what oop cost before the result pool: new pages per call
        return coll.allreduce(x, comm=comm, out=np.empty_like(x))
    return coll.allreduce(x, algorithm=alg, out=y, comm=comm)


def rank_mpi(cfg: dict) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if cfg["pin"]:
        pin(comm.Get_rank())
    out: dict = {"library": MPI.Get_library_version().splitlines()[0].strip()}
    for nbytes in cfg["sizes"]:
        warm = warmup_for(nbytes, cfg["reps"])
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        times = []
        for k in range(reps_for(nbytes, cfg["reps"]) + warm):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(x, y, op=MPI.SUM)
            if k >= warm:
                times.append(time.perf_counter() - t0)
        assert y[0] == comm.Get_size()
        out[f"mpi4py/{nbytes}"] = statistics.median(times)
    if comm.Get_rank() == 0:
        emit(out)


def rank_gloo(cfg: dict) -> None:
    import torch
    import torch.distributed as tdist
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg["pin"]:
        pin(rank)
    tdist.init_process_group("gloo", rank=rank, world_size=n)
    out: dict = {"torch": torch.__version__}
    for nbytes in cfg["sizes"]:
        warm = warmup_for(nbytes, cfg["reps"])
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        times = []
        for k in range(reps_for(nbytes, cfg["reps"]) + warm):
            x.fill_(1.0)
            tdist.barrier()
            t0 = time.perf_counter()
            tdist.all_reduce(x)
            if k >= warm:
                times.append(time.perf_counter() - t0)
        assert float(x[0]) == n
        out[f"gloo/{nbytes}"] = statistics.median(times)
    if rank == 0:
        emit(out)
    tdist.destroy_process_group()


def numpy_floor(cfg: dict) -> dict:
    """numpy.add of two arrays into a third (on core 0 with ``--pin``). The affinity
    is put back afterwards: the ranks started later inherit it, and pin(rank) would
    otherwise put every rank on this one core."""
    cores = os.sched_getaffinity(0)
    if cfg["pin"]:
        pin(0)
    try:
        return _numpy_floor(cfg)
    finally:
        os.sched_setaffinity(0, cores)


def _numpy_floor(cfg: dict) -> dict:
    out = {}
    for nbytes in cfg["sizes"]:
        warm = warmup_for(nbytes, cfg["reps"])
        a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
        c = np.empty_like(a)
        times = []
        for _ in range(reps_for(nbytes, cfg["reps"]) + warm):
            t0 = time.perf_counter()
            np.add(a, b, out=c)
            times.append(time.perf_counter() - t0)
        out[f"numpy/{nbytes}"] = statistics.median(times[warm:])
    return out


# ---- driving ---------------------------------------------------------------------------


def result_of(procs: list[subprocess.Popen], timeout: float) -> dict:
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"error": "timed out"}
    for out, _ in outs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
    codes = [p.returncode for p in procs]
    return {"error": f"exit codes {codes}: {outs[0][1].strip()[-800:]}"}


def run(system: str, n: int, cfg: dict) -> dict:
    me = [sys.executable, str(Path(__file__).resolve())]
    arg = json.dumps(cfg)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    if system == "rdmamw":
        sys.path.insert(0, str(HERE.parent))
        from rdmamw.bootstrap.launch import spawn
        return result_of(spawn(n, [*me, "--rank", "rdmamw", arg], **pipes), 600)
    if system == "mpi4py":
        if not shutil.which("mpiexec"):
            return {"error": "mpiexec not found: bash bench/setup.sh", "untested": True}
        return result_of([subprocess.Popen(["mpiexec", "-n", str(n), *me, "--rank", "mpi",
                                            arg], **pipes)], 600)
    if system == "gloo":
        probe = subprocess.run([sys.executable, "-c", "import torch.distributed"],
                               capture_output=True)
        if probe.returncode:
            return {"error": "torch not importable (optional: pip install torch)",
                    "untested": True}
        from rdmamw.bootstrap.launch import free_port
        port = str(free_port())
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "WORLD_SIZE": str(n)}
        return result_of([subprocess.Popen([*me, "--rank", "gloo", arg],
                                           env={**env, "RANK": str(r)}, **pipes)
                          for r in range(n)], 600)
    raise ValueError(system)


def table(res: dict, cfg: dict) -> list[str]:
    lines = []
    for nbytes in cfg["sizes"]:
        floor = res.get("numpy", {}).get(f"numpy/{nbytes}")
        for n in cfg["ranks"]:
            r = res.get(f"rdmamw/{n}", {})
            mpi = res.get(f"mpi4py/{n}", {}).get(f"mpi4py/{nbytes}")
            gloo = res.get(f"gloo/{n}", {}).get(f"gloo/{nbytes}")
            for alg in cfg["algorithms"]:
                t = r.get(f"{alg}/{nbytes}")
                if t is None:
                    continue
                name = alg if alg != "auto" else f"auto={r.get(f'choice/{nbytes}')}"
                cells = [size_label(nbytes), f"{n} ranks", f"{name:17s}",
                         f"{t * 1e3:8.3f} ms", f"{nbytes / t / 1e9:6.2f} GB/s"]
                cpu = r.get(f"{alg}/{nbytes}/cpu")
                if cpu is not None:     # rank 0's CPU time per call: what load cannot inflate
                    cells.append(f"cpu {cpu * 1e3:8.3f} ms")
                cells.append(f"x floor {t / floor:5.2f}" if floor else "x floor   n/a")
                cells.append(f"mpi4py {mpi * 1e3:8.3f} ms ({mpi / t:5.2f}x)" if mpi
                             else "mpi4py n/a")
                if gloo:
                    cells.append(f"gloo {gloo * 1e3:8.3f} ms ({gloo / t:5.2f}x)")
                lines.append("  ".join(cells))
        if floor:
            lines.append(f"{size_label(nbytes)}  numpy.add floor {floor * 1e3:.3f} ms")
    return lines


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank":
        {"rdmamw": rank_rdmamw, "mpi": rank_mpi, "gloo": rank_gloo}[sys.argv[2]](
            json.loads(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,64M", help="comma-separated, from " + str(list(SIZES)))
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 200 / 15)")
    ap.add_argument("--algorithms", default="auto,ring,rhd,oop",
                    help="oop: auto with a new result per call (y = allreduce(x)); "
                         "fresh: auto into a new numpy.empty per call")
    ap.add_argument("--only", default=",".join(SYSTEMS))
    ap.add_argument("--pin", action="store_true",
                    help="pin rank r to core r mod cores (default: unpinned, as users run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each system, wait up to S s for other load to drop below 10%%")
    a = ap.parse_args()
    cfg = {"sizes": [SIZES[s] for s in a.sizes.split(",")],
           "ranks": [int(n) for n in a.ranks.split(",")], "reps": a.reps,
           "algorithms": a.algorithms.split(","), "pin": a.pin}
    only = a.only.split(",")
    res: dict = {}
    meta = {"started": dt.datetime.now().isoformat(timespec="seconds"),
            "cores": len(os.sched_getaffinity(0)), "busy_percent_before": cpu_busy(0.5),
            "loadavg": os.getloadavg()}
    meta["busy_percent_at_start"] = {}
    if "numpy" in only:
        meta["busy_percent_at_start"]["numpy"] = wait_quiet(a.wait_quiet)
        res["numpy"] = numpy_floor(cfg)
    for n in cfg["ranks"]:
        for system in ("rdmamw", "mpi4py", "gloo"):
            if system in only:
                busy = wait_quiet(a.wait_quiet)
                meta["busy_percent_at_start"][f"{system}/{n}"] = busy
                print(f"[allreduce] {system} x{n} (others busy {busy:.0f}%) ...",
                      file=sys.stderr, flush=True)
                res[f"{system}/{n}"] = run(system, n, cfg)
    if "numpy" in only:          # again: the lower floor of the two (a conservative ratio)
        again = numpy_floor(cfg)
        meta["numpy_floor_start_end"] = {k: [v, again[k]] for k, v in res["numpy"].items()}
        res["numpy"] = {k: min(v, again[k]) for k, v in res["numpy"].items()}
    meta["busy_percent_after"] = cpu_busy(0.5)
    meta["loadavg_end"] = os.getloadavg()
    lines = table(res, cfg)
    for key, r in res.items():
        if "error" in r:
            lines.append(f"{key}: NOT MEASURED - {r['error'][:300]}")
    finish_report("allreduce", meta, cfg, res, lines, a.out)
    return 1 if any("error" in r and not r.get("untested") for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
