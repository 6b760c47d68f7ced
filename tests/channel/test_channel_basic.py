"""Behaviour of the channel API on the shm provider, in both modes."""

from __future__ import annotations

import faulthandler
import gc
import random
import sys
import threading
import time

import numpy as np
import pytest

import rdmamw
from tests.support.helpers import make_pair, within


def recv_all(ch, n, timeout=5.0):
    out = []
    while len(out) < n:
        for m in ch.recv_batch(timeout=timeout):
            out.append(bytes(m))
            m.release()
    return out


def test_send_recv_one(pair):
    a, b = pair
    a.send(b"hello").wait(timeout=5)
    m = b.recv(timeout=5)
    assert bytes(m) == b"hello" and len(m) == 5
    m.release()


def test_batch_of_mixed_buffers_keeps_order(pair):
    a, b = pair
    arr = np.arange(100, dtype=np.float64)
    msgs = [b"a", bytearray(b"bb"), memoryview(b"ccc"), arr, b"", b"x" * 3000, b"tail"]
    h = a.send_batch(msgs)
    h.wait(timeout=5)
    assert h.done() and h.count == len(msgs)
    got = recv_all(b, len(msgs))
    assert got == [bytes(memoryview(x)) for x in msgs]


class _EmptiesTheList:
    """A host array by DLPack whose export empties the list being sent and frees its
    other messages; new bytes of their size then take their memory."""

    def __init__(self, arr, msgs, litter):
        self.arr, self.msgs, self.litter = arr, msgs, litter

    def __dlpack_device__(self):
        self.msgs.clear()
        self.litter.extend(bytes([0x58 + i % 8]) * 9 for i in range(64))
        return self.arr.__dlpack_device__()

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)


def test_a_list_emptied_while_its_batch_is_taken_is_sent_whole(pair):
    """send_batch of a list holds its messages for the call: a message whose buffer
    is asked for runs Python code, which here empties the list (the messages before
    and after it lose their last reference)."""
    a, b = pair
    arr = np.arange(4, dtype=np.uint8)
    litter: list = []
    msgs = [bytes(bytearray(b"first-msg")), None, bytes(bytearray(b"third-msg"))]
    msgs[1] = _EmptiesTheList(arr, msgs, litter)
    a.send_batch(msgs).wait(timeout=5)
    assert msgs == [] and len(litter) == 64
    assert recv_all(b, 3) == [b"first-msg", bytes(arr), b"third-msg"]


def test_both_directions_at_once(pair):
    a, b = pair
    a.send_batch([b"ping%d" % i for i in range(10)])
    b.send_batch([b"pong%d" % i for i in range(10)])
    assert recv_all(b, 10) == [b"ping%d" % i for i in range(10)]
    assert recv_all(a, 10) == [b"pong%d" % i for i in range(10)]


def test_many_laps_exactly_once_in_order(mode, provider):
    """Far more messages than slots, random-ish sizes, a reader thread: every message
    arrives once and in order across hundreds of ring laps."""
    a, b, lst = make_pair(mode, slots=8, slot_size=512, provider=provider)
    total = 4000 if mode == "batched" else 1500
    sizes = [(i * 37) % 500 for i in range(total)]
    got = []

    def reader():
        while len(got) < total:
            for m in b.recv_batch(timeout=10):
                got.append(bytes(m))
                m.release()

    t = threading.Thread(target=reader)
    t.start()
    i = 0
    while i < total:
        k = min(total - i, 1 + i % 23)
        a.send_batch([j.to_bytes(4, "little") + b"z" * max(0, sizes[j] - 4)
                      for j in range(i, i + k)])
        i += k
    t.join(30)
    assert len(got) == total
    for j, g in enumerate(got):
        assert int.from_bytes(g[:4], "little") == j
    st = a.stats()
    assert st["messages"] == total and b.stats()["messages_received"] == total
    a.close(), b.close(), lst.close()


def test_message_buffer_protocol_and_release(pair):
    a, b = pair
    arr = np.arange(16, dtype=np.int32)
    a.send(arr)
    m = b.recv(timeout=5)
    view = np.frombuffer(m, dtype=np.int32)
    assert (view == arr).all()
    assert not view.flags.writeable
    with pytest.raises(BufferError):
        m.release()              # a view is still alive
    del view
    m.release()
    assert m.released
    with pytest.raises(ValueError):
        memoryview(m)
    m.release()                  # idempotent


