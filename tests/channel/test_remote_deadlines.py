"""Deadlines of one-sided operations (docs/remote-memory.md, "Deadlines"): a read or a
write to an owner that stopped (SIGSTOP: its process is frozen, its host still
acknowledges) raises Timeout by its ``timeout``, not at the provider's peer bound; the
destination of a read given up is never written after the call returned, even when
the owner wakes and its answer comes; the channel then serves the next read. On
verbs the owner's device serves a stopped owner; a deadline that passes during a
long transfer stops the device (the connection is lost) before the Timeout."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from rdmamw.errors import PeerLost, Timeout
from tests.support.helpers import LISTEN_ADDRESS, stop_process, within
from tests.support.regions import OWNER_BYTES, OWNER_SEED, VERBS, pattern

N = OWNER_BYTES
FILL = 0x5A


def _pattern() -> np.ndarray:
    return pattern(N, OWNER_SEED)


def _timed_out(call) -> float:
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        call()
    return time.monotonic() - t0


@pytest.mark.parametrize("size", [64, N])
def test_a_read_from_a_stopped_owner_times_out_and_its_answer_is_dropped(
        stoppable_owner, size):
    ch, ref, pid = stoppable_owner
    out = np.zeros(N, np.uint8)
    ch.read(ref, out)                               # the owner serves: the harness works
    assert np.array_equal(out, _pattern())
    dest = np.full(size, FILL, np.uint8)
    stop_process(pid)
    try:
        assert _timed_out(lambda: ch.read(ref, dest, timeout=0.5)) < 1.0
        assert (dest == FILL).all()
    finally:
        os.kill(pid, signal.SIGCONT)
    # the owner answers the abandoned read first (the stream's order): once the next
    # read is back, that answer came and was dropped
    again = np.zeros(N, np.uint8)
    ch.read(ref, again, timeout=10)
    assert np.array_equal(again, _pattern())
    assert (dest == FILL).all()                     # never written after the Timeout
    ch.send(b"still usable")


def test_a_batch_and_a_write_time_out_too(stoppable_owner):
    ch, ref, pid = stoppable_owner
    a, b = np.full(1000, FILL, np.uint8), np.full(2000, FILL, np.uint8)
    stop_process(pid)
    try:
        ops = ch.batch().read(ref, a, 10).read(ref, b, 5000)
        assert _timed_out(lambda: ops.post(timeout=0.3)) < 0.8
        src = np.arange(100, dtype=np.uint8)
        assert _timed_out(lambda: ch.write(src, ref, 64, timeout=0.3)) < 0.8
    finally:
        os.kill(pid, signal.SIGCONT)
    back = np.zeros(N, np.uint8)
    ch.read(ref, back, timeout=10)
    expect = _pattern()
    expect[64:164] = np.arange(100, dtype=np.uint8)     # a write given up may still land
    assert np.array_equal(back, expect)
    assert (a == FILL).all() and (b == FILL).all()


def test_an_atomic_to_a_stopped_owner_times_out(stoppable_owner):
    """tcp: fetch_add and compare_swap to a stopped owner raise Timeout by their
    ``timeout``; given up, they may still be done when the owner wakes (as a write
    may land), and the channel serves the next atomic, whose old value says so."""
    ch, ref, pid = stoppable_owner
    first = int(_pattern()[:8].view("<u8")[0])
    assert ch.fetch_add(ref, 0, 0).wait() == first      # the owner serves
    stop_process(pid)
    try:
        assert _timed_out(lambda: ch.fetch_add(ref, 0, 5, timeout=0.3)) < 0.8
        assert _timed_out(lambda: ch.compare_swap(ref, 8, 0, 1, timeout=0.3)) < 0.8
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ch.fetch_add(ref, 0, 1, timeout=10).wait() == (first + 5) % 2**64
    back = np.zeros(N, np.uint8)
    ch.read(ref, back, timeout=10)
    expect = _pattern()
    expect[:8] = np.array([(first + 6) % 2**64], "<u8").view(np.uint8)
    if int(expect[8:16].view("<u8")[0]) == 0:           # the compare_swap matched
        expect[8:16] = np.array([1], "<u8").view(np.uint8)
    assert np.array_equal(back, expect)


def test_a_read_given_up_half_way_is_not_finished_later(stoppable_owner):
    """The owner stops in the middle of a large answer: what came before the Timeout
    stays, nothing comes after it (the receive let go between two pieces)."""
    ch, ref, pid = stoppable_owner
    expect = _pattern()
    for attempt in range(60):
        dest = np.full(N, FILL, np.uint8)
        stopper = threading.Timer(0.0003 * (attempt % 12), os.kill, (pid, signal.SIGSTOP))
        stopper.start()
        try:
            ch.read(ref, dest, timeout=0.3)
            done = True
        except Timeout:
            done = False
        finally:
            stopper.join()
            seen = dest.copy()
            os.kill(pid, signal.SIGCONT)
        again = np.zeros(N, np.uint8)
        ch.read(ref, again, timeout=10)
        assert np.array_equal(again, expect)
        assert np.array_equal(dest, seen)           # nothing written after the return
        if not done and (dest != FILL).any() and not np.array_equal(dest, expect):
            return                                  # it was given up half-way
    pytest.skip("the owner never stopped half-way through an answer (timing)")


def test_timeout_must_not_be_negative(stoppable_owner):
    ch, ref, _ = stoppable_owner
    with pytest.raises(ValueError):
        ch.read(ref, bytearray(8), timeout=-1)
    with pytest.raises(ValueError):
        ch.batch().read(ref, bytearray(8)).post(timeout=-1)


@pytest.mark.parametrize("stoppable_owner", [LISTEN_ADDRESS["shm"]()], indirect=True)
def test_shm_moves_the_bytes_of_a_stopped_owner_inside_the_call(stoppable_owner):
    """shm copies by cross-memory attach: no thread of the owner takes part, so a
    frozen owner's region is still read (and written) by the deadline."""
    ch, ref, pid = stoppable_owner
    out = np.zeros(N, np.uint8)
    stop_process(pid)
    try:
        ch.read(ref, out, timeout=0.5)
        ch.write(np.arange(10, dtype=np.uint8), ref, 3, timeout=0.5)
        ch.read(ref, back := np.zeros(20, np.uint8), timeout=0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert np.array_equal(out, _pattern())
    assert np.array_equal(back[3:13], np.arange(10, dtype=np.uint8))


@pytest.mark.parametrize("rpair", VERBS, indirect=True)
@pytest.mark.parametrize("how", ["read", "batch", "write"])
def test_verbs_a_deadline_stops_the_device_before_the_timeout(rpair, how):
    """verbs: a deadline shorter than the transfer raises Timeout by then (the
    destination may be whole: the device may finish first); the device was stopped
    first, so a read's destination does not change after the call returned; the
    connection is lost (PeerLost)."""
    owner, peer = rpair
    n = 8 * 2**20                                  # kept by the registration cache
    src = pattern(n, 5)
    reg = owner.expose(src, "rw")
    dest = np.zeros(n, np.uint8)
    peer.read(reg.ref, dest)                       # registered now (the cache keeps
    assert np.array_equal(dest, src)               # it): the deadline is the transfer's
    dest[:] = FILL
    calls = {"read": lambda: peer.read(reg.ref, dest, timeout=0.001),
             "batch": lambda: peer.batch().read(reg.ref, dest[:n // 2])
             .read(reg.ref, dest[n // 2:], n // 2).post(timeout=0.001),
             "write": lambda: peer.write(dest, reg.ref, timeout=0.001)}
    assert _timed_out(calls[how]) < 1.0 + within(1.0)      # the flush: 1 s at most
    seen = dest.copy()
    time.sleep(0.3)
    assert np.array_equal(dest, seen)              # nothing written after the return
    with pytest.raises(PeerLost):
        peer.read(reg.ref, np.zeros(8, np.uint8))

