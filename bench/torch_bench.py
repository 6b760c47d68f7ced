"""torch.distributed on the rdmamw backend vs gloo, and vs rdmamw's collectives
called directly (the backend's own overhead), all in one run on this host (shm).

    python bench/torch_bench.py                         # 1 MiB, 64 MiB; 2 and 4 ranks
    python bench/torch_bench.py --sizes 1M --ranks 2 --reps 50 --ddp-steps 30

Ranks are not pinned (``--pin``: rank r on core ``r mod cores``) and run with
``OMP_NUM_THREADS=1``, what torchrun sets for every rank it starts when it starts
more than one (so torch's intra-op threads do not fight the other ranks for cores).
all_reduce: float32, in place (the torch call), preceded by a barrier; rank 0's
median. "direct" is
``rdmamw.collectives.allreduce(x, out=x)`` on the numpy view of the same tensor,
the calls alternating one by one with the backend's (load drifts between them); rank
0's CPU time per call (all its threads) of both is printed too, and numpy's default
call ``y = allreduce(x)`` (out of place, a pooled result) in the same alternation,
and "torch's layer alone": ``dist.all_reduce`` through a bare group that only hands the
numpy view to the collective (the floor under any Python backend's overhead).
DDP: the small CNN of tests/support/torch_worker.py (batch 32 of 8x8 images, 1 MB buckets),
median seconds per training step (forward, backward with the bucket all_reduces,
SGD step); and a 25 M-parameter MLP (1024 -> 4096 -> 4096 -> 1024 -> 10, batch 32,
torch's default 25 MB buckets: 100 MB of gradients reduced per step), the model
issue 30's DDP target is stated for (``--ddp25-steps``), with two floors timed in the
same jobs: the step under ``no_sync()`` (the compute alone) and the step of a twin
model whose communication hook sends nothing (DDP's bucketing and copies, a free
all_reduce). Each backend's job runs
``--rounds`` times (3), alternating with the other's; a figure is the median of the
jobs' medians. Prints the ratios the targets of issues 16 and 30 are stated in and
writes the JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE / "peers"), str(HERE), str(ROOT)]
from common import emit, pin  # noqa: E402
from run import finish_report  # noqa: E402

SIZES = {"1M": 1 << 20, "64M": 64 << 20}


def reps_for(nbytes: int, reps: int | None) -> int:
    return reps or (100 if nbytes <= 1 << 20 else 12)


def samples(fn, barrier, reps: int) -> list[float]:
    for _ in range(max(2, reps // 10)):          # warm (pages, pools, channels)
        fn()
    ts = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def timed(fn, barrier, reps: int) -> float:
    return statistics.median(samples(fn, barrier, reps))


def interleaved(pairs: dict, reps: int) -> dict[str, float]:
    """Median of each of ``pairs`` (name -> (fn, barrier)), the calls alternating one by
    one (the order flipped every repetition) so that load coming and going during the
    run hits all alike."""
    for fn, _ in pairs.values():
        for _ in range(max(2, reps // 10)):      # warm (pages, pools, channels)
            fn()
    got: dict[str, list[float]] = {k: [] for k in pairs}
    cpu: dict[str, list[float]] = {k: [] for k in pairs}
    for r in range(reps):
        for k in (list(pairs) if r % 2 == 0 else list(pairs)[::-1]):
            fn, barrier = pairs[k]
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            got[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return ({k: statistics.median(v) for k, v in got.items()}
            | {f"{k}/cpu": statistics.median(v) for k, v in cpu.items()})


def floor_all_reduce(pg):
    """A call of ``dist.all_reduce(x)`` through ``pg`` whose allreduce does nothing but
    hand the tensor's numpy view to the collective: torch's own Python layer, the floor
    under any Python backend's overhead. The bare method is made once; each call only
    shadows the group's method for its duration (two dict operations)."""
    import torch.distributed as dist

    import rdmamw.collectives as coll
    from rdmamw.torch.work import Done
    comm, shadow = pg.comm, pg.__dict__

    def bare(tensors, opts=None):
        a = tensors[0].numpy()
        coll.allreduce(a, "sum", "auto", a, comm=comm)
        return Done(tensors)

    def call(x) -> None:
        shadow["allreduce"] = bare
        try:
            dist.all_reduce(x)
        finally:
            del shadow["allreduce"]

    return call


