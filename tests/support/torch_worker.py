"""One rank of a torch.distributed job on the "rdmamw" backend (started by
tests/integrations/test_torch.py). ``python torch_worker.py SCENARIO [JSON]`` prints one JSON line.
Every rank regenerates all ranks' inputs from seeds and compares whole tensors with
torch's own reduction of them."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import rdmamw.torch  # noqa: F401 - registers the backend

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
R = dist.ReduceOp
FLOAT_OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG]
INT_OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def values(rank: int, shape: tuple, dtype: torch.dtype, seed: int, op=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if op == R.PRODUCT:
        return torch.tensor([1, 1, 2, 1])[torch.randint(0, 4, shape, generator=g)].to(dtype)
    if dtype.is_floating_point:       # fractions: float16 / bfloat16 sums round
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    lo = 0 if dtype == torch.uint8 else -5
    return torch.randint(lo, 6, shape, generator=g).to(dtype)


def reference(inputs: list[torch.Tensor], op, dtype: torch.dtype) -> torch.Tensor:
    """torch's reduction of the ranks' tensors; float16 / bfloat16 in float32, once
    rounded (what the backend promises)."""
    if dtype in (torch.float16, torch.bfloat16):
        return reference([t.float() for t in inputs], op, torch.float32).to(dtype)
    s = torch.stack(inputs)
    if dtype == torch.bool:
        if op in (R.SUM, R.MAX, R.BOR):
            return s.any(0)
        if op in (R.PRODUCT, R.MIN, R.BAND):
            return s.all(0)
        return (s.sum(0) % 2).bool()             # BXOR
    if op == R.SUM:
        return s.sum(0, dtype=dtype)
    if op == R.AVG:
        return s.sum(0) / len(inputs)
    if op == R.PRODUCT:
        return s.prod(0, dtype=dtype)
    if op == R.MIN:
        return s.min(0).values
    if op == R.MAX:
        return s.max(0).values
    out = inputs[0].clone()
    for t in inputs[1:]:
        out = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or,
               R.BXOR: torch.bitwise_xor}[op](out, t)
    return out


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
    if got.dtype in (torch.float16, torch.bfloat16):
        # summed in float32 and rounded once, as the reference: the float32 order may
        # differ, which moves a 16-bit rounding only at a tie (rare), by one unit;
        # summing in 16 bits would round at every rank and miss on many elements
        exact = (got == want).double().mean().item() if got.numel() else 1.0
        ok = exact >= 0.995 and torch.allclose(got.double(), want.double(),
                                               rtol=_eps(got.dtype), atol=0)
    elif got.dtype.is_floating_point:
        # summation order differs from torch's: allow the last bit of the dtype
        ok = torch.allclose(got.double(), want.double(), rtol=2 * _eps(got.dtype), atol=1e-6)
    else:
        ok = torch.equal(got, want)
    assert ok, f"{what}: got {got} want {want}"


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def init(cfg: dict) -> tuple[int, int]:
    kw = {}
    if cfg.get("init_method"):
        kw = {"init_method": cfg["init_method"], "rank": int(os.environ["RANK"]),
              "world_size": int(os.environ["WORLD_SIZE"])}
    if cfg.get("timeout"):
        kw["timeout"] = datetime.timedelta(seconds=cfg["timeout"])
    if cfg.get("world_size"):
        kw.update(world_size=cfg["world_size"], rank=int(os.environ["RANK"]))
    dist.init_process_group("rdmamw", **kw)
    return dist.get_rank(), dist.get_world_size()


def ops(cfg: dict) -> dict:
    """Every operation, every dtype, every reduce op the dtype has, whole tensors."""
    me, n = init(cfg)
    checks, seed = 0, 0
    for dt in DTYPES:
        for length in cfg["lengths"]:
            for op in (FLOAT_OPS if dt.is_floating_point else INT_OPS):
                seed += 1
                shape = (length, 3)
                t = values(me, shape, dt, seed, op)
                dist.all_reduce(t, op=op)
                want = reference([values(r, shape, dt, seed, op) for r in range(n)], op, dt)
                same(t, want, f"all_reduce {dt} {op}")
                # reduce to a root, async, non-contiguous (a transposed view)
                root = seed % n
                t = values(me, (3, length), dt, seed, op).t()
                dist.reduce(t, dst=root, op=op, async_op=True).wait()
                if me == root:
                    same(t, reference([values(r, (3, length), dt, seed, op).t()
                                       for r in range(n)], op, dt), f"reduce {dt} {op}")
                checks += 2
            seed += 1
            shape = (length, 2)
            mine = [values(me * n + j, shape, dt, seed) for j in range(n)]
            root = seed % n
            # broadcast (non-contiguous)
            t = values(me, (2, length), dt, seed).t()
            dist.broadcast(t, src=root)
            same(t, values(root, (2, length), dt, seed).t(), f"broadcast {dt}")
            # all_gather, all_gather_into_tensor
            outs = [torch.empty(shape, dtype=dt) for _ in range(n)]
            dist.all_gather(outs, mine[0])
            for r in range(n):
                same(outs[r], values(r * n, shape, dt, seed), f"all_gather {dt}")
            big = torch.empty((n * length, 2), dtype=dt)
            dist.all_gather_into_tensor(big, mine[0])
            same(big, torch.cat([values(r * n, shape, dt, seed) for r in range(n)]),
                 f"all_gather_into_tensor {dt}")
            # reduce_scatter (list and tensor)
            op = R.SUM if dt != torch.bool else R.BOR
            out = torch.empty(shape, dtype=dt)
            dist.reduce_scatter(out, mine, op=op)
            same(out, reference([values(r * n + me, shape, dt, seed) for r in range(n)], op,
                                dt), f"reduce_scatter {dt}")
            out = torch.empty(shape, dtype=dt)
            dist.reduce_scatter_tensor(out, torch.cat(mine), op=op)
            same(out, reference([values(r * n + me, shape, dt, seed) for r in range(n)], op,
                                dt), f"reduce_scatter_tensor {dt}")
            # all_to_all with uneven sizes: rank r sends (r + j) % 3 + length rows to j
            rows = [(me + j) % 3 + length for j in range(n)]
            ins = [values(me * n + j, (rows[j], 2), dt, seed) for j in range(n)]
            outs = [torch.empty(((r + me) % 3 + length, 2), dtype=dt) for r in range(n)]
            dist.all_to_all(outs, ins)
            for r in range(n):
                same(outs[r], values(r * n + me, ((r + me) % 3 + length, 2), dt, seed),
                     f"all_to_all {dt}")
            x = torch.cat(ins)
            y = torch.empty((sum(o.shape[0] for o in outs), 2), dtype=dt)
            dist.all_to_all_single(y, x, [o.shape[0] for o in outs], rows)
            same(y, torch.cat(outs), f"all_to_all_single uneven {dt}")
            y = torch.empty((n * length, 2), dtype=dt)
            dist.all_to_all_single(y, torch.cat([m[:length] for m in mine]))
            same(y, torch.cat([values(r * n + me, shape, dt, seed)[:length] for r in range(n)]),
                 f"all_to_all_single even {dt}")
            # gather, scatter
            outs = [torch.empty(shape, dtype=dt) for _ in range(n)] if me == root else None
            dist.gather(mine[0], outs, dst=root)
            if me == root:
                for r in range(n):
                    same(outs[r], values(r * n, shape, dt, seed), f"gather {dt}")
            out = torch.empty(shape, dtype=dt)
            dist.scatter(out, mine if me == root else None, src=root)
            same(out, values(root * n + me, shape, dt, seed), f"scatter {dt}")
            # point to point: a ring of isend / irecv, and batch_isend_irecv
            nxt, prv = (me + 1) % n, (me - 1) % n
            got = torch.empty(shape, dtype=dt)
            ws = [dist.isend(mine[0], nxt), dist.irecv(got, prv)]
            for w in ws:
                w.wait()
            same(got, values(prv * n, shape, dt, seed), f"isend/irecv {dt}")
            got2 = torch.empty((2, length), dtype=dt).t()            # non-contiguous
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine[1], prv),
                                             dist.P2POp(dist.irecv, got2, nxt)]):
                w.wait()
            same(got2, values(nxt * n + 1, shape, dt, seed), f"batch_isend_irecv {dt}")
            if me == 0:
                dist.send(mine[2 % n], 1 % n)
            elif me == 1:
                dist.recv(got, 0)
                same(got, values(0 * n + 2 % n, shape, dt, seed), f"send/recv {dt}")
            checks += 13
    dist.barrier()
    # async work and futures: several in flight, a chained future
    ts = [torch.full((1000,), float(me + k)) for k in range(4)]
    ws = [dist.all_reduce(t, async_op=True) for t in ts]
    fut = ws[-1].get_future().then(lambda f: f.value()[0] * 2)
    for k, w in enumerate(ws):
        w.wait()
        assert torch.equal(ts[k], torch.full((1000,), float(sum(r + k for r in range(n)))))
    assert torch.equal(fut.wait(), ts[-1] * 2)
    dist.destroy_process_group()
    return {"rank": me, "checks": checks}


class Net(torch.nn.Module):
    """The small CNN of bench/torch_bench.py (8x8 digits-sized inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = torch.nn.Linear(8 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def ddp(cfg: dict) -> dict:
    """DistributedDataParallel training from one seed on cfg's backend; rank 0 saves
    the final parameters to cfg["out"] (the test compares rdmamw's with gloo's)."""
    backend = cfg["backend"]
    dist.init_process_group(backend)
    me = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():             # ranks start apart: DDP's broadcast must align them
        for p in model.parameters():
            p.add_(me * 0.01)
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.get("bucket", 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + me)
    for _ in range(cfg["steps"]):
        x = torch.randn(32, 1, 8, 8, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    if me == 0:
        torch.save([p.detach().clone() for p in model.parameters()], cfg["out"])
    dist.destroy_process_group()
    return {"rank": me}


def lose(cfg: dict) -> dict:
    """4 ranks loop dist.all_reduce; rank cfg["victim"] dies at call cfg["at"]; the
    others catch the error, shrink the group (rdmamw.torch.shrink) and all_reduce on
    the survivors' group (its result: the sum of their world rank + 1)."""
    import rdmamw.torch as rt
    dist.init_process_group("rdmamw", timeout=datetime.timedelta(seconds=cfg["timeout"]))
    me = dist.get_rank()
    t = torch.ones(1 << 16)
    error, named, calls = None, None, 0
    try:
        while True:
            if me == cfg["victim"] and calls == cfg["at"]:
                os._exit(3)                 # dies without a word
            dist.all_reduce(t)
            calls += 1
    except Exception as e:  # noqa: BLE001 - what the survivors see
        error, named = f"{type(e).__name__}: {e}", getattr(e, "rank", None)
    t0 = time.monotonic()
    pg = rt.shrink()
    x = torch.full((1000,), float(me + 1))
    pg.allreduce([x]).wait()
    return {"rank": me, "error": error, "named": named, "new_rank": pg.rank(),
            "new_size": pg.size(), "sum": float(x[0]), "same": bool((x == x[0]).all()),
            "shrink_s": time.monotonic() - t0, **({"pg": pg} if cfg.get("keep") else {})}


def grown(pg: Any, me: int) -> dict[str, Any]:
    """On the grown group: an all_reduce (sum of world rank + 1), and a ring of
    send / recv (each rank sends its world rank to the next, in group order)."""
    x = torch.full((1000,), float(me + 1))
    pg.allreduce([x]).wait()
    n, r = pg.size(), pg.rank()
    got = torch.full((3,), -1.0)
    sent = pg.send([torch.full((3,), float(me))], (r + 1) % n, 5)
    pg.recv([got], (r - 1) % n, 5).wait()
    sent.wait()
    return {"rank": me, "new_rank": r, "new_size": n, "sum": float(x[0]),
            "same": bool((x == x[0]).all()), "from_prev": got.tolist()}


def grow(cfg: dict[str, Any]) -> dict[str, Any]:
    """``lose`` with a way back: after the shrink, rank 0 of the survivors starts a new
    process for the victim (its environment, scenario ``rejoin``), everyone grows the
    group back (rdmamw.torch.grow / join) and runs :func:`grown`; rank 0's result
    holds the new process's."""
    import subprocess

    import rdmamw.torch as rt
    out = lose({**cfg, "keep": True})
    me, pg = out["rank"], out.pop("pg")
    child = None
    if pg.rank() == 0:
        env = dict(os.environ, RANK=str(cfg["victim"]), LOCAL_RANK=str(cfg["victim"]))
        child = subprocess.Popen([sys.executable, __file__, "rejoin", json.dumps(cfg)],
                                 env=env, stdout=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    pg = rt.grow(pg, cfg.get("ranks"))
    out.update(grown(pg, me), grow_s=time.monotonic() - t0)
    if child is not None:
        line = child.communicate(timeout=120)[0]
        out["replacement"] = json.loads(line.splitlines()[-1]) if line else child.returncode
    return out


def rejoin(cfg: dict[str, Any]) -> dict[str, Any]:
    """The victim's new process: rdmamw.torch.join, then :func:`grown`."""
    import rdmamw.torch as rt
    pg = rt.join(cfg["timeout"])
    return {**grown(pg, dist.get_rank()), "default": pg is dist.group.WORLD}


def ddp_lose(cfg: dict) -> dict:
    """DDP training on 4 ranks; rank cfg["victim"] dies at step cfg["at"]; the others
    catch the error, shrink the group (rdmamw.torch.shrink), wrap the model again on
    the survivors' group and finish the training; each prints its parameters' digest
    and whether the error named the victim."""
    import rdmamw.torch as rt
    dist.init_process_group("rdmamw", timeout=datetime.timedelta(seconds=cfg["timeout"]))
    me = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + me)
    error, named, pg, step, took = None, None, None, 0, 0.0
    while step < cfg["steps"]:
        x = torch.randn(32, 1, 8, 8, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        if me == cfg["victim"] and step == cfg["at"]:
            os._exit(3)                     # dies without a word
        try:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            step += 1
        except Exception as e:  # noqa: BLE001 - what DDP raises for the lost rank
            if pg is not None:
                raise
            t0, error = time.monotonic(), f"{type(e).__name__}: {e}"
            named = f"rank {cfg['victim']}" in str(e)
            pg = rt.shrink()
            net = torch.nn.parallel.DistributedDataParallel(model, process_group=pg,
                                                            bucket_cap_mb=1)
            took = time.monotonic() - t0
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"rank": me, "error": error, "named": named, "steps": step,
            "new_rank": pg.rank() if pg else None, "new_size": pg.size() if pg else None,
            "digest": [float(params.sum()), float(params.abs().sum())], "shrink_s": took}


def hello(cfg: dict) -> dict:
    """init (cfg's init_method), one all_reduce, destroy."""
    me, n = init(cfg)
    t = torch.full((7,), float(me + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((7,), float(n * (n + 1) // 2)))
    backend = dist.get_backend()
    dist.destroy_process_group()
    return {"rank": me, "size": n, "backend": backend}


def groups(cfg: dict) -> dict:
    """dist.new_group: ranks [0, 2] and [1, 2] reduce in their own groups."""
    me, n = init(cfg)
    a = dist.new_group([0, 2])
    b = dist.new_group([1, 2])
    res = {}
    for name, g, members in (("a", a, [0, 2]), ("b", b, [1, 2])):
        if me in members:
            t = torch.full((5,), float(me + 1))
            dist.all_reduce(t, group=g)
            assert torch.equal(t, torch.full((5,), float(sum(m + 1 for m in members))))
            res[name] = dist.get_world_size(g)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n)))
    dist.destroy_process_group()
    return {"rank": me, "groups": res}


def anysource(cfg: dict) -> dict:
    """Receive from any source: ranks 1.. each send ``k`` tagged messages to rank 0 at
    once; rank 0 takes them with ``recv(t)`` / ``irecv(t)`` without a source (each
    message once, the source right, each sender's in order); then the tag: rank 1's
    message of tag 7 is there first, rank 0's receive of tag 9 must take rank 2's."""
    me, n = init(cfg)
    k = cfg.get("k", 20)
    got: list[list[int]] = []
    if me == 0:
        for i in range(k * (n - 1)):
            t = torch.full((3,), -1.0)
            if i % 2:
                src = dist.recv(t, tag=5)
            else:
                w = dist.irecv(t, tag=5)
                w.wait()
                src = w._source_rank()
            assert t[0] == t[1] == t[2], t
            got.append([src, int(t[0]) // 1000, int(t[0]) % 1000])
    else:
        works = [dist.isend(torch.full((3,), float(me * 1000 + i)), 0, tag=5)
                 for i in range(k)]
        for w in works:
            w.wait()
    if me == 1:
        dist.send(torch.full((2,), 7.0), 0, tag=7)
    dist.barrier()                      # rank 1's tag 7 went before rank 2's tag 9
    tags = {}
    if me == 2:
        dist.send(torch.full((2,), 9.0), 0, tag=9)
    if me == 0:
        for tag in (9, 7):
            t = torch.zeros(2)
            tags[tag] = [dist.recv(t, tag=tag), float(t[0])]
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": me, "got": got, "tags": tags}


def monitored(cfg: dict) -> dict:
    """rdmamw.torch.monitored_barrier: one round with every rank, then rank ``victim``
    exits; the others' monitored_barrier raises naming it within the timeout."""
    me, n = init(cfg)
    rdmamw.torch.monitored_barrier(timeout=datetime.timedelta(seconds=5))
    if me == cfg["victim"]:
        os._exit(3)
    t0 = time.monotonic()
    try:
        rdmamw.torch.monitored_barrier(timeout=datetime.timedelta(seconds=cfg["timeout"]),
                                       wait_all_ranks=True)
        err = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    if me == 0:
        time.sleep(2)       # rank 0 holds the store the others read the verdict from
    return {"rank": me, "error": err, "seconds": took}


def disagree(cfg: dict) -> dict:
    """new_group with ranks the members disagree on: rank 0 says [0, 1], the others
    [0, 1, 2]; every rank must get an error, soon (the group's timeout is 30 min)."""
    me, n = init(cfg)
    t0 = time.monotonic()
    try:
        g = dist.new_group([0, 1] if me == 0 else [0, 1, 2])
        dist.all_reduce(torch.ones(3), group=g)
        err = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    dist.barrier()                              # the default group is still whole
    return {"rank": me, "error": err, "seconds": took}


def mismatch(cfg: dict) -> dict:
    """Rank 1 calls with a different shape / dtype / op; every rank's wait() raises."""
    me, n = init(cfg)
    kind, odd = cfg["kind"], me == 1
    t = torch.ones(100)
    try:
        if kind == "shape":
            w = dist.all_reduce(torch.ones(101 if odd else 100), async_op=True)
        elif kind == "dtype":
            w = dist.all_reduce(torch.ones(100, dtype=torch.float64 if odd else torch.float32),
                                async_op=True)
        else:
            w = dist.all_reduce(t, op=R.MAX if odd else R.SUM, async_op=True)
        w.wait()
        err = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        err = f"{type(e).__name__}: {e}"
    t = torch.ones(10)
    dist.all_reduce(t)                     # the group stays usable
    dist.destroy_process_group()
    return {"rank": me, "error": err, "after": int(t[0])}


def unsupported(cfg: dict) -> dict:
    """Bad dtype / op / device: a clear error at the call, nothing sent (the next
    all_reduce pairs up on every rank)."""
    me, n = init(cfg)
    errors = []
    for call in (lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint64)),
                 lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.AVG),
                 lambda: dist.all_reduce(torch.ones(3), op=R.BXOR),
                 lambda: dist.all_reduce(torch.ones(3, device="meta")),
                 lambda: dist.broadcast(torch.ones(3, dtype=torch.uint32), src=0)):
        try:
            call()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the test reads it
            errors.append(f"{type(e).__name__}: {e}")
    t = torch.full((4,), float(me))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(sum(range(n)))))
    dist.destroy_process_group()
    return {"rank": me, "errors": errors}


def die(cfg: dict) -> dict:
    """Rank ``victim`` exits abruptly during a large all_reduce; the others time the
    error their wait() raises."""
    me, n = init(cfg)
    dist.barrier()
    pg = dist.distributed_c10d._get_default_group()
    if me == cfg["victim"]:
        comm = pg.comm
        real = comm.exchange_steps      # what every schedule's transfer goes through

        def dying(*a):
            os._exit(3)
            return real(*a)

        comm.exchange_steps = dying
    t = torch.ones(4_000_000)
    t0 = time.monotonic()
    try:
        dist.all_reduce(t, async_op=True).wait()
        return {"rank": me, "error": None}
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"rank": me, "error": f"{type(e).__name__}: {e}",
                "seconds": time.monotonic() - t0}


