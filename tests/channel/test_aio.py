"""rdmamw.aio and Channel.fileno(): channels awaited from one event loop, no thread per
channel (issue 17). Every provider under test (verbs in the soft-RoCE VM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import rdmamw
import rdmamw.aio as aio
from tests.support.helpers import LISTEN_ADDRESS, make_pair, wait_for, within

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IDLE_PEER = """
import sys, time, rdmamw
ch = rdmamw.Channel.open(sys.argv[1], timeout=60)
print("ready", flush=True)
time.sleep(60)
"""


def aio_pair(provider: str, **ring):
    """(opener, acceptor, listener) as rdmamw.aio channels over make_pair's."""
    a, b, lst = make_pair(provider=provider, **ring)
    return aio.Channel(a), aio.Channel(b), lst


async def echo(ch: aio.Channel) -> int:
    """Answer every message with itself until the peer closes; how many."""
    n = 0
    async for m in ch:
        await ch.send(bytes(m))
        n += 1
    return n


def test_fileno_readable_only_when_armed_and_something_came(provider):
    a, b, lst = make_pair(provider=provider)
    try:
        # the opener's last set-up write (its max message size) may still be on its way
        # over tcp, and any word the peer writes may wake an armed fd (spurious wake-ups
        # are allowed): start once it has landed
        wait_for(lambda: b.peer_max_message_size != 0, "the peer's set-up writes")
        fd = b.fileno()
        p = select.poll()
        p.register(fd, select.POLLIN)
        assert b.arm() is False                  # nothing yet: armed
        assert p.poll(50) == []
        a.send(b"x")
        assert p.poll(5000) != []                # the peer woke us
        assert b.arm() is True                   # and there is something
        assert bytes(b.recv(timeout=0)) == b"x"
        assert b.arm() is False
        b.disarm()
        a.close()                                # the peer closing wakes an armed side
        assert b.arm() is True or p.poll(5000) != []
        assert b.arm() is True
        with pytest.raises(rdmamw.ChannelClosed):
            b.recv(timeout=0)
    finally:
        a.close()
        b.close()
        lst.close()


PONG = """
import random, sys, time, rdmamw
ch = rdmamw.Channel.open(sys.argv[1], timeout=60, spin_us=200000)
rnd, spread = random.Random(1), int(sys.argv[2])
print("ready", flush=True)
try:
    while True:
        for m in ch.recv_batch():
            end = time.perf_counter_ns() + rnd.randrange(spread)
            while time.perf_counter_ns() < end:
                pass
            ch.send(bytes(m))
except rdmamw.ChannelClosed:
    pass
"""


