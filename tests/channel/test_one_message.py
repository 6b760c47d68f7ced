"""The one-message path: ``send(msg)`` / ``send_batch([msg])`` of one eager bytes
object on a synchronous transport (shm, tcp) posts its slot and arrival word as one
unsignaled chain, complete within its post; ``recv()`` takes a message that has
arrived without the wait loop. Anything else takes the general path, in order."""

from __future__ import annotations

import pytest

import rdmamw
from tests.support.helpers import make_pair

SYNCHRONOUS = ("shm", "tcp")        # transports whose post() executes the chain


def test_both_paths_keep_order_and_handles_count_up(pair):
    a, b = pair
    sends = [
        lambda: a.send(b"one"),                     # the one-message path
        lambda: a.send_batch([b"two"]),             # ... from a list of one
        lambda: a.send_batch((b"three",)),          # ... and a tuple of one
        lambda: a.send(bytearray(b"four")),         # not bytes: the general path
        lambda: a.send(b"5" * 300),                 # over the copy limit (shm: general)
        lambda: a.send_batch([b"six", b"seven"]),   # a batch: general
        lambda: a.send(b""),                        # empty
        lambda: a.send(b"eight", timeout=5),        # with a deadline
    ]
    handles = [s() for s in sends]
    want = [b"one", b"two", b"three", b"four", b"5" * 300, b"six", b"seven", b"", b"eight"]
    got = [bytes(b.recv(timeout=5)) for _ in range(3)]
    while len(got) < len(want):
        got += [bytes(m) for m in b.recv_batch(timeout=5)]
    assert got == want
    ids = [h.batch for h in handles]        # a chain each (ack: a batch of two is two)
    assert ids == sorted(set(ids)) and ids[:3] == [ids[0], ids[0] + 1, ids[0] + 2]
    for h in handles:
        h.wait(timeout=5)
        assert h.done()
    assert a.stats()["messages"] == len(want) and a.stats()["batches"] == len(sends)


def test_one_message_is_one_unsignaled_chain_complete_at_its_post(provider):
    if provider not in SYNCHRONOUS:
        pytest.skip("the one-message path is for transports whose post() executes it")
    a, b, lst = make_pair(provider=provider)
    with a, b, lst:
        a.send(b"warm")
        b.recv(timeout=5).release()
        before = a.stats()
        h = a.send(b"12345678")
        after = a.stats()
        assert h.done()                 # no completion to reap: done at its post
        delta = {k: after[k] - before[k] for k in
                 ("doorbells", "work_requests", "signaled_completions", "messages",
                  "batches", "bytes")}
        assert delta == {"doorbells": 1, "work_requests": 2, "signaled_completions": 0,
                         "messages": 1, "batches": 1, "bytes": 8}
        assert bytes(b.recv(timeout=5)) == b"12345678"


def test_one_message_on_a_full_ring_waits_for_a_slot(provider):
    a, b, lst = make_pair(slots=4, slot_size=256, provider=provider)
    with a, b, lst:
        for i in range(4):
            a.send(b"m%d" % i)
        with pytest.raises(rdmamw.Timeout) as e:    # no slot: the general path's wait
            a.send(b"m4", timeout=0.2)
        assert e.value.sent == 0
        first = b.recv(timeout=5)
        assert bytes(first) == b"m0"
        first.release()
        a.send(b"m4", timeout=5)                    # a slot came back
        assert [bytes(b.recv(timeout=5)) for _ in range(4)] == [b"m1", b"m2", b"m3", b"m4"]


def test_recv_waits_then_times_out_when_nothing_arrived(pair):
    a, b = pair
    with pytest.raises(rdmamw.Timeout):
        b.recv(timeout=0.05)
    a.send(b"late")
    assert bytes(b.recv(timeout=5)) == b"late"


def test_recv_hands_a_rendezvous_message_to_the_general_path(provider):
    a, b, lst = make_pair(slot_size=4096, provider=provider, rendezvous="read")
    with a, b, lst:
        if a.rendezvous == "off":
            pytest.skip(f"{provider} cannot expose memory: no rendezvous")
        big = bytes(range(256)) * 64                # 16 KiB: by rendezvous
        a.send(b"before")
        h = a.send(big)
        a.send(b"after")
        got = [b.recv(timeout=5) for _ in range(3)]
        assert [bytes(m) for m in got] == [b"before", big, b"after"]
        h.wait(timeout=5)


def test_a_closed_channel_refuses_the_one_message_calls(pair):
    a, b = pair
    a.send(b"x")
    assert bytes(b.recv(timeout=5)) == b"x"
    a.close()
    with pytest.raises(rdmamw.ChannelClosed):
        a.send(b"y")
    with pytest.raises(rdmamw.ChannelClosed):
        b.recv(timeout=5)


def test_recv_takes_the_records_of_a_packed_slot_one_by_one(pair):
    a, b = pair
    a.send_batch([b"p", b"qq", b"rrr"])         # one PACKED slot (batched mode)
    assert [bytes(b.recv(timeout=5)) for _ in range(3)] == [b"p", b"qq", b"rrr"]
    a.send(b"single")
    assert bytes(b.recv(timeout=5)) == b"single"