def rank(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    import rdmamw.torch  # noqa: F401 - registers the backend
    me = int(os.environ["RANK"])
    if cfg["pin"]:
        pin(me)
    backend = cfg["backend"]
    dist.init_process_group(backend)
    out: dict = {}
    for nbytes in cfg["sizes"]:
        x = torch.ones(nbytes // 4)
        pairs = {backend: (lambda x=x: dist.all_reduce(x), dist.barrier)}
        if backend == "rdmamw":
            import rdmamw.collectives as coll
            comm = dist.distributed_c10d._get_default_group().comm
            a = x.numpy()
            pairs["direct"] = (lambda a=a, c=comm: coll.allreduce(a, out=a, comm=c),
                               lambda c=comm: coll.barrier(comm=c))
            pairs["default"] = (lambda a=a, c=comm: coll.allreduce(a, comm=c),
                                lambda c=comm: coll.barrier(comm=c))
            floor = floor_all_reduce(dist.distributed_c10d._get_default_group())
            pairs["floor"] = (lambda x=x, f=floor: f(x), dist.barrier)
        for k, v in interleaved(pairs, reps_for(nbytes, cfg["reps"])).items():
            name, _, cpu = k.partition("/")
            out[f"{name}/{nbytes}" + ("/cpu" if cpu else "")] = v
    if cfg["ddp_steps"]:
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        from torch_worker import Net
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=1)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(me)
        batches = [(torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,),
                                                                           generator=g))
                   for _ in range(8)]
        k = [0]

        def step() -> None:
            x, y = batches[k[0] % len(batches)]
            k[0] += 1
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

        out[f"ddp-{backend}"] = timed(step, lambda: None, cfg["ddp_steps"])
    if cfg.get("ddp25_steps"):
        step, alone, free = ddp25_step(me)
        out[f"ddp25-{backend}"] = timed(step, lambda: None, cfg["ddp25_steps"])
        out[f"ddp25-alone-{backend}"] = timed(alone, lambda: None, cfg["ddp25_steps"])
        out[f"ddp25-free-{backend}"] = timed(free, lambda: None, cfg["ddp25_steps"])
    if me == 0:
        emit(out)
    dist.destroy_process_group()


def mlp25m():
    """A 25.2 M-parameter MLP (fully connected, ReLU): 1024 -> 4096 -> 4096 -> 1024 -> 10."""
    import torch
    nn = torch.nn
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))


def free_hook(state, bucket):
    """A DDP communication hook that communicates nothing: the bucket comes back as it
    went. DDP still fills its buckets and copies them back into the gradients, so a step
    with it is DDP's own cost with a free all_reduce."""
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ddp25_step(me: int):
    """One DDP training step of mlp25m() (batch 32, default buckets, SGD); the same step
    under DDP's ``no_sync()``, the compute alone, no gradient leaves the rank; and the
    step of a twin model whose all_reduce is free (free_hook): the floor no backend's
    step can go under with DDP's default bucketing, the ranks sharing the cores as here."""
    import torch

    def trainer(hook=None):
        torch.manual_seed(0)
        net = torch.nn.parallel.DistributedDataParallel(mlp25m())
        if hook is not None:
            net.register_comm_hook(None, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        return net, step

    g = torch.Generator().manual_seed(me)
    x, y = torch.randn(32, 1024, generator=g), torch.randint(0, 10, (32,), generator=g)
    net, step = trainer()
    _, free = trainer(free_hook)

    def alone() -> None:
        with net.no_sync():
            step()

    return step, alone, free


def run(backend: str, n: int, cfg: dict) -> dict:
    from rdmamw.bootstrap.launch import spawn
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}      # as torchrun sets it for more than one rank
    procs = spawn(n, [sys.executable, __file__, "--rank", json.dumps({**cfg,
                                                                       "backend": backend})],
                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=900) for p in procs]
    for out, _ in outs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
    return {"error": outs[0][1][-1500:]}