def size(cfg: dict) -> dict:
    """init_process_group with a world size other than the launcher's, or ranks
    missing: a clear error, timed."""
    t0 = time.monotonic()
    try:
        init(cfg)
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}


def profiled(cfg: dict) -> dict:
    """Collectives (a blocking and an asynchronous all_reduce, a broadcast, a barrier)
    and a send/recv under torch.profiler: the rdmamw spans among its events (name ->
    count) and those of its Chrome trace, and the spans in order: [name, start, end]
    (µs)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile
    rank, _ = init(cfg)
    t = torch.ones(1 << 14)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        if rank == 1:
            time.sleep(0.5)             # rank 0's asynchronous all_reduce waits for it
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        dist.broadcast(t, 0)
        dist.barrier()
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
    mine = sorted((e for e in prof.events() if e.name.startswith("rdmamw::")),
                  key=lambda e: e.time_range.start)
    names = Counter(e.name for e in mine)
    path = cfg["chrome"].replace("%r", str(rank))
    prof.export_chrome_trace(path)
    with open(path) as f:
        chrome = Counter(e["name"] for e in json.load(f)["traceEvents"]
                         if str(e.get("name", "")).startswith("rdmamw::"))
    dist.destroy_process_group()
    return {"events": dict(names), "chrome": dict(chrome), "value": float(t[0]),
            "spans": [[e.name, e.time_range.start, e.time_range.end] for e in mine]}


def main() -> None:
    torch.set_num_threads(1)     # ranks share the cores: no intra-op threads spinning
    cfg = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    out = globals()[sys.argv[1]](cfg)
    sys.stdout.write(json.dumps(out) + "\n")     # one write: ranks may share a pipe
    sys.stdout.flush()
    os._exit(0)       # (the die scenario's survivors hold a broken group)


if __name__ == "__main__":
    main()
