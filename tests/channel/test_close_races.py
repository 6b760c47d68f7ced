"""A close from any thread at any moment (docs/protocol.md, "Closing"): every buffer is
released once, a message cut short by a close is never delivered, a wait ends on the
close, and what arrived before a close is still delivered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import rdmamw
from rdmamw.errors import ChannelClosed, MessageLost, Timeout
from tests.support.helpers import LISTEN_ADDRESS, make_pair, provider_param, within

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST_PROVIDERS = ["shm", "tcp"]
ALL_PROVIDERS = ["shm", "tcp", provider_param("verbs")]


def _in_thread(fn, *args):
    """Run fn(*args) on a thread; the returned dict gets "ok" (its result) or "err"."""
    out: dict = {}

    def run() -> None:
        try:
            out["ok"] = fn(*args)
        except BaseException as e:      # noqa: BLE001 - handed to the test
            out["err"] = e
        out["t"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_a_close_during_a_rendezvous_send_releases_each_source_once(provider):
    """A sender out of slots waits with rendezvous sources prepared; another thread
    closes. Each source's buffer is released once: the array's refcount comes back to
    what the test holds (a double release drops it below and frees a live array)."""
    a, b, lst = make_pair(provider=provider, rendezvous="read")
    msg = np.ones(1 << 20, np.uint8)
    base = sys.getrefcount(msg)

    def send_until_closed() -> None:
        for _ in range(200):
            a.send(msg, timeout=20)

    got = _in_thread(send_until_closed)
    deadline = time.monotonic() + 10
    while a.stats()["free_send_slots"] and time.monotonic() < deadline:
        time.sleep(0.01)       # until the ring is full and the sender waits
    time.sleep(0.2)
    assert sys.getrefcount(msg) > base      # the channel holds sources
    t0 = time.monotonic()
    a.close()
    got["thread"].join(10)
    assert isinstance(got.get("err"), ChannelClosed), got
    assert "this side closed" in str(got["err"])
    assert got["t"] - t0 < within(3.0)
    assert sys.getrefcount(msg) == base
    b.close()
    lst.close()


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_a_close_ends_a_receive_waiting_for_a_message(provider):
    a, b, lst = make_pair(provider=provider)
    got = _in_thread(b.recv)
    time.sleep(0.3)
    t0 = time.monotonic()
    b.close()
    got["thread"].join(5)
    assert isinstance(got.get("err"), ChannelClosed), got
    assert "this side closed" in str(got["err"])
    assert got["t"] - t0 < within(1.0)
    a.close()
    lst.close()


def _stopped_sender(provider: str, size: int):
    """(our channel, the peer process, listener): the peer sent one message of
    ``size`` bytes and is stopped, so nothing of it answers a READ."""
    lst = rdmamw.listen(LISTEN_ADDRESS[provider](), rendezvous="read")
    peer = subprocess.Popen([sys.executable, "-m", "tests.support.close_race_peer", lst.address,
                             str(size)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    ch = lst.accept(timeout=20)
    assert peer.stdout.readline().strip() == "sent"
    os.kill(peer.pid, signal.SIGSTOP)
    _wait_stopped(peer.pid)
    return ch, peer, lst


def _wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (a signal takes effect later)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.add(f.read().rpartition(")")[2].split()[0])
        if states == {"T"}:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


@pytest.mark.parametrize("into", [False, True], ids=["recv", "recv_into"])
def test_a_close_during_a_rendezvous_read_never_delivers_the_message(into):
    """tcp: the peer's process is stopped, so our READ of its 1 MiB message waits; a
    close from another thread ends the receive with ChannelClosed naming this side,
    and the destination is never returned as the message (it was 1 MiB of zeros)."""
    ch, peer, lst = _stopped_sender("tcp", 1 << 20)
    try:
        buf = bytearray(1 << 20)
        got = _in_thread((lambda: ch.recv_into(buf)) if into else ch.recv)
        time.sleep(0.5)
        assert "thread" in got and "ok" not in got and "err" not in got, got
        t0 = time.monotonic()
        ch.close()
        got["thread"].join(10)
        assert "ok" not in got, f"a message came out of a cut READ: {got['ok']!r:.60}"
        assert isinstance(got.get("err"), ChannelClosed), got
        assert "this side closed" in str(got["err"])
        assert got["t"] - t0 < within(3.0)
    finally:
        peer.kill()
        peer.wait()
        lst.close()


@pytest.mark.parametrize("provider", ALL_PROVIDERS)
def test_what_arrived_after_a_lost_message_is_still_delivered(provider):
    """The sender sends A, B (1 MiB, rendezvous), C, D and closes while the receiver is
    busy past close()'s wait for B's READ: B is lost (MessageLost, once), then C and D
    come, then ChannelClosed — not PeerLost, and not B's error forever."""
    a, b, lst = make_pair(provider=provider, rendezvous="read")
    big = bytes([9]) * (1 << 20)
    a.send_batch([b"A", big, b"C", b"D"], timeout=10)
    closer = _in_thread(a.close)
    closer["thread"].join(20)           # close() gives B's READ 5 s, then gives it back
    assert "err" not in closer, closer
    assert b.recv(timeout=5).tobytes() == b"A"
    with pytest.raises(MessageLost, match="peer closed the channel before rendezvous"):
        b.recv(timeout=5)
    assert [m.tobytes() for m in b.recv_batch(timeout=5)] == [b"C", b"D"]
    with pytest.raises(ChannelClosed, match="the peer closed"):
        b.recv(timeout=5)
    b.close()
    lst.close()