def combined(rs: list[dict]) -> dict:
    """The median of each metric over the rounds' jobs (the first error if any failed)."""
    for r in rs:
        if "error" in r:
            return r
    return {k: statistics.median(r[k] for r in rs) for k in rs[0]} | {"rounds": rs}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank":
        rank(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,64M")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--reps", type=int, default=None, help="default 100 / 12 by size")
    ap.add_argument("--ddp-steps", type=int, default=40, help="0: no DDP of the CNN")
    ap.add_argument("--ddp25-steps", type=int, default=10,
                    help="steps of the 25 M-parameter model's DDP (0: none)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="jobs per backend, alternating (the median of their medians)")
    ap.add_argument("--pin", action="store_true",
                    help="pin rank r to core r mod cores (default: unpinned, as users run)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args()
    cfg = {"sizes": [SIZES[s] for s in a.sizes.split(",") if s], "reps": a.reps,
           "ddp_steps": a.ddp_steps, "ddp25_steps": a.ddp25_steps, "pin": a.pin}
    meta = {"started": dt.datetime.now().isoformat(timespec="seconds"),
            "loadavg": os.getloadavg(), "cores": len(os.sched_getaffinity(0))}
    res, lines = {}, []
    for n in [int(v) for v in a.ranks.split(",")]:
        runs: dict[str, list[dict]] = {"rdmamw": [], "gloo": []}
        for k in range(a.rounds):                # the backends' jobs alternate
            for backend in list(runs) if k % 2 == 0 else list(runs)[::-1]:
                print(f"[torch] {backend} x{n} ({k + 1}/{a.rounds}) ...", file=sys.stderr,
                      flush=True)
                runs[backend].append(run(backend, n, cfg))
        for backend, rs in runs.items():
            res[f"{backend}/{n}"] = combined(rs)
        r, g = res[f"rdmamw/{n}"], res[f"gloo/{n}"]
        for nbytes in cfg["sizes"]:
            t, tg, td = r.get(f"rdmamw/{nbytes}"), g.get(f"gloo/{nbytes}"), \
                r.get(f"direct/{nbytes}")
            if t and tg and td:
                lines.append(f"{nbytes >> 20:>3d} MiB  {n} ranks  rdmamw {t * 1e3:8.3f} ms  "
                             f"gloo {tg * 1e3:8.3f} ms ({tg / t:5.2f}x faster)  direct "
                             f"{td * 1e3:8.3f} ms (backend {t / td:4.2f}x of direct)")
                tf = r.get(f"floor/{nbytes}")
                if tf:
                    lines.append(f"{'':>21s}torch's layer alone (a bare Python group) "
                                 f"{tf * 1e3:8.3f} ms ({tf / td:4.2f}x of direct)")
                tu = r.get(f"default/{nbytes}")
                if tu:
                    lines.append(f"{'':>21s}numpy's default call y = allreduce(x) {tu * 1e3:8.3f}"
                                 f" ms (backend {t / tu:4.2f}x of it)")
                c, cd = r.get(f"rdmamw/{nbytes}/cpu"), r.get(f"direct/{nbytes}/cpu")
                if c and cd:        # rank 0's CPU per call: what the other load inflates less
                    lines.append(f"{'':>21s}CPU, rank 0: rdmamw {c * 1e3:8.3f} ms  direct "
                                 f"{cd * 1e3:8.3f} ms (backend {c / cd:4.2f}x of direct)")
        d, dg = r.get("ddp-rdmamw"), g.get("ddp-gloo")
        if d and dg:
            lines.append(f"DDP step  {n} ranks  rdmamw {d * 1e3:8.3f} ms  gloo "
                         f"{dg * 1e3:8.3f} ms  (rdmamw/gloo {d / dg:4.2f}x)")
        d, dg = r.get("ddp25-rdmamw"), g.get("ddp25-gloo")
        if d and dg:
            lines.append(f"DDP step, 25 M parameters  {n} ranks  rdmamw {d * 1e3:8.3f} ms  "
                         f"gloo {dg * 1e3:8.3f} ms ({dg / d:5.2f}x faster)")
            f, fg = r.get("ddp25-alone-rdmamw"), g.get("ddp25-alone-gloo")
            if f and fg:        # the compute alone: no backend's step can go under it
                floor = min(f, fg)
                lines.append(f"{'':>21s}the same step under no_sync() (compute alone): "
                             f"{f * 1e3:8.3f} ms in rdmamw's jobs, {fg * 1e3:8.3f} ms in "
                             f"gloo's: at most {dg / floor:4.2f}x faster than gloo here")
            f, fg = r.get("ddp25-free-rdmamw"), g.get("ddp25-free-gloo")
            if f and fg:        # DDP's buckets and copies, the all_reduce free
                floor = min(f, fg)
                lines.append(f"{'':>21s}with a free all_reduce (a comm hook that sends "
                             f"nothing): {f * 1e3:8.3f} ms in rdmamw's jobs, "
                             f"{fg * 1e3:8.3f} ms in gloo's: at most {dg / floor:4.2f}x "
                             f"faster than gloo with DDP's buckets")
    for k, v in res.items():
        if "error" in v:
            lines.append(f"{k}: NOT MEASURED - {v['error'][-300:]}")
    meta["loadavg_end"] = os.getloadavg()
    finish_report("torch", meta, cfg, res, lines, a.out)
    return 1 if any("error" in v for v in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
