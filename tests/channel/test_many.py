"""Many small messages in one call: ``send_many(data, sizes)`` sends one buffer cut into
messages, ``recv_many_into(buffer, lengths)`` copies the arrived messages into one
buffer. They are ordinary messages: the results (messages, order, counters) equal
those of send_batch / recv_batch, the calls mix with the old ones both ways, and a
timeout, a close or a bad argument never duplicates, cuts or half-delivers one."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdmamw
import rdmamw.trace
from tests.support.helpers import make_pair

SLOT = 4096
#: sizes around a 4 KiB slot's boundaries: empty, the record padding, two records
#: filling a slot exactly, the largest record of a PACKED slot, a SINGLE slot's
#: largest (the eager limit), and one byte either side
EDGES = [0, 1, 7, 8, 9, 2040, 2040, 2041, 4087, 4088, 4089, 4095, 4096, 3, 0]
COUNTED = ("messages", "bytes", "batches", "slots_sent")
RECEIVED = ("messages_received", "bytes_received", "slots_received")


def _messages(sizes, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def _delta(ch, before: dict, keys) -> dict:
    now = ch.stats()
    return {k: now[k] - before[k] for k in keys}


def _recv_many(ch, n: int, room: int = 1 << 16, cap: int = 1024,
               timeout: float = 10) -> tuple[list[bytes], list[int]]:
    """``n`` messages by recv_many_into (bytes each) and the count of every call."""
    buf, lens = bytearray(room), np.zeros(cap, np.uint64)
    got, counts = [], []
    while len(got) < n:
        k = ch.recv_many_into(buf, lens, timeout=timeout)
        assert 1 <= k <= cap
        counts.append(k)
        off = 0
        for L in lens[:k].tolist():
            got.append(bytes(buf[off:off + L]))
            off += L
    return got, counts


def _recv_batches(ch, n: int) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < n:
        got += [bytes(m) for m in ch.recv_batch(timeout=10)]
    return got


def _in_thread(send) -> threading.Thread:
    """Run ``send()`` (and wait for its handle) in a thread: a batch larger than the
    ring goes as the receiver takes it."""
    t = threading.Thread(target=lambda: send().wait(timeout=30))
    t.start()
    return t


def _nothing_more(ch) -> None:
    with pytest.raises(rdmamw.Timeout):
        ch.recv(timeout=0.05)


def test_send_many_is_send_batch_of_the_slices(pair):
    """The same messages, the same counters at both ends, as send_batch of the slices;
    from bytes, a numpy array of another dtype, a lengths list or a fixed size."""
    a, b = pair
    msgs = _messages(EDGES * 3, seed=1)
    sizes = np.array([len(m) for m in msgs], np.int64)
    data = b"".join(msgs)
    results = []
    for send in (lambda: a.send_batch(msgs), lambda: a.send_many(data, sizes)):
        sent, recd = a.stats(), b.stats()
        t = _in_thread(send)
        got = _recv_batches(b, len(msgs))
        t.join(timeout=30)
        results.append((got, _delta(a, sent, COUNTED), _delta(b, recd, RECEIVED)))
    assert results[0] == results[1]
    assert results[0][0] == msgs and results[0][1]["messages"] == len(msgs)
    words = np.arange(64, dtype=np.float64)         # any buffer: 8 messages of 64 B
    a.send_many(words, size=64).wait(timeout=10)
    a.send_many(b"abcdef", [1, 0, 2, 3]).wait(timeout=10)
    got = _recv_batches(b, 12)
    assert got == [words.tobytes()[i:i + 64] for i in range(0, 512, 64)] + [
        b"a", b"", b"bc", b"def"]


def test_recv_many_is_recv_batch_copied_out(pair):
    """recv_many_into returns the messages recv_batch would, back to back, counted the
    same; a zero-length message is one; every slot goes back (the ring is reusable
    for many rounds of more than its slots)."""
    a, b = pair
    msgs = _messages(EDGES * 3, seed=2)
    results = []
    for recv in (lambda n: (_recv_batches(b, n), None), lambda n: _recv_many(b, n)):
        recd = b.stats()
        t = _in_thread(lambda: a.send_batch(msgs))
        got, _ = recv(len(msgs))
        t.join(timeout=30)
        results.append((got, _delta(b, recd, RECEIVED)))
    assert results[0] == results[1] and results[0][0] == msgs
    small = _messages(range(40), seed=3)
    for _ in range(8):          # 8 x 40 messages: many times the 16 slots
        t = _in_thread(lambda: a.send_batch(small))
        assert _recv_many(b, len(small), cap=7)[0] == small
        t.join(timeout=30)
    _nothing_more(b)


def test_the_calls_mix_both_ways(pair):
    a, b = pair
    msgs = _messages([5, 0, 300, 4096, 17, 8, 2000, 1, 2, 3, 64, 4000], seed=4)
    chunks = [msgs[0:3], msgs[3:4], msgs[4:8], msgs[8:9], msgs[9:12]]
    a.send_batch(chunks[0])
    a.send_many(b"".join(chunks[1]), [len(m) for m in chunks[1]])
    a.send(chunks[3][0])
    a.send_many(b"".join(chunks[2]), np.array([len(m) for m in chunks[2]], np.uint32))
    a.send_many(b"".join(chunks[4]), [len(m) for m in chunks[4]]).wait(timeout=10)
    order = [msgs[0:3], msgs[3:4], msgs[8:9], msgs[4:8], msgs[9:12]]
    want = [m for c in order for m in c]
    got = [bytes(b.recv(timeout=10))]
    got += _recv_many(b, 2, cap=2)[0]
    got += [bytes(m) for m in b.recv_batch(max_messages=2, timeout=10)]
    got += _recv_many(b, 1, cap=1)[0]
    while len(got) < len(want):
        got += [bytes(m) for m in b.recv_batch(max_messages=3, timeout=10)]
        if len(got) < len(want):
            got += _recv_many(b, 1, cap=2)[0]
    assert got == want
    _nothing_more(b)


def test_a_message_stays_for_the_next_call_when_it_does_not_fit(provider):
    """Room for k messages and all but one byte of the next: k delivered, the next
    whole on the next call; a buffer too small for even the first raises
    BufferTooSmall and loses nothing; at most len(lengths) per call."""
    a, b, lst = make_pair(slot_size=SLOT, provider=provider)
    with a, b, lst:
        msgs = _messages([100, 200, 4000, 30, 30, 50, 4096], seed=5)
        a.send_many(b"".join(msgs), [len(m) for m in msgs]).wait(timeout=10)
        lens = np.zeros(10, np.uint32)
        buf = bytearray(300 + 3999)
        assert b.recv_many_into(buf, lens, timeout=10) == 2
        assert lens[:2].tolist() == [100, 200] and bytes(buf[:300]) == msgs[0] + msgs[1]
        with pytest.raises(rdmamw.BufferTooSmall) as e:
            b.recv_many_into(bytearray(3999), lens, timeout=10)
        assert e.value.needed == 4000
        assert b.recv_many_into(buf, lens[:1], timeout=10) == 1
        assert lens[0] == 4000 and bytes(buf[:4000]) == msgs[2]
        assert bytes(b.recv(timeout=10)) == msgs[3]
        buf = bytearray(30 + 50 + 4095)     # the SINGLE slot's 4096 B do not fit
        assert b.recv_many_into(buf, lens, timeout=10) == 2
        assert lens[:2].tolist() == [30, 50] and bytes(buf[:80]) == msgs[4] + msgs[5]
        assert _recv_many(b, 1, room=4096)[0] == msgs[6:]
        assert b.stats()["messages_received"] == 7
        _nothing_more(b)


@pytest.mark.parametrize("strategy", ["read", "write"])
def test_rendezvous_messages_of_send_many(provider, strategy):
    """A message above the threshold goes by rendezvous, as in send_batch; a receive
    many stops before it and the next delivers it alone, READ into the buffer; with
    rendezvous off it is refused whole (MessageTooLarge, nothing sent)."""
    a, b, lst = make_pair(slot_size=SLOT, provider=provider, rendezvous=strategy,
                          rndv_threshold=1000)
    with a, b, lst:
        msgs = _messages([10, 20, 1001, 30, 50000, 40], seed=6)
        data = np.frombuffer(b"".join(msgs), np.uint8).copy()
        h = a.send_many(data, [len(m) for m in msgs])   # done once they are taken
        assert a.stats()["rndv_sends"] == 2
        got, counts = _recv_many(b, len(msgs), room=60000)
        assert got == msgs and counts == [2, 1, 1, 1, 1]
        h.wait(timeout=10)
        h = a.send_many(data, [len(m) for m in msgs])
        assert _recv_batches(b, len(msgs)) == msgs
        h.wait(timeout=10)
        _nothing_more(b)
    a, b, lst = make_pair(slot_size=SLOT, provider=provider, rendezvous="off")
    with a, b, lst:
        with pytest.raises(rdmamw.MessageTooLarge):
            a.send_many(bytes(10 + SLOT + 1), [10, SLOT + 1])
        a.send_many(b"ok", size=2)
        assert bytes(b.recv(timeout=10)) == b"ok"
        _nothing_more(b)


@pytest.mark.parametrize("args, error", [
    ((b"abc", [1, 1]), ValueError),                     # sums short of the data
    ((b"abc", [2, 2]), ValueError),                     # ... past it
    ((b"abc", np.array([4, -1], np.int64)), ValueError),  # negative
    ((b"abc", np.array([1.0, 2.0])), TypeError),        # not integers
    ((b"abc", [1.5, 1.5]), TypeError),
    ((b"abc", "12"), TypeError),
    ((b"abc", None), TypeError),                        # neither sizes nor size
    (("abc", [3]), TypeError),                          # not a buffer
])
def test_bad_send_arguments_send_nothing(args, error):
    a, b, lst = make_pair()
    with a, b, lst:
        with pytest.raises(error):
            a.send_many(*args)
        for kw in ({"size": 2}, {"size": 0}, {"size": 3, "sizes": [3]}):
            with pytest.raises((ValueError, TypeError)):
                a.send_many(b"abc", **kw)
        assert a.stats()["messages"] == 0
        a.send_many(b"abc", size=3)
        assert bytes(b.recv(timeout=10)) == b"abc"
        _nothing_more(b)


@pytest.mark.parametrize("buffer, lengths, error", [
    (bytearray(64), np.zeros(4, np.float64), TypeError),
    (bytearray(64), np.zeros(4, np.int16), TypeError),
    (bytearray(64), np.zeros(4, np.int32), TypeError),
    (bytearray(64), np.zeros(0, np.uint32), ValueError),
    (bytearray(64), bytes(32), TypeError),                  # read-only
    (bytes(64), np.zeros(4, np.uint32), TypeError),         # read-only
    (bytearray(64), np.zeros(8, np.uint32)[::2], TypeError),  # not contiguous
])
def test_bad_receive_arguments_take_nothing(buffer, lengths, error):
    a, b, lst = make_pair()
    with a, b, lst:
        a.send(b"kept")
        with pytest.raises(error):
            b.recv_many_into(buffer, lengths, timeout=1)
        assert bytes(b.recv(timeout=10)) == b"kept"


def test_timeout_mid_batch_sends_a_whole_prefix(mode, provider):
    """A ring that stays full: Timeout says how many went; the receiver gets exactly
    those, whole; the rest sent again arrive after them, nothing twice."""
    a, b, lst = make_pair(mode, slots=4, slot_size=SLOT, provider=provider)
    with a, b, lst:
        msgs = _messages([1000 + i for i in range(60)], seed=7)
        sizes = np.array([len(m) for m in msgs], np.int64)
        data = b"".join(msgs)
        with pytest.raises(rdmamw.Timeout) as e:
            a.send_many(data, sizes, timeout=0.3)
        sent = e.value.sent
        assert 0 < sent < len(msgs)
        got, _ = _recv_many(b, sent)
        assert got == msgs[:sent]
        with pytest.raises(rdmamw.Timeout):     # a receive that times out takes nothing
            b.recv_many_into(bytearray(SLOT), np.zeros(4, np.uint32), timeout=0.05)
        _nothing_more(b)
        rest = threading.Thread(
            target=lambda: a.send_many(data[int(sizes[:sent].sum()):], sizes[sent:],
                                       timeout=30).wait(timeout=30))
        rest.start()
        got, _ = _recv_many(b, len(msgs) - sent, cap=5)
        rest.join(timeout=30)
        assert got == msgs[sent:]
        _nothing_more(b)
        # (the sender counts a batch once it posted it whole, as for send_batch: the
        # one that timed out is not counted)
        assert b.stats()["messages_received"] == len(msgs)
        assert a.stats()["messages"] == len(msgs) - sent


def test_close_mid_batch_from_another_thread(provider):
    """A send_many waiting for slots and a recv_many_into waiting for messages end with
    ChannelClosed when their channels close from another thread; the peer of the
    sender receives a whole prefix of the batch, then ChannelClosed."""
    a, b, lst = make_pair(slots=4, slot_size=SLOT, provider=provider)
    with lst:
        msgs = _messages([3000] * 40, seed=8)
        errors: dict = {}

        def run(name, fn):
            try:
                fn()
            except rdmamw.RdmamwError as e:
                errors[name] = e

        sender = threading.Thread(target=run, args=("send", lambda: a.send_many(
            b"".join(msgs), size=3000)))
        sender.start()
        time.sleep(0.3)
        a.close()
        sender.join(timeout=10)
        assert isinstance(errors["send"], rdmamw.ChannelClosed)
        got: list[bytes] = []
        with pytest.raises(rdmamw.ChannelClosed):
            while True:
                got += _recv_many(b, 1, timeout=5)[0]
        assert 1 <= len(got) < len(msgs) and got == msgs[:len(got)]   # (a ring that
        # grows, verbs, may have granted fewer than its 4 slots)
        b.close()
        c, d, lst2 = make_pair(provider=provider)
        with c, lst2:
            waiter = threading.Thread(target=run, args=("recv", lambda: d.recv_many_into(
                bytearray(64), np.zeros(4, np.uint32))))
            waiter.start()
            time.sleep(0.3)
            d.close()
            waiter.join(timeout=10)
            assert isinstance(errors["recv"], rdmamw.ChannelClosed)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.one_of(st.integers(0, 64), st.integers(0, SLOT)), max_size=300),
       room=st.integers(SLOT, 3 * SLOT), cap=st.integers(1, 64),
       via_size=st.booleans())
def test_random_size_lists(many_pair, sizes, room, cap, via_size):
    """Any list of sizes up to the eager limit, sent whole by send_many (or by a fixed
    size), received by recv_many_into calls of any room and length cap: the same
    messages, in order, each call within its room and cap."""
    a, b = many_pair
    if via_size:
        sizes = [sizes[0] or 1] * len(sizes) if sizes else []
    msgs = _messages(sizes, seed=len(sizes))
    data = b"".join(msgs)
    args = {"size": sizes[0]} if via_size and sizes else {"sizes": sizes}
    sender = threading.Thread(target=lambda: a.send_many(data, **args).wait(timeout=30))
    sender.start()
    buf, lens = bytearray(room), np.zeros(cap, np.int64)
    got: list[bytes] = []
    while len(got) < len(msgs):
        k = b.recv_many_into(buf, lens, timeout=30)
        assert 1 <= k <= cap and int(lens[:k].sum()) <= room
        off = 0
        for L in lens[:k].tolist():
            got.append(bytes(buf[off:off + L]))
            off += L
    sender.join(timeout=30)
    assert got == msgs


@pytest.fixture(scope="module")
def many_pair():
    a, b, lst = make_pair(slots=32, slot_size=SLOT)
    yield a, b
    a.close(), b.close(), lst.close()


def test_a_send_many_is_one_batch_in_the_timeline(tmp_path):
    """The timeline's batch spans of send_many are those of send_batch of the same
    messages: one each, with its messages and bytes (docs/trace.md)."""
    a, b, lst = make_pair(slots=8, slot_size=SLOT)
    msgs = _messages([8] * 300 + [100, 0, 4096], seed=9)
    with a, b, lst:
        with rdmamw.trace.record(str(tmp_path / "t-%p.json")) as tr:
            for send in (lambda: a.send_batch(msgs),
                         lambda: a.send_many(b"".join(msgs), [len(m) for m in msgs])):
                t = _in_thread(send)
                assert _recv_many(b, len(msgs))[0] == msgs
                t.join(timeout=30)
    with open(tr.path.replace("%p", str(os.getpid()))) as f:
        doc = json.load(f)
    spans = [(e["args"]["messages"], e["args"]["bytes"]) for e in doc["traceEvents"]
             if e["ph"] == "X" and e["cat"] == "batch" and e["args"]["channel"] == a.trace_id]
    assert spans == [(len(msgs), sum(map(len, msgs)))] * 2


def test_aio_send_many_and_recv_many_into(provider):
    """rdmamw.aio: a send_many larger than the ring goes as slots come back (each
    Timeout's ``sent`` skipped), received by recv_many_into: the messages, in order."""
    import asyncio

    import rdmamw.aio as aio

    a, b, lst = make_pair(provider=provider, slots=4, slot_size=SLOT)
    x, y = aio.Channel(a), aio.Channel(b)
    msgs = _messages([(i * 37) % 3000 for i in range(200)], seed=10)

    async def recv() -> list[bytes]:
        buf, lens = bytearray(3 * SLOT), np.zeros(9, np.uint32)
        got: list[bytes] = []
        while len(got) < len(msgs):
            n = await y.recv_many_into(buf, lens)
            ends = np.cumsum(lens[:n]).tolist()
            got += [bytes(buf[s:e]) for s, e in zip([0, *ends[:-1]], ends, strict=True)]
        return got

    async def main() -> list[bytes]:
        got = asyncio.ensure_future(recv())
        await x.send_many(b"".join(msgs), [len(m) for m in msgs])
        out = await got
        await x.send_many(b"".join(msgs[:10]), np.array([len(m) for m in msgs[:10]]))
        return out

    with lst:
        try:
            got = asyncio.run(main())
            assert got == msgs
            assert [bytes(m) for m in b.recv_batch(timeout=10)] == msgs[:10]
        finally:
            a.close(), b.close()
