"""Rings that grow (issue "verbs at cluster scale", docs/protocol.md "Rings that grow"):
with RDMAMW_VERBS_RING_START a verbs channel registers only the start of its receive
ring (and the peer only the staging of it); when the sender runs short, the
receiver's device thread registers what it asks for and grants it, without the
receiving application. Inside the soft-RoCE VM."""

from __future__ import annotations

import gc
import threading

import pytest

from rdmamw.providers.verbs import _memory
from tests.channel.test_channel_basic import recv_all
from tests.providers.test_verbs import _pair
from tests.support.helpers import NO_DEVICE, VERBS_OK

pytestmark = [pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE), pytest.mark.device]

KIB = 1024
START = "?ring_start=65536"         # one slot of the 64 KiB rings below
ONE_SLOT = "?ring_start=1"          # one slot, whatever its size
GRANT_OFF = 1536                    # providers/_verbs.pxd: the grant words' place


def _close(*objs) -> None:
    for o in objs:
        o.close()


def test_an_idle_channel_registers_only_the_start_of_its_rings():
    a, b, lst, ta, tb = _pair(START, slots=128, slot_size=64 * KIB)
    try:
        a.send(b"x").wait(timeout=10)
        assert recv_all(b, 1) == [b"x"]
        for t in (ta, tb):
            c = t.counters()
            assert c["ring_slots_granted"] == 1 and c["peer_ring_slots_granted"] == 1
            # block header + one slot, the staging of one peer slot, bitmaps, buffers
            assert c["bytes_registered"] <= 256 * KIB, c
    finally:
        _close(a, b, lst)


def test_the_whole_ring_at_once_when_the_start_is_zero():
    a, b, lst, ta, tb = _pair("?ring_start=0", slots=16, slot_size=4096)
    try:
        a.send_batch([b"y" * 3000] * 16).wait(timeout=20)     # the whole ring, unread
        assert recv_all(b, 16) == [b"y" * 3000] * 16
        for t in (ta, tb):
            c = t.counters()
            assert c["ring_slots_granted"] == 16 and c["peer_ring_slots_granted"] == 16
            assert c["ring_grants_given"] == c["ring_grants_taken"] == 0
    finally:
        _close(a, b, lst)


def _messages(n: int, size: int) -> list[bytes]:
    return [i.to_bytes(4, "little") * (size // 4) for i in range(n)]


def test_a_burst_the_receiver_does_not_read_yet_grows_the_ring():
    """A send that fits the whole ring completes before the receiver is called: the
    grants come from the receiver's device thread, not its application."""
    a, b, lst, ta, tb = _pair(START + "&sq_depth=64", slots=128, slot_size=64 * KIB, mode="ack")
    try:
        msgs = _messages(100, 60_000)
        a.send_batch(msgs).wait(timeout=120)
        assert recv_all(b, 100) == msgs
        ca, cb = ta.counters(), tb.counters()
        # the send asks for its 100 slots in one grant (doubling: 7 grants, 1 -> 128)
        assert cb["ring_slots_granted"] == ca["peer_ring_slots_granted"] == 100
        assert cb["ring_grants_given"] == ca["ring_grants_taken"] == 1
    finally:
        _close(a, b, lst)


def test_a_busy_channel_grows_and_loses_nothing():
    a, b, lst, ta, tb = _pair(START, slots=128, slot_size=64 * KIB)
    msgs = _messages(600, 60_000)
    got: list = []
    t = threading.Thread(target=lambda: got.extend(recv_all(b, 600, timeout=120)))
    t.start()
    try:
        for i in range(0, 600, 50):
            a.send_batch(msgs[i:i + 50]).wait(timeout=120)
        t.join(130)
        assert got == msgs
        ca, cb = ta.counters(), tb.counters()
        assert cb["ring_grants_given"] == ca["ring_grants_taken"] >= 1
        assert cb["ring_slots_granted"] == ca["peer_ring_slots_granted"] > 1
    finally:
        _close(a, b, lst)


def test_forged_grant_words_are_ignored_and_the_channel_works():
    """The grant words live in memory the peer writes: a word that grants no more
    than before, or more than the ring, ends the taking; sending goes on."""
    a, b, lst, ta, tb = _pair(ONE_SLOT, slots=8, slot_size=4096)
    try:
        ctrl = ta._region_view(0)
        words = memoryview(ctrl).cast("B")[GRANT_OFF:GRANT_OFF + 24].cast("Q")
        words[0] = (1000 << 32) | 0x1234       # more slots than the peer's ring has
        msgs = _messages(40, 4000)
        a.send(msgs[0]).wait(timeout=60)       # the one slot granted; the next send
        got: list = []                          # reads the forged word before it asks
        t = threading.Thread(target=lambda: got.extend(recv_all(b, 40, timeout=60)))
        t.start()
        for m in msgs[1:]:
            a.send(m).wait(timeout=60)
        t.join(70)
        assert got == msgs
        assert ta.counters()["peer_ring_slots_granted"] == 1    # took nothing forged
    finally:
        _close(a, b, lst)


def test_past_the_pinned_budget_the_ring_stays_small_and_works():
    used, budget = _memory.pinned()
    a, b, lst, ta, tb = _pair(ONE_SLOT, slots=64, slot_size=16 * KIB)
    try:
        gc.collect()                # earlier tests' channels give their pins back now
        used_now, _ = _memory.pinned()
        _memory.set_pinned_budget(used_now + 4 * KIB)     # no room for any part
        msgs = _messages(200, 15_000)
        got: list = []
        t = threading.Thread(target=lambda: got.extend(recv_all(b, 200, timeout=120)))
        t.start()
        for i in range(0, 200, 20):
            a.send_batch(msgs[i:i + 20]).wait(timeout=120)
        t.join(130)
        assert got == msgs
        assert tb.counters()["ring_slots_granted"] == 1
    finally:
        _memory.set_pinned_budget(budget)
        _close(a, b, lst)