@pytest.mark.parametrize("provider", HOST_PROVIDERS)
def test_an_aio_close_with_a_large_message_unread_does_not_block_the_loop(provider):
    """rdmamw.aio: close() while the peer has not read our 1 MiB message returns at
    once (it blocked the loop 5 s); the loop keeps running, and the peer still gets
    the whole message afterwards (the close's wait for its READ runs on a thread)."""
    import rdmamw.aio as aio
    a, b, lst = make_pair(provider=provider, rendezvous="read")
    big = bytes(range(256)) * 4096

    async def main() -> float:
        ch = aio.Channel(a)
        a.send(big)             # posted; done only once the peer has read it
        t0 = time.monotonic()
        ch.close()
        took = time.monotonic() - t0
        ticks = 0
        t1 = time.monotonic()
        while time.monotonic() - t1 < 0.3:
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks >= 10
        return took

    import asyncio
    took = asyncio.run(main())
    assert took < 0.5, f"aio close blocked the loop {took:.2f} s"
    assert a.closed
    assert b.recv(timeout=10).tobytes() == big
    with pytest.raises(ChannelClosed, match="the peer closed"):
        b.recv(timeout=10)
    b.close()
    lst.close()


def _stress(provider: str, rounds: int, seconds: float) -> str:
    """tests/soak/close_race.py in a child pinned to one CPU, under CPython's debug
    allocator (a buffer released twice frees a live object, whose memory it fills:
    the child crashes, exit status -11); its summary line. The child starts no round
    after ``seconds`` (a slow machine runs fewer), and a child still running long
    after that prints every thread's stack and exits: a hang fails with where it is,
    before the test's own timeout."""
    try:
        r = subprocess.run([sys.executable, "-m", "tests.soak.close_race", "--provider",
                            provider, "--rounds", str(rounds), "--cpu", "0", "--seconds",
                            str(seconds), "--watchdog", str(seconds + 60)], cwd=ROOT,
                           capture_output=True, text=True, timeout=seconds + 90,
                           env={**os.environ, "PYTHONPATH": ROOT, "PYTHONMALLOC": "debug"})
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                    for x in (e.stdout, e.stderr))
        pytest.fail(f"the stress still ran after {e.timeout:.0f} s\n{out[-3000:]}\n"
                    f"{err[-6000:]}")
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("provider,rounds", [("shm", 150), ("tcp", 150),
                                             provider_param("verbs", "20")])
def test_the_close_race_stress_finds_nothing(provider, rounds):
    print(_stress(provider, int(rounds), 240))


@pytest.mark.slow
@pytest.mark.timeout(3800)
@pytest.mark.parametrize("provider,rounds", [("shm", 10000), ("tcp", 10000),
                                             provider_param("verbs", "1000")])
def test_the_long_close_race_stress_finds_nothing(provider, rounds):
    print(_stress(provider, int(rounds), 3600))


@pytest.mark.parametrize("provider", HOST_PROVIDERS)
def test_a_call_waiting_for_another_thread_s_call_keeps_its_deadline(provider):
    """A send with a timeout, while another thread's send holds the channel (out of
    slots, no timeout), returns Timeout by its deadline (it waited on the lock for
    ever); a close ends the other one."""
    a, b, lst = make_pair(provider=provider, slots=4, slot_size=4096)
    blocker = _in_thread(lambda: [a.send(b"x" * 3000) for _ in range(64)])
    deadline = time.monotonic() + 10
    while a.stats()["free_send_slots"] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(Timeout, match="another thread's send"):
        a.send(b"y", timeout=0.5)
    assert time.monotonic() - t0 < 1.0
    a.close()
    blocker["thread"].join(5)
    assert isinstance(blocker.get("err"), ChannelClosed), blocker
    b.close()
    lst.close()