def test_message_context_manager_and_collection_reclaim(mode, provider):
    a, b, lst = make_pair(mode, slots=4, slot_size=256, provider=provider)
    for _ in range(20):          # 20 laps of a 4-slot ring: only works if slots return
        a.send_batch([b"x" * 200] * 4, timeout=5)
        msgs = b.recv_batch(timeout=5)
        while len(msgs) < 4:
            msgs += b.recv_batch(timeout=5)
        with msgs[0] as m0:
            assert bytes(m0) == b"x" * 200
        del msgs, m0             # the rest are reclaimed when collected
        gc.collect()
    assert a.stats()["messages"] == 80
    a.close(), b.close(), lst.close()


def test_recv_batch_max_messages(pair):
    a, b = pair
    a.send_batch([b"%d" % i for i in range(10)])
    first = [bytes(m) for m in b.recv_batch(max_messages=3, timeout=5)]
    # on an asynchronous transport (tcp) fewer than 3 may have arrived yet
    assert 1 <= len(first) <= 3 and first == [b"%d" % i for i in range(len(first))]
    rest = recv_all(b, 10 - len(first))
    assert rest == [b"%d" % i for i in range(len(first), 10)]
    with pytest.raises(ValueError):
        b.recv_batch(max_messages=0)


def test_recv_timeout(pair):
    _, b = pair
    with pytest.raises(rdmamw.Timeout):
        b.recv(timeout=0.05)
    with pytest.raises(rdmamw.Timeout):
        b.recv_batch(timeout=0)


def test_holding_previous_batch_while_waiting_does_not_stall(mode, provider):
    """The natural loop `msgs = ch.recv_batch()` keeps the previous list alive during
    the call; the sender must still make progress."""
    a, b, lst = make_pair(mode, slots=4, slot_size=128, provider=provider)
    n = 400
    got = 0

    def reader():
        nonlocal got
        msgs = []
        while got < n:
            msgs = b.recv_batch(timeout=10)
            got += len(msgs)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(n):
        a.send(b"m%d" % i, timeout=10)
    t.join(20)
    assert got == n
    a.close(), b.close(), lst.close()


def test_close_drains_then_channel_closed(pair):
    a, b = pair
    a.send_batch([b"1", b"2"])
    a.close()
    assert recv_all(b, 2) == [b"1", b"2"]
    with pytest.raises(rdmamw.ChannelClosed):
        b.recv(timeout=5)
    with pytest.raises(rdmamw.ChannelClosed):
        a.send(b"after close")
    with pytest.raises(rdmamw.ChannelClosed):
        b.send(b"to a closed peer")
    a.close()                    # idempotent


def test_context_manager_closes(mode, provider):
    a, b, lst = make_pair(mode, provider=provider)
    with a, b, lst:
        a.send(b"x")
        assert bytes(b.recv(timeout=5)) == b"x"
    assert a.closed and b.closed


def test_stats_counters_batched_vs_ack(provider):
    res = {}
    for mode in ("batched", "ack"):
        a, b, lst = make_pair(mode, slots=64, slot_size=4096, provider=provider)
        for _ in range(8):
            a.send_batch([b"12345678"] * 64)
            recv_all(b, 64)
        res[mode] = (a.stats(), b.stats())
        a.close(), b.close(), lst.close()
    sb, rb = res["batched"]
    sa, ra = res["ack"]
    for st in (sb, sa):
        for key in ("messages", "batches", "bytes", "signaled_completions", "doorbells",
                    "reclaim_writebacks"):
            assert key in st
        assert st["messages"] == 512 and st["bytes"] == 512 * 8 and st["batches"] == 8
    assert sb["signaled_completions"] == 8                 # one per batch
    assert sa["signaled_completions"] == 512               # exactly one per message
    assert sb["doorbells"] - sb["sleeps"] <= 8 + sb["credit_waits"] + 2
    assert sa["doorbells"] >= 512
    assert ra["reclaim_writebacks"] >= 512                 # one acknowledgment per message
    assert rb["reclaim_writebacks"] < 64


