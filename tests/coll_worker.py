"""One rank of a collectives test job (started by tests/test_collectives.py through
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
    return {"rank": me, "checks": checks, "groups": coll.default_comm().groups()}


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
        comm.exchange = _dying(comm.exchange, cfg["at"])
        comm.relay = _dying(comm.relay, cfg["at"])
    t0 = time.monotonic()
    try:
        coll.allreduce(x, algorithm=cfg["alg"])
        return {"rank": me, "error": None}
    except rdmamw.PeerLost as e:
        return {"rank": me, "error": "PeerLost", "msg": str(e),
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
    groups = comm.groups()
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
    choice = coll.policy.choose(x.nbytes, comm.groups(), comm.model)
    comm.close()
    return {"rank": comm.rank, "groups": comm.groups(), "best": best, "auto": choice}


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
