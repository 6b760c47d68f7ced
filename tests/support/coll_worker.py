"""One rank of a collectives test job (started by tests/integrations/test_collectives.py through
rdmamw.bootstrap.launch). ``python coll_worker.py SCENARIO [JSON]`` prints one
JSON line; every rank checks its own results against numpy on all ranks' inputs,
which each rank regenerates from the same seeds."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

import rdmamw
import rdmamw.collectives as coll

DTYPES = ("float32", "float64", "int32", "int64")
OPS = ("sum", "max", "min", "prod")
NUMPY = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def data(rank: int, n: int, dtype: str, seed: int, op: str = "sum") -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    if op == "prod":       # values near 1 keep products finite and exact enough
        vals = rng.choice([1, 1, 1, 2, -1], size=n)
    else:
        vals = rng.integers(-1000, 1000, size=n)
    return vals.astype(dtype)


def expect(world: int, n: int, dtype: str, seed: int, op: str) -> np.ndarray:
    arrs = [data(r, n, dtype, seed, op) for r in range(world)]
    return NUMPY[op].reduce(np.stack(arrs), axis=0)


def matrix(cfg: dict) -> dict:
    """Every algorithm x dtype x op x length against numpy, plus the other collectives.
    Returns how many results it compared and the groups hierarchical used (from
    RDMAMW_COLL_TOPOLOGY when the test sets labels, so the leaders' step runs)."""
    w = rdmamw.init()
    n, me, checks = w.world_size, w.rank, 0
    seed = 0
    for alg in ("ring", "rhd", "hierarchical", "auto"):
        for length in cfg["lengths"]:
            for dt in DTYPES:
                for op in OPS:
                    seed += 1
                    x = data(me, length, dt, seed, op)
                    want = expect(n, length, dt, seed, op)
                    inplace = seed % 2 == 0
                    got = coll.allreduce(x, op=op, algorithm=alg,
                                         out=x if inplace else None)
                    assert (got is x) == inplace
                    np.testing.assert_array_equal(got, want, err_msg=f"{alg} {dt} {op} {length}")
                    checks += 1
    for length in cfg["lengths"]:
        for dt in DTYPES:
            seed += 1
            root = seed % n
            x = data(me, length, dt, seed)
            coll.broadcast(x, root=root)
            np.testing.assert_array_equal(x, data(root, length, dt, seed))
            seed += 1
            x = data(me, length, dt, seed)
            part = coll.reduce_scatter(x)
            full = expect(n, length, dt, seed, "sum")
            np.testing.assert_array_equal(
                part.reshape(-1), full[me * length // n:(me + 1) * length // n])
            seed += 1
            x = data(me, length, dt, seed).reshape(1, -1)
            g = coll.allgather(x)
            assert g.shape == (n, 1, length)
            for r in range(n):
                np.testing.assert_array_equal(g[r, 0], data(r, length, dt, seed))
            checks += 3
    # 2-d arrays keep their shape; reduce_scatter splits the first axis when it can
    m = np.arange(n * 3 * 2, dtype=np.float64).reshape(n * 3, 2) + me
    s = coll.reduce_scatter(m)
    assert s.shape == (3, 2)
    full = sum(np.arange(n * 3 * 2, dtype=np.float64).reshape(n * 3, 2) + r for r in range(n))
    np.testing.assert_array_equal(s, full[me * 3:(me + 1) * 3])
    np.testing.assert_array_equal(coll.allreduce(m, algorithm="ring"), full)
    coll.barrier()
    # back-to-back collectives of different kinds with no barrier: a fast rank's next
    # messages must not mix with a slow rank's current ones
    for k in range(20):
        if me == k % n:
            time.sleep(0.002)
        v = coll.allreduce(np.full(1000 + k, me, np.int64), algorithm=("ring", "rhd")[k % 2])
        assert (v == n * (n - 1) // 2).all()
        b = coll.broadcast(np.full(7, me if me == k % n else -1, np.int32), root=k % n)
        assert (b == k % n).all()
    return {"rank": me, "checks": checks, "groups": coll.groups()}


ALL_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
              "uint8", "uint16", "uint32", "uint64", "bool")
ALL_OPS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def values(rank: int, shape: tuple, dtype: str, seed: int, op: str = "sum") -> np.ndarray:
    """Small values every dtype holds exactly, and whose reductions stay exact."""
    rng = np.random.default_rng([seed, rank])
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if op == "prod":
        return rng.choice([1, 1, 1, 2], size=shape).astype(dtype)
    lo = -3 if np.dtype(dtype).kind in "fi" else 0
    return rng.integers(lo, 4, size=shape).astype(dtype)


def chunked(cfg: dict) -> dict:
    """Every dtype through transfers of many chunks (RDMAMW_COLL_CHUNK is small and not
    a multiple of any item size in the test) of odd lengths: allreduce (every
    algorithm, in and out of place), allgather, broadcast, reduce_scatter, against
    numpy. Also counts the rendezvous destinations the channels had to allocate
    during the copy-only collectives (allgather, broadcast): 0 when every chunk was
    received straight into the result."""
    from rdmamw.memory import pool as rpool
    w = rdmamw.init()
    comm = coll.default_comm()
    n, me, checks, seed = w.world_size, w.rank, 0, 500
    allocated = 0
    for dt in ALL_DTYPES:
        for length in cfg["lengths"]:
            op = "bor" if dt == "bool" else "sum"
            want = ALL_OPS[op].reduce(np.stack([values(r, (length,), dt, seed)
                                                for r in range(n)]), axis=0)
            for alg in ("ring", "rhd", "hierarchical"):
                x = values(me, (length,), dt, seed)
                got = coll.allreduce(x, op=op, algorithm=alg, out=x if alg == "rhd" else None)
                np.testing.assert_array_equal(got, want, err_msg=f"{alg} {dt} {length}")
                checks += 1
            before = rpool.default_pool().stats()["acquires"]
            g = coll.allgather(values(me, (length,), dt, seed))
            for r in range(n):
                np.testing.assert_array_equal(g[r], values(r, (length,), dt, seed))
            b = values(me, (length,), dt, seed)
            coll.broadcast(b, root=n - 1)
            np.testing.assert_array_equal(b, values(n - 1, (length,), dt, seed))
            allocated += rpool.default_pool().stats()["acquires"] - before
            part = coll.reduce_scatter(values(me, (length,), dt, seed), op=op)
            np.testing.assert_array_equal(
                part, want[me * length // n:(me + 1) * length // n])
            checks += 3
            seed += 1
    rndv = sum(ch.stats()["rndv_reads"] for ch in comm._chans.values())
    return {"rank": me, "checks": checks, "allocated": allocated, "rndv_reads": rndv}


def rooted(cfg: dict) -> dict:
    """alltoall (even and uneven, counts given or learnt), gather, scatter, reduce
    (every op the dtype allows) for every dtype, blocking and async_op, against numpy
    on all ranks' inputs; results not given an ``out`` come from the results pool."""
    w = rdmamw.init()
    n, me, checks, seed = w.world_size, w.rank, 0, 100
    for dt in ALL_DTYPES:
        for length in cfg["lengths"]:
            for asy in (False, True):
                seed += 1

                def done(x, asy=asy):
                    return x.wait() if asy else x

                # even alltoall: rows [j*m, (j+1)*m) to rank j, 2-d rows
                m = max(1, length // n)
                mine = values(me, (n * m, 3), dt, seed)
                got = done(coll.alltoall(mine, async_op=asy))
                want = np.concatenate([values(r, (n * m, 3), dt, seed)[me * m:(me + 1) * m]
                                       for r in range(n)])
                np.testing.assert_array_equal(got, want, err_msg=f"alltoall {dt}")
                # uneven: rank r sends (r + j + length) % 4 rows to rank j
                sc = [(me + j + length) % 4 for j in range(n)]
                rc = [(r + me + length) % 4 for r in range(n)]
                x = values(me, (sum(sc),), dt, seed + 1)
                for given in (None, rc):
                    got = done(coll.alltoall(x, sc, given, async_op=asy))
                    parts = []
                    for r in range(n):
                        xr = values(r, (sum((r + j + length) % 4 for j in range(n)),), dt,
                                    seed + 1)
                        off = sum((r + j + length) % 4 for j in range(me))
                        parts.append(xr[off:off + rc[r]])
                    np.testing.assert_array_equal(got, np.concatenate(parts),
                                                  err_msg=f"uneven alltoall {dt}")
                    checks += 1
                root = seed % n
                # gather
                g = done(coll.gather(values(me, (length,), dt, seed), root=root,
                                     async_op=asy))
                if me == root:
                    np.testing.assert_array_equal(
                        g, np.stack([values(r, (length,), dt, seed) for r in range(n)]))
                else:
                    assert g is None
                # scatter
                parts = values(root, (n, length, 2), dt, seed)
                s = done(coll.scatter(parts if me == root else None, root=root,
                                      out=None if me == root else np.empty((length, 2), dt),
                                      async_op=asy))
                np.testing.assert_array_equal(s, parts[me], err_msg=f"scatter {dt}")
                # reduce: every op this dtype allows
                for op, uf in ALL_OPS.items():
                    if op in ("band", "bor", "bxor") and np.dtype(dt).kind not in "iub":
                        continue
                    seed += 1
                    r_ = done(coll.reduce(values(me, (length,), dt, seed, op), op=op,
                                          root=root, async_op=asy))
                    if me == root:
                        want = uf.reduce(np.stack([values(r, (length,), dt, seed, op)
                                                   for r in range(n)]), axis=0, dtype=dt)
                        np.testing.assert_array_equal(r_, want, err_msg=f"reduce {dt} {op}")
                    else:
                        assert r_ is None
                    checks += 1
                checks += 3
    # several async collectives in flight at once complete in call order
    hs = [coll.allreduce(np.full(1000, me + k, np.int64), async_op=True) for k in range(5)]
    b = coll.broadcast(np.full(10, me, np.int32), root=n - 1)          # queues behind them
    assert (b == n - 1).all()
    for k, h in enumerate(hs):
        assert (h.wait(timeout=30) == sum(r + k for r in range(n))).all()
    # out-of-place results are recycled pool memory, not fresh pages
    from rdmamw.collectives import results
    before = results.pool().stats()
    for _ in range(6):
        coll.allreduce(np.ones(300_000, np.float32))
    after = results.pool().stats()
    return {"rank": me, "checks": checks,
            "pool_allocations": after["allocations"] - before["allocations"],
            "pool_reuses": after["reuses"] - before["reuses"]}


def big(cfg: dict) -> dict:
    """Arrays of many chunks (pipelining, windows, more than a ring of data)."""
    rdmamw.init()
    comm = coll.default_comm()
    me, n = comm.rank, comm.size
    length = cfg["length"]
    for alg in ("ring", "rhd", "hierarchical"):
        x = np.full(length, me + 1, np.float32)
        x[::97] = 0.5 * me
        want = np.full(length, n * (n + 1) / 2, np.float32)
        want[::97] = 0.5 * n * (n - 1) / 2
        got = coll.allreduce(x, algorithm=alg, out=x)
        np.testing.assert_array_equal(got, want)
    x = np.arange(length, dtype=np.float64) * (me == 1)
    coll.broadcast(x, root=1 % n)
    np.testing.assert_array_equal(x, np.arange(length, dtype=np.float64) * (n > 1))
    return {"rank": me, "ok": True}


def reuse(cfg: dict) -> dict:
    """Each rank overwrites its result (and input) the moment the call returns, while
    rank 1 takes its chunks slowly: rank 1's result must not see rank 0's overwrite
    (a rendezvous chunk is read from the sender's memory after the sender moved on)."""
    rdmamw.init()
    comm = coll.default_comm()
    me, n = comm.rank, comm.size
    if me == 1:
        take = comm._take

        def slow(*args):
            time.sleep(cfg["delay"])
            return take(*args)

        comm._take = slow
    length, checks = cfg["length"], 0
    for alg in ("ring", "rhd", "hierarchical"):
        for inplace in (False, True):
            x = np.full(length, me + 1, np.float32)
            x[::101] = -me
            want = np.full(length, n * (n + 1) / 2, np.float32)
            want[::101] = -n * (n - 1) / 2
            got = coll.allreduce(x, algorithm=alg, out=x if inplace else None)
            kept = got.copy()
            got[:] = np.nan
            x[:] = np.nan
            np.testing.assert_array_equal(kept, want, err_msg=f"{alg} inplace={inplace}")
            checks += 1
            coll.barrier()
    for kind in ("allgather", "broadcast", "reduce_scatter"):
        x = np.full(length, me + 1, np.float32)
        if kind == "allgather":
            got = coll.allgather(x)
            want = np.repeat(np.arange(1, n + 1, dtype=np.float32)[:, None], length, 1)
        elif kind == "broadcast":
            got = coll.broadcast(x, root=0)
            want = np.full(length, 1, np.float32)
        else:
            got = coll.reduce_scatter(x)
            b = [k * length // n for k in range(n + 1)]
            want = np.full(b[me + 1] - b[me], n * (n + 1) / 2, np.float32)
        kept = got.copy()
        got[...] = np.nan
        x[:] = np.nan
        np.testing.assert_array_equal(kept, want, err_msg=kind)
        checks += 1
        coll.barrier()
    return {"rank": me, "checks": checks}


def mismatch(cfg: dict) -> dict:
    """Rank ``cfg["odd"]`` calls with a different shape / dtype / op / collective."""
    rdmamw.init()
    comm = coll.default_comm()
    me = comm.rank
    kind = cfg["kind"]
    odd = me == cfg["odd"]
    x = np.ones(100, np.float32)
    try:
        if kind == "shape":
            coll.allreduce(np.ones(101 if odd else 100, np.float32), algorithm=cfg["alg"])
        elif kind == "dtype":
            coll.allreduce(np.ones(100, np.float64 if odd else np.float32), algorithm=cfg["alg"])
        elif kind == "op":
            coll.allreduce(x, op="max" if odd else "sum", algorithm=cfg["alg"])
        elif kind == "call":
            coll.broadcast(x) if odd else coll.allreduce(x, algorithm=cfg["alg"])
        elif kind == "alltoall":
            coll.alltoall(np.ones(6 if odd else 3 * comm.size, np.float32), async_op=True
                          ).wait()
        elif kind == "gather":
            coll.gather(np.ones(5, np.int64 if odd else np.int32), root=0)
        elif kind == "scatter":
            out = np.empty(4 if odd else 3, np.float32)
            coll.scatter(np.ones((comm.size, 3), np.float32) if me == 0 else None, root=0,
                         out=None if me == 0 else out)
        elif kind == "reduce":
            coll.reduce(x, op="min" if odd else "sum", root=1, async_op=True).wait()
        elif kind == "counts":          # the odd rank expects a row more from rank 0
            n = comm.size
            rc = [2] * n
            if odd:
                rc[0] = 3
            coll.alltoall(np.ones(2 * n, np.float32), [2] * n, rc)
        err = None
    except coll.CollectiveMismatch as e:
        err = str(e)
    # the communicator stays usable afterwards
    ok = coll.allreduce(np.ones(10, np.int32), algorithm=cfg["alg"])
    return {"rank": me, "error": err, "after": int(ok[0])}


def die(cfg: dict) -> dict:
    """Rank ``cfg["victim"]`` exits abruptly (no clean close) when it starts its
    ``cfg["at"]``-th transfer of the allreduce; the others time their PeerLost."""
    rdmamw.init()
    comm = coll.default_comm()
    me = comm.rank
    coll.barrier()
    x = np.ones(cfg["length"], np.float32)
    if me == cfg["victim"]:
        comm.exchange_steps = _dying(comm.exchange_steps, cfg["at"])
        comm.relay_steps = _dying(comm.relay_steps, cfg["at"])
    t0 = time.monotonic()
    try:
        coll.allreduce(x, algorithm=cfg["alg"])
        return {"rank": me, "error": None}
    except rdmamw.PeerLost as e:
        return {"rank": me, "error": "PeerLost", "msg": str(e), "named": e.rank,
                "seconds": time.monotonic() - t0}


_calls = [0]


def _dying(fn, at: int):
    """``fn`` that kills the process on the ``at``-th transfer (counted over both)."""

    def wrapped(*args):
        _calls[0] += 1
        if _calls[0] >= at:
            os._exit(3)
        return fn(*args)

    return wrapped


def topo(cfg: dict) -> dict:
    """Groups from labels / probe; hierarchical and auto on them."""
    rdmamw.init()
    comm = coll.Communicator(topology=cfg["topology"])
    me, n = comm.rank, comm.size
    groups = coll.groups(comm)
    x = np.full(5000, me, np.int64)
    got = coll.allreduce(x, algorithm="hierarchical", comm=comm)
    assert (got == n * (n - 1) // 2).all()
    return {"rank": me, "groups": groups}


def race(cfg: dict) -> dict:
    """Best-of-k seconds of ring and hierarchical (groups from ``cfg["topology"]``)."""
    rdmamw.init()
    comm = coll.Communicator(topology=cfg["topology"])
    n = comm.size
    x = np.ones(cfg["length"], np.float32)
    best = {}
    for alg in ("ring", "rhd", "hierarchical"):
        ts = []
        for _ in range(cfg["reps"]):
            coll.barrier(comm=comm)
            t0 = time.perf_counter()
            got = coll.allreduce(x, algorithm=alg, comm=comm)
            ts.append(time.perf_counter() - t0)
            assert (got == n).all()
        best[alg] = min(ts)
    choice = coll.policy.choose(x.nbytes, coll.groups(comm), comm.model)
    comm.close()
    return {"rank": comm.rank, "groups": coll.groups(comm), "best": best, "auto": choice}


def digests(cfg: dict) -> dict:
    """sha256 of each algorithm's allreduce of the same random float32 inputs (the
    sums' rounding depends on the order: two providers must give identical bytes), and
    what each of the job's channels ran on and carried."""
    w = rdmamw.init()
    out: dict = {"rank": w.rank, "digests": {}}
    for alg in ("ring", "rhd", "hierarchical"):
        x = np.random.default_rng([7, w.rank]).standard_normal(cfg["length"]).astype(np.float32)
        out["digests"][alg] = hashlib.sha256(coll.allreduce(x, algorithm=alg).tobytes()).hexdigest()
    out["channels"] = channels()
    return out


def stack(cfg: dict) -> dict:
    """A short pass over every collective (the VM is slow): each allreduce algorithm on
    int64 (exact against numpy) and on float32 (its digest, to compare providers),
    broadcast, allgather, reduce_scatter and barrier."""
    w = rdmamw.init()
    n, me, length = w.world_size, w.rank, cfg["length"]
    checks = 0
    for alg in ("ring", "rhd", "hierarchical", "auto"):
        got = coll.allreduce(data(me, length, "int64", 1), algorithm=alg)
        np.testing.assert_array_equal(got, expect(n, length, "int64", 1, "sum"), err_msg=alg)
        checks += 1
    x = data(me, length, "float64", 2)
    coll.broadcast(x, root=n - 1)
    np.testing.assert_array_equal(x, data(n - 1, length, "float64", 2))
    g = coll.allgather(data(me, length, "int32", 3))
    for r in range(n):
        np.testing.assert_array_equal(g[r], data(r, length, "int32", 3))
    part = coll.reduce_scatter(data(me, n * 5, "int64", 4))
    np.testing.assert_array_equal(part, expect(n, n * 5, "int64", 4, "sum")[me * 5:(me + 1) * 5])
    coll.barrier()
    out = digests(cfg)
    out["checks"] = checks + 3
    return out


def channels() -> dict:
    """Provider and counters of each channel of the default communicator."""
    out = {}
    for p, ch in coll.default_comm()._chans.items():
        st = ch.stats()
        out[p] = {k: st[k] for k in ("provider", "bytes", "bytes_received", "bytes_written",
                                      "batches", "doorbells")}
    return out


def main() -> None:
    scenario = sys.argv[1]
    cfg = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    out = globals()[scenario](cfg)
    print(json.dumps(out), flush=True)
    coll.default_comm().close()
    rdmamw.finalize()


if __name__ == "__main__":
    main()