def test_concurrent_senders_each_keep_order(pair):
    a, b = pair
    n = 300

    def send(tag):
        for i in range(n):
            a.send(b"%s%d" % (tag, i))

    ts = [threading.Thread(target=send, args=(t,)) for t in (b"A", b"B")]
    for t in ts:
        t.start()
    # 60 s: in ack mode on verbs in the VM (TCG) with CI's host half on the same 2
    # cores, one gap of 5 s without a message was seen (2026-12-05); ordering is what
    # is tested here, and a sender that hung would still fail it. It did once in
    # batched mode on verbs (60 s without a message, CI 2026-12-05; 771 runs in a quiet
    # VM never hung): on a timeout, print what both ends and every thread were doing
    try:
        got = recv_all(b, 2 * n, timeout=60.0)
    except rdmamw.Timeout:
        print("sender", a.stats(), "\nreceiver", b.stats(), file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        raise
    for t in ts:
        t.join()
    for tag in (b"A", b"B"):
        mine = [int(g[1:]) for g in got if g[:1] == tag]
        assert mine == list(range(n))


def test_a_sender_and_a_receiver_thread_on_each_side_lose_no_wake_up(mode, provider):
    """Both ends run a sending and a receiving thread on one channel, each sleeping
    often (two slots, no spin, short pauses): a wake-up one thread takes from the
    transport must not leave the other asleep for its whole timeout (it did on shm
    and tcp: 'no message within the timeout' in a few of 3,000 rounds;
    rdmamw/include/rm_sleepers.h)."""
    rounds = 300 if provider == "verbs" else 1500
    a, b, lst = make_pair(mode, slots=2, slot_size=4096, provider=provider, spin_us=0)
    errors: list = []
    got: dict = {}

    def side(ch, seed):
        rng = random.Random(seed)
        msgs = [b"%d.%d" % (k, j) + b"x" * 90 for k in range(rounds) for j in range(3)]

        def send():
            try:
                for k in range(rounds):
                    ch.send_batch(msgs[3 * k:3 * k + 3], timeout=10).wait(timeout=10)
                    if rng.random() < 0.3:
                        time.sleep(rng.random() * 0.0005)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(("send", e))

        t = threading.Thread(target=send)
        t.start()
        out = []
        try:
            while len(out) < len(msgs):
                out += [bytes(m) for m in ch.recv_batch(timeout=10)]
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 0.0005)
        except Exception as e:  # noqa: BLE001
            errors.append(("recv", e))
        t.join(60)
        got[seed] = (out, msgs)

    try:
        other = threading.Thread(target=side, args=(a, 1))
        other.start()
        side(b, 2)
        other.join(60)
        assert errors == []
        assert got[1][0] == got[2][1] and got[2][0] == got[1][1]
    finally:
        a.close()
        b.close()
        lst.close()


def test_repr_and_eager_limit(pair, provider):
    a, _ = pair
    assert f"{provider}://" in repr(a)
    assert a.eager_limit == 4096


def test_every_small_size_round_trips(pair):
    """Packed records use a hand-rolled small copy: check every size around its edges."""
    a, b = pair
    msgs = [bytes(range(n)) for n in range(0, 41)]
    got = []
    for i in range(0, len(msgs), 8):      # ack mode takes a slot per message
        a.send_batch(msgs[i:i + 8])
        got += recv_all(b, len(msgs[i:i + 8]))
    assert got == msgs


def test_dropped_channel_reads_as_a_clean_close(mode):
    a, b, lst = make_pair(mode)
    a.send(b"last words")
    del a                        # no close(): collected
    import gc
    gc.collect()
    assert bytes(b.recv(timeout=5)) == b"last words"
    with pytest.raises(rdmamw.ChannelClosed):
        b.recv(timeout=5)
    b.close(), lst.close()


def test_ctrl_c_interrupts_a_blocked_receive(pair):
    import os
    import signal
    import time
    _, b = pair
    # a suite started in the background by a shell inherits SIGINT ignored: Python then
    # installs no handler, so put the one an interactive run has
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            b.recv(timeout=30)
        assert time.monotonic() - t0 < within(2.0)
    finally:
        signal.signal(signal.SIGINT, old)


def test_close_from_another_thread_wakes_a_blocked_receive(pair):
    import time
    _, b = pair
    threading.Timer(0.3, b.close).start()
    t0 = time.monotonic()
    with pytest.raises(rdmamw.ChannelClosed):
        b.recv(timeout=30)
    assert time.monotonic() - t0 < within(2.0)


