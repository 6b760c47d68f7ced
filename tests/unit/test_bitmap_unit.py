"""Unit tests of the phase bitmaps' edge cases, on the Cython classes and the model.

Most tests run on both implementations (``impl`` fixture), so the model's mirror of
the Cython API (return values, exceptions) is pinned down too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rdmamw.bitmap import RecvBitmaps, SendBitmaps
from rdmamw.bitmap.model import RecvBitmapsModel, SendBitmapsModel, SlotRingModel, words_for

EDGE_SIZES = [1, 2, 63, 64, 65, 127, 128, 129, 200]


@pytest.fixture(params=["cython", "model"])
def impl(request: pytest.FixtureRequest) -> tuple[type, type]:
    if request.param == "cython":
        return SendBitmaps, RecvBitmaps
    return SendBitmapsModel, RecvBitmapsModel


def pair(impl: tuple[type, type], nslots: int) -> tuple[Any, Any]:
    send_cls, recv_cls = impl
    return send_cls(nslots), recv_cls(nslots)


def publish_arrival(s: Any, r: Any) -> None:
    """Copy every arrival word from the sender's truth to the receiver's copy."""
    dst = r.arrival_words
    for w, v in enumerate(np.asarray(s.arrival_words, dtype=np.uint64).tolist()):
        dst[w] = v


def write_back_reclaim(r: Any, s: Any) -> None:
    dst = s.reclaim_words
    for w, v in enumerate(np.asarray(r.reclaim_words, dtype=np.uint64).tolist()):
        dst[w] = v


def lap(s: Any, r: Any, n: int) -> list[int]:
    """Allocate n, publish, consume and release them all, write back."""
    slots = s.alloc_slots(n)
    publish_arrival(s, r)
    assert r.pending_slots() == sorted(slots)
    for slot in slots:
        r.consume_slot(slot)
    assert r.pending_slots() == []
    for slot in slots:
        assert r.is_outstanding(slot)
        r.release_slot(slot)
        assert not r.is_outstanding(slot)
    write_back_reclaim(r, s)
    return slots


@pytest.mark.parametrize("nslots", EDGE_SIZES)
def test_fresh_ring_is_all_free(impl: tuple[type, type], nslots: int) -> None:
    s, r = pair(impl, nslots)
    assert s.nslots == r.nslots == nslots
    assert s.nwords == r.nwords == words_for(nslots)
    assert s.free_slots() == nslots
    assert s.take_dirty_words() is None and r.take_dirty_words() is None
    assert r.pending_slots() == [] and r.unflushed == 0


@pytest.mark.parametrize("nslots", EDGE_SIZES)
def test_full_ring_then_alloc_returns_fewer(impl: tuple[type, type], nslots: int) -> None:
    s, _ = pair(impl, nslots)
    got = s.alloc_slots(nslots + 5)
    assert got == list(range(nslots))  # fresh ring: word by word, lowest bit first
    assert s.free_slots() == 0
    assert s.alloc_slots(1) == [] and s.alloc_slots(0) == []
    assert s.take_dirty_words() == (0, words_for(nslots))
    assert s.take_dirty_words() is None


@pytest.mark.parametrize("nslots", [1, 63, 64, 65, 128, 129])
def test_many_laps_restore_a_free_ring(impl: tuple[type, type], nslots: int) -> None:
    s, r = pair(impl, nslots)
    for k in range(5):  # odd and even phases
        assert sorted(lap(s, r, nslots)) == list(range(nslots)), k
        assert s.free_slots() == nslots
    # bits beyond nslots in the last word are never handed out
    assert all(slot < nslots for slot in s.alloc_slots(nslots + 64))


def test_single_slot_ring(impl: tuple[type, type]) -> None:
    s, r = pair(impl, 1)
    assert s.alloc_slots(3) == [0]
    assert s.alloc_slots(1) == []
    publish_arrival(s, r)
    r.consume_slot(0)
    r.release_slot(0)
    assert r.unflushed == 1
    assert r.take_dirty_words() == (0, 1) and r.unflushed == 0
    assert s.free_slots() == 0  # not written back yet: still busy for the sender
    write_back_reclaim(r, s)
    assert s.free_slots() == 1 and s.alloc_slots(1) == [0]


def test_partial_release_reuses_only_released(impl: tuple[type, type]) -> None:
    s, r = pair(impl, 65)
    assert s.alloc_slots(65) == list(range(65))
    s.take_dirty_words()
    publish_arrival(s, r)
    for slot in r.pending_slots():
        r.consume_slot(slot)
    for slot in (64, 3, 40):  # out of order, across words
        r.release_slot(slot)
    assert r.take_dirty_words() == (0, 2)
    write_back_reclaim(r, s)
    assert s.free_slots() == 3
    # the cursor sits on word 1 (allocation stopped there): round-robin from it
    assert s.alloc_slots(5) == [64, 3, 40]
    assert s.take_dirty_words() == (1, 2)  # circular span: word 1, then word 0


def test_batch_larger_than_64_chunks_like_cython() -> None:
    """alloc_slots works in chunks of 64; the cursor position depends on it."""
    sc, sm = SendBitmaps(128), SendBitmapsModel(128)
    assert sc.alloc_slots(200) == sm.alloc_slots(200) == list(range(128))
    assert sc.take_dirty_words() == sm.take_dirty_words() == (0, 2)
    # free slots 5 and 70 again (as a reclaim write-back would)
    for s in (sc, sm):
        rec = s.reclaim_words
        rec[0] = 1 << 5
        rec[1] = 1 << 6
    assert sc.alloc_slots(2) == sm.alloc_slots(2) == [70, 5]
    assert sc.take_dirty_words() == sm.take_dirty_words() == (1, 2)


def test_dirty_spans(impl: tuple[type, type]) -> None:
    s, r = pair(impl, 200)
    assert s.alloc_slots(70) == list(range(70))
    assert s.take_dirty_words() == (0, 2)
    assert s.alloc_slots(1) == [70]
    assert s.alloc_slots(60) == list(range(71, 131))
    assert s.take_dirty_words() == (1, 2)  # accumulated over two calls
    publish_arrival(s, r)
    for slot in r.pending_slots():
        r.consume_slot(slot)
    r.release_slot(130)
    r.release_slot(5)
    assert r.unflushed == 2
    assert r.take_dirty_words() == (0, 3)  # linear [lo, hi)
    assert r.take_dirty_words() is None and r.unflushed == 0
    r.release_slot(64)
    assert r.take_dirty_words() == (1, 2)


@pytest.mark.parametrize("nslots", [0])
def test_empty_ring_rejected(impl: tuple[type, type], nslots: int) -> None:
    send_cls, recv_cls = impl
    with pytest.raises(ValueError, match="at least one slot"):
        send_cls(nslots)
    with pytest.raises(ValueError, match="at least one slot"):
        recv_cls(nslots)


def test_negative_arguments_overflow(impl: tuple[type, type]) -> None:
    """Arguments are uint32_t: negatives raise OverflowError (not ValueError)."""
    send_cls, recv_cls = impl
    with pytest.raises(OverflowError):
        send_cls(-1)
    with pytest.raises(OverflowError):
        send_cls(1 << 32)
    s, r = pair(impl, 4)
    with pytest.raises(OverflowError):
        s.alloc_slots(-1)
    with pytest.raises(OverflowError):
        r.consume_slot(-1)


@pytest.mark.parametrize("nslots", [1, 63, 64, 65])
def test_slot_out_of_range(impl: tuple[type, type], nslots: int) -> None:
    _, r = pair(impl, nslots)
    for op in (r.consume_slot, r.release_slot, r.is_outstanding):
        with pytest.raises(IndexError):
            op(nslots)


def test_consume_and_release_misuse(impl: tuple[type, type]) -> None:
    s, r = pair(impl, 8)
    with pytest.raises(ValueError, match="not arrived"):
        r.consume_slot(0)
    with pytest.raises(ValueError, match="not delivered"):
        r.release_slot(0)
    s.alloc_slots(1)
    publish_arrival(s, r)
    with pytest.raises(ValueError, match="not delivered"):
        r.release_slot(0)  # arrived but not consumed
    r.consume_slot(0)
    with pytest.raises(ValueError, match="not arrived"):
        r.consume_slot(0)  # twice
    r.release_slot(0)
    with pytest.raises(ValueError, match="not delivered"):
        r.release_slot(0)  # twice
    assert r.unflushed == 1


@pytest.mark.parametrize("nslots", [1, 64, 65, 200])
def test_buffer_too_small(nslots: int) -> None:
    need = words_for(nslots) * 8
    for make, what in ((SendBitmaps, "reclaim"), (RecvBitmaps, "arrival")):
        with pytest.raises(ValueError, match=f"{what} buffer holds {need - 8} bytes"):
            make(nslots, bytearray(need - 8))
        make(nslots, bytearray(need))  # exactly enough is fine
    for make, what in ((SendBitmapsModel, "reclaim"), (RecvBitmapsModel, "arrival")):
        with pytest.raises(ValueError, match=f"{what} buffer holds"):
            make(nslots, [0] * (words_for(nslots) - 1))
        make(nslots, [0] * words_for(nslots))


def test_buffer_misaligned_or_readonly() -> None:
    buf = np.zeros(3, dtype=np.uint64)
    with pytest.raises(ValueError, match="aligned"):
        SendBitmaps(64, memoryview(buf).cast("B")[1:9])
    with pytest.raises(BufferError):
        RecvBitmaps(64, bytes(8))


def test_huge_ring_word_count_does_not_overflow() -> None:
    """(nslots + 63) must not wrap in 32 bits: 2**32 - 1 slots need 2**26 words."""
    with pytest.raises(ValueError, match=f"needs {(1 << 26) * 8}"):
        SendBitmaps((1 << 32) - 1, bytearray(8))
    with pytest.raises(ValueError, match=f"needs {(1 << 26) * 8}"):
        RecvBitmaps((1 << 32) - 1, bytearray(8))


def test_shared_buffers_are_the_peer_copies() -> None:
    """A caller-supplied buffer *is* the peer-written copy (as registered memory is)."""
    arrival = np.zeros(2, dtype=np.uint64)
    reclaim = np.zeros(2, dtype=np.uint64)
    s, r = SendBitmaps(100, reclaim), RecvBitmaps(100, arrival)
    slots = s.alloc_slots(3)
    arrival[:] = np.asarray(s.arrival_words)
    assert r.pending_slots() == slots
    for slot in slots:
        r.consume_slot(slot)
        r.release_slot(slot)
    assert s.free_slots() == 97
    reclaim[:] = np.asarray(r.reclaim_words)
    assert s.free_slots() == 100


def test_ring_model_on_both_implementations() -> None:
    """SlotRingModel runs unchanged on the Cython bitmaps and on the models."""
    rings = [
        SlotRingModel(65, send=SendBitmaps(65), recv=RecvBitmaps(65)),
        SlotRingModel(65),
    ]
    # the twin really runs the Cython sides (a model that swapped in its own would
    # compare the model with itself)
    assert isinstance(rings[0].send, SendBitmaps) and isinstance(rings[0].recv, RecvBitmaps)
    for ring in rings:
        assert ring.flush_threshold == 16
        for _ in range(20):
            ring.send_batch(40)
            ring.deliver_wire()
            for slot, _seq in ring.receive():
                ring.release(slot)
            ring.land_write_backs()
        ring.drain()
        assert ring.delivered == list(range(800))
        assert ring.send.free_slots() == 65
        assert ring.laps() >= 12
    assert rings[0].wire == rings[1].wire and rings[0].back == rings[1].back


def test_ring_model_rejects_mismatched_sizes() -> None:
    with pytest.raises(ValueError):
        SlotRingModel(10, send=SendBitmapsModel(11))


def test_ring_model_delivers_exactly_k_work_requests() -> None:
    ring = SlotRingModel(16)
    ring.send_batch(3)                          # 3 data writes, then the arrival word
    assert len(ring.wire) == 4
    assert ring.deliver_wire(1) == 1 and len(ring.wire) == 3
    assert ring.deliver_wire(2) == 2 and len(ring.wire) == 1
    assert ring.deliver_wire() == 1 and not ring.wire


def test_the_model_raises_the_public_protocol_error():
    """One ProtocolError: the model's is rdmamw.errors' (catchable as RdmamwError)."""
    from rdmamw.bitmap import model
    from rdmamw.errors import ProtocolError, RdmamwError
    assert model.ProtocolError is ProtocolError and issubclass(model.ProtocolError, RdmamwError)
