"""Remote memory from an event loop (rdmamw/aio/remote.py): awaited read / write /
readv / writev / batch move the same bytes as the blocking calls, raise the same typed
errors, keep the loop running while tcp waits for the owner, and a cancelled read
never writes its destination after the await is over."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

import rdmamw.aio as aio
from rdmamw.errors import AccessDenied, OutOfRange, RegionRevoked, Timeout
from tests.channel.test_remote_deadlines import FILL, N, _pattern
from tests.support.helpers import make_pair, stop_process
from tests.support.loop_ticks import LoopTicks
from tests.support.regions import WITH


@pytest.fixture(params=WITH)
def apair(request):
    a, b, lst = make_pair("batched", provider=request.param)
    yield aio.Channel(a), aio.Channel(b)
    a.close()
    b.close()
    lst.close()


def test_awaited_operations_move_the_bytes(apair):
    owner, peer = apair
    buf = _pattern()
    keep = buf.copy()
    reg = owner.expose(buf, "rw")

    async def main() -> None:
        out = np.zeros(N, np.uint8)
        h = await peer.read(reg.ref, out)
        assert h.done() and np.array_equal(out, keep)
        src = np.arange(256, dtype=np.uint8)
        await peer.write(src, bytes(reg.ref), 1000)
        keep[1000:1256] = src
        a, b = np.zeros(10, np.uint8), np.zeros(300, np.uint8)
        await peer.readv([(a, reg.ref, 0), (b, reg.ref, 990)])
        assert np.array_equal(a, keep[:10]) and np.array_equal(b, keep[990:1290])
        await peer.writev([(src[:5], reg.ref, 0), (src[5:9], reg.ref, N - 4)])
        keep[:5], keep[N - 4:] = src[:5], src[5:9]
        c = np.zeros(7, np.uint8)
        ops = peer.batch().read(reg.ref, c, 2).write(src[:3], reg.ref, 100)
        assert len(ops) == 2
        done = await ops.post(timeout=5)
        assert done.count == 2
        keep[100:103] = src[:3]
        assert np.array_equal(c, keep[2:9])
        with pytest.raises(OutOfRange):
            await peer.read(reg.ref, np.zeros(2, np.uint8), N - 1)
        with pytest.raises(AccessDenied):          # the blocking call's checks
            await peer.fetch_add(reg.ref, 0, 1)

    asyncio.run(main())
    assert np.array_equal(buf, keep)
    reg.revoke()

    async def after() -> None:
        with pytest.raises(RegionRevoked):
            await peer.read(reg.ref, np.zeros(8, np.uint8))

    asyncio.run(after())


@pytest.fixture
def stopped_tcp_owner(stoppable_owner):
    """stoppable_owner (tcp), stopped, its channel an aio one."""
    ch, ref, pid = stoppable_owner
    stop_process(pid)
    return aio.Channel(ch), ref, pid


def test_the_loop_runs_while_tcp_waits_and_a_timeout_is_raised(stopped_tcp_owner):
    ch, ref, pid = stopped_tcp_owner
    dest = np.full(N, FILL, np.uint8)

    async def main() -> tuple[int, float]:
        ticks = LoopTicks()
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            await ch.read(ref, dest, timeout=0.5)
        return ticks.stop(), time.monotonic() - t0

    ticks, took = asyncio.run(main())
    assert took < 1.0
    assert ticks >= 10                      # the loop ran during the wait
    os.kill(pid, signal.SIGCONT)
    again = np.zeros(N, np.uint8)
    asyncio.run(ch.read(ref, again, timeout=10))
    assert np.array_equal(again, _pattern())
    assert (dest == FILL).all()


def test_a_cancelled_read_is_over_when_the_await_is(stopped_tcp_owner):
    ch, ref, pid = stopped_tcp_owner
    dest = np.full(N, FILL, np.uint8)

    async def main() -> None:
        task = asyncio.create_task(ch.read(ref, dest, timeout=0.4))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        os.kill(pid, signal.SIGCONT)        # its answer comes now, and is dropped
        await asyncio.sleep(0.3)
        assert (dest == FILL).all()

    asyncio.run(main())
    again = np.zeros(N, np.uint8)
    ch.sync.read(ref, again, timeout=10)
    assert np.array_equal(again, _pattern())
    assert (dest == FILL).all()


def test_awaited_atomics_on_tcp_let_the_loop_run(stopped_tcp_owner):
    """tcp: an awaited fetch_add waits for the owner on the executor (the loop runs,
    Timeout by its timeout); once the owner runs again, the awaited atomics give the
    words' old values (the one given up was done too: the next old value says so)."""
    ch, ref, pid = stopped_tcp_owner
    first = int(_pattern()[:8].view("<u8")[0])

    async def stopped() -> int:
        ticks = LoopTicks()
        with pytest.raises(Timeout):
            await ch.fetch_add(ref, 0, 2, timeout=0.5)
        return ticks.stop()

    assert asyncio.run(stopped()) >= 10
    os.kill(pid, signal.SIGCONT)

    async def running() -> None:
        assert (await ch.fetch_add(ref, 0, 1, timeout=10)).value == (first + 2) % 2**64
        old = await ch.compare_swap(ref, 0, (first + 3) % 2**64, 5, timeout=10)
        assert old.value == (first + 3) % 2**64
        assert (await ch.fetch_add(ref, 0, 0, timeout=10)).value == 5

    asyncio.run(running())