def test_fileno_never_misses_a_wakeup(provider):
    """A peer process answers each token at once; this side arms after a random few
    microseconds, so the answer lands before, during and after arming: every answer
    must be seen or wake the descriptor (a miss: a 2 s poll timeout)."""
    rounds, spread = (2000, 3_000) if provider == "shm" else (800, 30_000)
    rnd = random.Random(4)
    with rdmamw.listen(LISTEN_ADDRESS[provider](), spin_us=0) as lst:
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PONG), lst.address,
                              "1"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            b = lst.accept(timeout=60)
            assert p.stdout.readline().strip() == "ready"
            # calibrate: how long after a send the answer is seen (polling)
            lat = []
            for _ in range(200):
                t0 = time.perf_counter_ns()
                b.send(b"c")
                while True:
                    try:
                        b.recv(timeout=0)
                        break
                    except rdmamw.Timeout:
                        pass
                lat.append(time.perf_counter_ns() - t0)
            aim = sorted(lat)[len(lat) // 2]
            poll = select.poll()
            poll.register(b.fileno(), select.POLLIN)
            waited, stop = 0, time.monotonic() + 40     # a loaded machine: fewer rounds
            for i in range(rounds):
                if time.monotonic() > stop and i >= 200:
                    rounds = i
                    break
                # arm around the moment the answer lands (before, during, after), or
                # anywhere before it
                off = (aim + rnd.randrange(-spread, spread // 3) if i % 2 else
                       rnd.randrange(aim + 1))
                end = time.perf_counter_ns() + max(0, off)
                b.send(b"%d" % i)
                while time.perf_counter_ns() < end:
                    pass
                while not b.arm():
                    waited += 1
                    assert poll.poll(int(within(2.0) * 1000)) != [], \
                        f"round {i}: armed, answered, never woken"
                b.disarm()
                assert bytes(b.recv(timeout=0)) == b"%d" % i
            assert waited > rounds // 20        # the race was really run
            b.close()
            assert p.wait(30) == 0
        finally:
            p.kill()
            p.wait()


def test_ping_pong_and_iteration(provider):
    async def main():
        a, b, lst = aio_pair(provider)
        server = asyncio.create_task(echo(b))
        async with a:
            for i in range(300):
                await a.send_batch([b"%d" % i])
                assert [bytes(m) for m in await a.recv_batch()] == [b"%d" % i]
        assert await server == 300
        b.close()
        lst.close()
    asyncio.run(main())


def test_send_awaits_credit_through_the_descriptor(provider):
    """A ring of 4 slots, 2000 messages in batches of 1-6: the sender waits for free
    slots on the loop (sending a batch in parts) while the receiver, on the same loop,
    takes them."""
    async def main():
        a, b, lst = aio_pair(provider, slots=4, slot_size=1024)
        got: list[bytes] = []

        async def consume():
            async for m in b:
                got.append(bytes(m))
                if len(got) % 7 == 0:
                    await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        i = 0
        async with asyncio.timeout(30):
            while i < 2000:     # batches of up to 6 slot-sized messages: 4 slots take
                n = min(2000 - i, 1 + i % 6)    # part of a batch, then the rest
                await a.send_batch([b"%d" % k + b"." * 600 for k in range(i, i + n)])
                i += n
            a.close()
            await task
        assert got == [b"%d" % i + b"." * 600 for i in range(2000)]
        assert a.stats()["credit_waits"] > 0
        b.close()
        lst.close()
    asyncio.run(main())


def test_cancelled_receives_lose_nothing(provider):
    """10,000 messages; receives cancelled at random moments (task.cancel() and
    asyncio.timeout): every message still arrives exactly once, in order."""
    total = 10_000
    a, b, lst = make_pair(provider=provider, slots=16, slot_size=4096)

    taken = [0]                         # messages the receiver holds so far

    def sender() -> None:
        rnd = random.Random(2)
        i = 0
        while i < total:
            n = min(total - i, rnd.randrange(1, 10))
            a.send_batch([b"%d" % k for k in range(i, i + n)], timeout=30)
            i += n
            if rnd.random() < 0.7:      # bursts and gaps: receives wait often
                time.sleep(rnd.random() * 5e-4)
            if rnd.random() < 0.1:      # ... and some gaps a receive surely waits in,
                end = time.monotonic() + 10     # however fast or slow the host is
                while taken[0] < i and time.monotonic() < end:
                    time.sleep(1e-4)
                time.sleep(3e-3)
        a.close()                       # the receiver ends on ChannelClosed

    async def main() -> list[bytes]:
        ch = aio.Channel(b)
        rnd = random.Random(3)
        got: list[bytes] = []
        cancels = 0
        while True:
            how = rnd.random()
            if how < 0.4:
                task = asyncio.create_task(ch.recv_batch(rnd.randrange(1, 50)))
                await asyncio.sleep(rnd.random() * 2e-4)
                task.cancel()
                try:
                    got += [bytes(m) for m in await task]
                except asyncio.CancelledError:
                    cancels += 1
                except rdmamw.ChannelClosed:
                    break
            elif how < 0.7:
                try:
                    async with asyncio.timeout(rnd.random() * 2e-4):
                        msgs = await ch.recv_batch()
                    got += [bytes(m) for m in msgs]
                except TimeoutError:
                    cancels += 1
                except rdmamw.ChannelClosed:
                    break
            else:
                async for m in ch:          # leave the iteration early: nothing lost
                    got.append(bytes(m))
                    taken[0] = len(got)
                    if rnd.random() < 0.2:
                        break
                else:
                    break                   # the sender closed: all is in
            taken[0] = len(got)
        assert cancels > 100
        return got

    async def bounded() -> list[bytes]:
        async with asyncio.timeout(60):
            return await main()

    t = threading.Thread(target=sender)
    t.start()
    try:
        got = asyncio.run(bounded())
    finally:
        t.join(60)
        a.close()
        b.close()
        lst.close()
    assert got == [b"%d" % k for k in range(total)]


@contextlib.asynccontextmanager
async def idle_peer(provider: str):
    """(an accepted channel, the process at its other end): a peer that opened it,
    said it is ready and then sleeps, reading nothing; killed and reaped after."""
    lst = await aio.listen(LISTEN_ADDRESS[provider]())
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(IDLE_PEER), lst.address],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        async with asyncio.timeout(60):
            ch = await lst.accept()
        assert (await asyncio.to_thread(p.stdout.readline)).strip() == "ready"
        yield ch, p
    finally:
        p.kill()
        p.wait()
        lst.close()


def test_peer_killed_while_awaited_others_keep_working(provider):
    """A peer SIGKILLed while a coroutine awaits it: PeerLost within 2 s, while three
    other channels on the loop keep answering."""
    async def main():
        async with idle_peer(provider) as (doomed, p):
            pairs = [aio_pair(provider) for _ in range(3)]
            servers = [asyncio.create_task(echo(b)) for _, b, _ in pairs]
            rounds = [0, 0, 0]
            stop = asyncio.Event()

            async def client(k: int, ch: aio.Channel) -> None:
                while not stop.is_set():
                    await ch.send(b"%d" % rounds[k])
                    assert bytes(await ch.recv()) == b"%d" % rounds[k]
                    rounds[k] += 1

            clients = [asyncio.create_task(client(k, a)) for k, (a, _, _) in enumerate(pairs)]
            waiting = asyncio.create_task(doomed.recv_batch())
            await asyncio.sleep(0.2)
            assert not waiting.done()
            before = list(rounds)
            assert await killed_then_lost(p, waiting, within(2.0)) < within(2.0)
            await asyncio.sleep(0.2)
            assert all(r > b for r, b in zip(rounds, before, strict=True)), (before, rounds)
            stop.set()
            await asyncio.gather(*clients)
            for (a, b, lst2), s in zip(pairs, servers, strict=True):
                a.close()
                await s
                b.close()
                lst2.close()
            doomed.close()
    asyncio.run(main())


async def killed_then_lost(p, task, within: float) -> float:
    """SIGKILL ``p``, then await ``task``, which must raise PeerLost (given ``within``
    s): the seconds from the kill to it."""
    p.send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    with pytest.raises(rdmamw.PeerLost):
        async with asyncio.timeout(within):
            await task
    return time.monotonic() - t_kill


def test_a_large_send_to_a_peer_killed_before_it_read_raises_peer_lost(provider):
    """An awaited send of a message above the eager limit (the peer READs it) whose
    peer is SIGKILLed before it took it: PeerLost within 2 s of the kill, not a loop
    that spins forever (done() stayed False and the readiness said "look")."""
    async def main():
        async with idle_peer(provider) as (ch, p):
            sending = asyncio.create_task(ch.send(b"x" * (4 << 20)))
            await asyncio.sleep(0.3)
            assert not sending.done()               # the peer does not read it
            assert await killed_then_lost(p, sending, 10.0) < within(2.0)
            ch.close()
    asyncio.run(main())


def test_wrong_loop_and_closed_channel_are_clear_errors():
    a, b, lst = aio_pair("shm")

    async def first():
        await a.send(b"x")
        assert bytes(await b.recv()) == b"x"

    async def elsewhere():
        async with asyncio.timeout(5):
            await b.recv()

    loop1 = asyncio.new_event_loop()
    loop1.run_until_complete(first())        # a and b belong to loop1 while it is open
    with pytest.raises(rdmamw.errors.WrongLoop, match="another event loop"):
        asyncio.run(elsewhere())
    loop1.close()

    async def second():                       # loop1 is gone: a new loop may take them
        await a.send(b"y")
        assert bytes(await b.recv()) == b"y"
        b.close()
        with pytest.raises(rdmamw.ChannelClosed):
            await b.recv_batch()                # closed here
        with pytest.raises(rdmamw.ChannelClosed):
            await a.recv_batch()                # closed by the peer
        with pytest.raises(rdmamw.ChannelClosed):
            await aio.Channel(b.sync).recv_batch()     # closed before its first use

    asyncio.run(second())
    a.close()
    lst.close()


def test_close_from_another_loop_is_refused_and_from_plain_code_closes():
    """close() looks at the running loop through the public API: from another loop it
    raises WrongLoop (the channel stays open), outside any loop it closes."""
    a, b, lst = aio_pair("shm")

    async def first():
        await a.send(b"x")
        assert bytes(await b.recv()) == b"x"

    async def elsewhere():
        b.close()

    loop1 = asyncio.new_event_loop()
    try:
        loop1.run_until_complete(first())
        with pytest.raises(rdmamw.errors.WrongLoop, match="another event loop"):
            asyncio.run(elsewhere())
        assert not b.closed
        b.close()                               # no loop running here
        assert b.closed
    finally:
        loop1.close()
        a.close()
        lst.close()


def test_close_wakes_a_pending_receive():
    async def main():
        a, b, lst = aio_pair("shm")
        waiting = asyncio.create_task(b.recv_batch())
        await asyncio.sleep(0.05)
        b.close()
        with pytest.raises(rdmamw.ChannelClosed):
            async with asyncio.timeout(2):
                await waiting
        a.close()
        lst.close()
    asyncio.run(main())


def test_accept_waits_on_the_loop_and_is_cancellable():
    async def main():
        async with await aio.listen(LISTEN_ADDRESS["shm"]()) as lst:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await lst.accept()
            opening = asyncio.create_task(aio.Channel.open(lst.address, timeout=10))
            async with asyncio.timeout(10):
                srv = await lst.accept()
                cli = await opening
            await cli.send(b"hi")
            assert bytes(await srv.recv()) == b"hi"
            cli.close()
            srv.close()
    asyncio.run(main())


def test_one_loop_drives_100_channels():
    """100 channels, each a client and an echo server on the same loop, 20 round trips
    each, interleaved."""
    async def main():
        pairs = [aio_pair("shm", slots=8, slot_size=1024) for _ in range(100)]
        servers = [asyncio.create_task(echo(b)) for _, b, _ in pairs]

        async def client(k: int, ch: aio.Channel) -> None:
            for i in range(20):
                await ch.send_batch([b"%d:%d" % (k, i)])
                assert bytes(await ch.recv()) == b"%d:%d" % (k, i)
            ch.close()

        async with asyncio.timeout(60):
            await asyncio.gather(*(client(k, a) for k, (a, _, _) in enumerate(pairs)))
            assert await asyncio.gather(*servers) == [20] * 100
        for _, b, lst in pairs:
            b.close()
            lst.close()
    asyncio.run(main())


def test_param_server_example_serves_many_workers_on_one_loop():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "aio_param_server.py"),
                          "--workers", "6", "--rounds", "5"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["model_ok"] and res["requests"] == 6 * 5 * 4
