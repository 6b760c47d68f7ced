"""rdmamw.aio.ps.KVWorker: the parameter-server worker awaited (issue 17), against real
KVServers on threads of this process, over shm."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import rdmamw.aio.ps as aps
from rdmamw.ps import KVServer, KVWorker
from tests.support.helpers import make_pair, wait_for

KEYS = ["a", "big", 7]
SHAPES = {"a": ((10,), np.float32), "big": ((20_000,), np.float64), 7: ((3, 4), np.float32)}


class Job:
    """``servers`` KVServers serving on threads, ``workers`` x ``servers`` channel
    pairs; ``chans[w]``: worker w's channels, one per server."""

    def __init__(self, workers: int, servers: int, consistency: str) -> None:
        # 16 x 16 KiB rings: "big" (160 kB) goes in blocks
        self.pairs = {(w, s): make_pair(slots=16, slot_size=1 << 14)
                      for w in range(workers) for s in range(servers)}
        self.servers = [KVServer({w: self.pairs[w, s][1] for w in range(workers)},
                                 consistency=consistency, lr=0.25, momentum=0.5)
                        for s in range(servers)]
        self.chans = [[self.pairs[w, s][0] for s in range(servers)] for w in range(workers)]
        self.threads = [threading.Thread(target=s.serve, daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        for t in self.threads:
            t.join(10)
        for a, b, lst in self.pairs.values():
            a.close()
            b.close()
            lst.close()


def grads(w: int, it: int) -> list[np.ndarray]:
    rng = np.random.default_rng([w, it])
    return [rng.standard_normal(SHAPES[k][0]).astype(SHAPES[k][1]) for k in KEYS]


def initial(w: int) -> list[np.ndarray]:
    return [np.full(SHAPES[k][0], float(w + 1), SHAPES[k][1]) for k in KEYS]


ITERS = 6


def blocking_run(consistency: str) -> dict[int, list]:
    """Every worker on its own thread: per iteration what its pull returned."""
    job = Job(2, 2, consistency)
    got: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def one(w: int) -> None:
        try:
            kw = KVWorker(job.chans[w], timeout=30)
            kw.init(KEYS, initial(w))
            got[w].append(kw.pull_start(KEYS))
            for it in range(ITERS):
                if it % 2:
                    kw.push(KEYS, grads(w, it))
                    got[w].append(kw.pull(KEYS))
                else:
                    got[w].append(kw.push_pull(KEYS, grads(w, it)))
            kw.done()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=one, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    job.close()
    assert not errors, errors
    return got


def awaited_run(consistency: str) -> dict[int, list]:
    """Both workers on one event loop."""
    job = Job(2, 2, consistency)
    got: dict[int, list] = {0: [], 1: []}

    async def one(w: int) -> None:
        kw = aps.KVWorker(job.chans[w], timeout=30)
        await kw.init(KEYS, initial(w))
        got[w].append(await kw.pull_start(KEYS))
        for it in range(ITERS):
            if it % 2:
                await kw.push(KEYS, grads(w, it))
                got[w].append(await kw.pull(KEYS))
            else:
                got[w].append(await kw.push_pull(KEYS, grads(w, it)))
        await kw.done()

    async def both() -> None:
        await asyncio.gather(one(0), one(1))

    try:
        asyncio.run(both())
    finally:
        job.close()
    return got


def test_awaited_worker_gets_what_the_blocking_worker_gets():
    """Two workers, two servers (every key's shard), a key bigger than the rings:
    init, pull_start, push_pull, push + pull. Under BSP the servers' model after each
    round does not depend on timing, so every pull matches the blocking run's whole
    arrays."""
    want, got = blocking_run("bsp"), awaited_run("bsp")
    for w in (0, 1):
        assert len(got[w]) == len(want[w]) == ITERS + 1
        for i in range(ITERS + 1):
            for k, g, e in zip(KEYS, got[w][i], want[w][i], strict=True):
                assert g.shape == SHAPES[k][0] and g.dtype == SHAPES[k][1]
                np.testing.assert_array_equal(g, e, err_msg=f"worker {w} pull {i} key {k}")


@pytest.mark.parametrize("consistency, ahead", [("bsp", 0), ("ssp:1", 1), ("ssp:2", 2)])
def test_the_consistency_models_hold_is_awaited_while_the_loop_runs_the_other_worker(
        consistency, ahead):
    """Worker 0 runs ``ahead`` iterations (SSP's bound), then its push_pull is held by
    the server until worker 1 pushes: on one loop that only works if the hold is an
    await (a blocking wait would keep worker 1 from ever pushing). Meanwhile the loop
    ticks."""
    job = Job(2, 1, consistency)

    async def main() -> tuple[int, list]:
        w0 = aps.KVWorker(job.chans[0], timeout=30)
        w1 = aps.KVWorker(job.chans[1], timeout=30)
        for kw, w in ((w0, 0), (w1, 1)):
            await kw.init(KEYS, initial(w))
        await asyncio.gather(w0.pull_start(KEYS), w1.pull_start(KEYS))
        for it in range(ahead):
            await asyncio.wait_for(w0.push_pull(KEYS, grads(0, it)), 10)
        first = asyncio.ensure_future(w0.push_pull(KEYS, grads(0, ahead)))
        ticks = 0
        for _ in range(30):                 # 0.3 s: worker 0 stays held
            await asyncio.sleep(0.01)
            ticks += 1
        assert not first.done()
        assert job.servers[0].reads.get(0) is not None   # the server holds its read
        second = await w1.push_pull(KEYS, grads(1, 0))
        got = await asyncio.wait_for(first, 10)
        if consistency == "bsp":
            for g, s in zip(got, second, strict=True):
                np.testing.assert_array_equal(g, s)      # the same round
        await w0.done()
        await w1.done()
        return ticks, got

    try:
        ticks, _ = asyncio.run(main())
    finally:
        job.close()
    assert ticks == 30


def test_a_server_that_goes_away_fails_the_await():
    """A server closing its channel while a pull is awaited: the await raises
    (ChannelClosed / PeerLost), it does not hang."""
    import rdmamw

    job = Job(1, 1, "asp")

    async def main() -> None:
        kw = aps.KVWorker(job.chans[0], timeout=30)
        await kw.init(KEYS, initial(0))
        wait_for(lambda: job.servers[0].model, "the server's model")
        job.servers[0].chans[0].close()
        with pytest.raises((rdmamw.ChannelClosed, rdmamw.PeerLost)):
            await asyncio.wait_for(kw.pull(KEYS), 5)

    try:
        asyncio.run(main())
    finally:
        job.close()