def test_one_receive_call_at_a_time_and_the_lock_passes_on(pair):
    """A second thread's receive waits for the first thread's call to end (its Timeout
    says so, having taken nothing); when two wait behind each other, each takes one
    message once the call before it ended (the call locks, rdmamw/engine/_calllock.pxd)."""
    a, b = pair
    got: list = []

    def recv_one():
        got.append(bytes(b.recv(timeout=20)))

    t1 = threading.Thread(target=recv_one)
    t1.start()
    for _ in range(100):        # until t1's call holds the lock (a loaded machine)
        with pytest.raises(rdmamw.Timeout) as e:
            b.recv(timeout=0.05)
        if "another thread's receive" in str(e.value):
            break
    else:
        pytest.fail(f"a receive never waited for the other thread's: {e.value}")
    t2 = threading.Thread(target=recv_one)
    t2.start()                  # it sleeps on t1's lock
    a.send(b"one")
    t1.join(20)
    a.send(b"two")
    t2.join(20)
    assert sorted(got) == [b"one", b"two"]
    a.send(b"three")            # the lock is free again
    assert bytes(b.recv(timeout=10)) == b"three"


def test_an_idle_receive_raises_its_sleep_flag_once(pair):
    """A receive sleeps in slices (50 ms: signals get through) and keeps its sleep flag
    raised at the peer across them: one write up and one down for the whole wait, not
    two per slice (50 idle receivers on verbs spent the VM's cores on those writes)."""
    _, b = pair
    s0 = b.stats()
    with pytest.raises(rdmamw.Timeout):
        b.recv(timeout=0.6)
    s1 = b.stats()
    assert s1["sleeps"] - s0["sleeps"] >= 6             # it slept through many slices
    assert s1["work_requests"] - s0["work_requests"] == 2     # the flag, up and down


def _in_thread(fn) -> dict:
    """Run ``fn`` in a thread that is not the main one; what it returned or raised and
    how long it took."""
    import time
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as e:      # noqa: BLE001 (the test looks at it)
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run)
    t.start()
    out["thread"] = t
    return out


def test_an_idle_receive_off_the_main_thread_sleeps_without_slices(mode, provider,
                                                                  monkeypatch):
    """Only the main thread runs signal handlers, so only its waits come back every
    50 ms; a receive in another thread sleeps until its deadline (500 idle threads
    would otherwise wake 10,000 times a second). On verbs with completion events: a
    verbs sleeper without them looks again every RDMAMW_VERBS_POLL_MS (a plain WRITE
    raises no event)."""
    monkeypatch.setenv("RDMAMW_VERBS_EVENT", "1")
    a, b, lst = make_pair(mode, provider=provider)
    try:
        assert b.poll_interval == 0         # woken by events, not by a timer
        s0 = b.stats()
        out = _in_thread(lambda: b.recv(timeout=1.0))
        out["thread"].join(30)
        assert isinstance(out.get("error"), rdmamw.Timeout), out
        assert b.stats()["sleeps"] - s0["sleeps"] <= 4      # a 50 ms slice each: 20
    finally:
        a.close()
        b.close()
        lst.close()


def test_close_wakes_a_receive_blocked_in_another_thread(pair):
    """The receive sleeps without slices there: close() must wake it (each provider's
    close wakes a thread asleep in its wait()), or it would sleep until its 30 s
    timeout."""
    import time
    _, b = pair
    out = _in_thread(lambda: b.recv(timeout=30))
    time.sleep(0.3)
    b.close()
    out["thread"].join(30)
    assert isinstance(out.get("error"), rdmamw.ChannelClosed), out
    assert out["seconds"] < within(5.0), out


def test_close_wakes_a_send_blocked_on_a_full_ring_in_another_thread(pair):
    """A sender whose ring is full sleeps until the receiver releases slots; closing
    the channel from another thread ends its wait with ChannelClosed at once."""
    import time
    a, b = pair
    payload = b"x" * 64
    for _ in range(10_000):     # fill the ring: nobody on b receives (a verbs ring
        try:                    # grows while its sender waits: give it the time)
            a.send(payload, timeout=0.5)
        except rdmamw.Timeout:
            break
    else:
        pytest.fail("the ring never filled")
    out = _in_thread(lambda: a.send(payload, timeout=30))
    time.sleep(0.3)
    assert "seconds" not in out                     # still waiting for room
    a.close()
    out["thread"].join(30)
    assert isinstance(out.get("error"), rdmamw.ChannelClosed), out
    assert out["seconds"] < within(5.0), out

