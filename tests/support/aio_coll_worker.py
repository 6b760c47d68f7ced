"""One rank of an rdmamw.aio.collectives test job (tests/integrations/test_aio_collectives.py):
``python aio_coll_worker.py SCENARIO [JSON]`` prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np
from coll_worker import DTYPES, data  # (run as a script: tests/ is sys.path[0])
from loop_ticks import LoopTicks

import rdmamw
import rdmamw.aio.collectives as acoll
import rdmamw.collectives as coll

OPS = ("sum", "max", "min", "prod")


async def same(cfg: dict) -> dict:
    """Every collective awaited against the blocking call on the same inputs, whole
    arrays compared bit for bit, blocking and awaited calls interleaved on one
    communicator."""
    comm = coll.default_comm()
    me, n = comm.rank, comm.size
    checks, seed = 0, 0
    for length in cfg["lengths"]:
        for dt in DTYPES:
            for alg in ("ring", "rhd", "hierarchical", "auto"):
                for op in OPS:
                    seed += 1
                    x = data(me, length, dt, seed, op)
                    want = coll.allreduce(x, op=op, algorithm=alg, comm=comm)
                    got = await acoll.allreduce(x, op=op, algorithm=alg, comm=comm)
                    np.testing.assert_array_equal(got, want, err_msg=f"{alg} {dt} {op}")
                    y = x.copy()
                    assert await acoll.allreduce(y, op=op, algorithm=alg, out=y,
                                                 comm=comm) is y
                    np.testing.assert_array_equal(y, want)
                    checks += 2
            seed += 1
            root = seed % n
            x, y = data(me, length, dt, seed), data(me, length, dt, seed)
            coll.broadcast(x, root=root, comm=comm)
            assert await acoll.broadcast(y, root=root, comm=comm) is y
            np.testing.assert_array_equal(y, x)
            x = data(me, length, dt, seed + 1)
            np.testing.assert_array_equal(await acoll.reduce_scatter(x, comm=comm),
                                          coll.reduce_scatter(x, comm=comm))
            np.testing.assert_array_equal(await acoll.allgather(x, comm=comm),
                                          coll.allgather(x, comm=comm))
            got = await acoll.reduce(x, op="max", root=root, comm=comm)
            want = coll.reduce(x, op="max", root=root, comm=comm)
            assert (got is None) == (want is None) == (me != root)
            if want is not None:
                np.testing.assert_array_equal(got, want)
            got = await acoll.gather(x, root=root, comm=comm)
            want = coll.gather(x, root=root, comm=comm)
            if want is not None:
                np.testing.assert_array_equal(got, want)
            rows = np.stack([x + r for r in range(n)]) if me == root else None
            out_a, out_b = np.empty_like(x), np.empty_like(x)
            await acoll.scatter(rows, root=root, out=out_a, comm=comm)
            coll.scatter(rows, root=root, out=out_b, comm=comm)
            np.testing.assert_array_equal(out_a, out_b)
            a2a = np.concatenate([x] * n)
            np.testing.assert_array_equal(await acoll.alltoall(a2a, comm=comm),
                                          coll.alltoall(a2a, comm=comm))
            counts = [(me + j) % 3 for j in range(n)]
            uneven = np.arange(sum(counts), dtype=dt)
            np.testing.assert_array_equal(
                await acoll.alltoall(uneven, send_counts=counts, comm=comm),
                coll.alltoall(uneven, send_counts=counts, comm=comm))
            await acoll.barrier(comm=comm)
            checks += 8
    return {"rank": me, "checks": checks}


async def overlap(cfg: dict) -> dict:
    """Rank 0 awaits an allreduce that rank 1 joins late; a task on rank 0's loop
    counts the ticks it ran meanwhile."""
    comm = coll.default_comm()
    me = comm.rank
    await acoll.barrier(comm=comm)          # channels open, everyone here
    x = np.arange(cfg["length"], dtype=np.float64) + me
    if me == 1:
        await asyncio.sleep(cfg["late"])
    ticker = LoopTicks()
    t0 = time.monotonic()
    got = await acoll.allreduce(x, algorithm=cfg["alg"], comm=comm)
    waited = time.monotonic() - t0
    ticks = ticker.stop()
    np.testing.assert_array_equal(got, coll.allreduce(x, algorithm=cfg["alg"], comm=comm))
    return {"rank": me, "ticks": ticks, "waited": waited}


async def cancel(cfg: dict) -> dict:
    """Rank 0 cancels its allreduce (``asyncio.timeout``) while rank 1 has not come;
    rank 0's communicator is then closed, and rank 1's call raises instead of hanging."""
    comm = coll.default_comm()
    me = comm.rank
    await acoll.barrier(comm=comm)
    x = np.ones(cfg["length"], np.float32)
    if me == 1:
        await asyncio.sleep(cfg["late"])
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(cfg["late"] / 2 if me == 0 else 30):
            if cfg["blocking_peer"] and me == 1:
                coll.allreduce(x, comm=comm)
            else:
                await acoll.allreduce(x, comm=comm)
        return {"rank": me, "error": None}
    except TimeoutError:
        error = "cancelled"
    except rdmamw.PeerLost:
        error = "PeerLost"
    except coll.CollectiveMismatch:
        error = "CollectiveMismatch"
    out = {"rank": me, "error": error, "seconds": time.monotonic() - t0,
           "broken": comm.broken is not None}
    try:
        await acoll.barrier(comm=comm)
        out["after"] = "ok"
    except rdmamw.RdmamwError as e:
        out["after"] = type(e).__name__
    await asyncio.sleep(cfg["late"])        # rank 0 stays alive until rank 1 is done
    return out


async def die(cfg: dict) -> dict:
    """Rank ``victim`` exits abruptly at its ``at``-th transfer of an awaited allreduce,
    writing the time (CLOCK_MONOTONIC, one clock for every process of the host) to
    ``cfg["stamp"]`` first; the others report when their PeerLost came."""
    comm = coll.default_comm()
    me = comm.rank
    await acoll.barrier(comm=comm)
    x = np.ones(cfg["length"], np.float32)
    if me == cfg["victim"]:
        for name in ("exchange_steps", "relay_steps"):
            setattr(comm, name, _dying(getattr(comm, name), cfg["at"], cfg["stamp"]))
    try:
        await acoll.allreduce(x, algorithm=cfg["alg"], comm=comm)
        return {"rank": me, "error": None}
    except rdmamw.PeerLost as e:
        return {"rank": me, "error": "PeerLost", "msg": str(e), "at": time.monotonic()}


_calls = [0]


def _dying(fn, at: int, stamp: str):
    """``fn`` that stamps the time and kills the process on the ``at``-th transfer
    (counted over every wrapped function)."""

    def wrapped(*args):
        _calls[0] += 1
        if _calls[0] >= at:
            with open(stamp, "w") as f:
                f.write(repr(time.monotonic()))
            os._exit(3)
        return fn(*args)

    return wrapped


def main() -> None:
    scenario = sys.argv[1]
    cfg = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    rdmamw.init()
    comm = coll.default_comm()
    out = asyncio.run(globals()[scenario](cfg))
    print(json.dumps(out), flush=True)
    comm.close()
    rdmamw.finalize()


if __name__ == "__main__":
    main()
