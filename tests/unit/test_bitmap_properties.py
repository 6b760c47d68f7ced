"""Stateful property tests of the phase-bitmap slot ring.

Hypothesis drives two copies of the whole one-direction protocol
(:class:`rdmamw.bitmap.model.SlotRingModel`) with identical random interleavings:
one on the Cython ``SendBitmaps``/``RecvBitmaps``, one on the pure-Python models.
Both must return the same thing at every operation and agree bit for bit (all
four bitmaps, consumed words, in-flight WRITEs) after every rule and every burst
round; the safety properties are checked against the model's ghost counters:

* a slot is reused only once its previous release is visible to the sender;
* every message is delivered exactly once, in send order, and none is stale;
* nothing leaks: after a final drain the sender sees the whole ring free.

``test_broken_variant_is_caught`` runs the same machine on deliberately broken
variants (four protocol bugs, one model drift) and demands that Hypothesis finds a
counterexample for the right reason. Slow-marked variants: ``test_slot_ring_long``
(~50 s) and ``test_broken_variant_minimal_example`` (shrunk counterexamples).
"""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from rdmamw.bitmap import RecvBitmaps, SendBitmaps
from rdmamw.bitmap.model import (
    ArrivalWrite,
    DataWrite,
    ProtocolError,
    ReclaimWrite,
    SendBitmapsModel,
    SlotRingModel,
)

# Word-boundary sizes are over-represented on purpose; the rest is uniform.
RING_SIZES = st.one_of(
    st.sampled_from([1, 2, 3, 63, 64, 65, 127, 128, 129, 191, 200]),
    st.integers(1, 200),
)
#: A burst runs up to this many rounds, or until it has sent this many messages.
BURST_ROUNDS = 300
BURST_MESSAGES = 4000
#: ... and all bursts of one example together stop after this many (time budget).
EXAMPLE_MESSAGES = 20000
EXAMPLE_ROUNDS = 2000


def words(buf: Any) -> list[int]:
    """Plain ints from a Cython word view or a model list."""
    return np.asarray(buf, dtype=np.uint64).tolist()


def bits(buf: Any, nslots: int) -> np.ndarray:
    """One bool per slot from a bitmap (bit i of word w is slot 64*w + i)."""
    raw = np.asarray(buf, dtype="<u8").view(np.uint8)
    return np.unpackbits(raw, bitorder="little")[:nslots].astype(bool)


class SlotRingMachine(RuleBasedStateMachine):
    """One direction of a channel, twice (Cython ``c`` and model ``m``), in lockstep."""

    #: Broken variants in the teeth tests replace this with a buggy subclass.
    ring_class: type[SlotRingModel] = SlotRingModel
    #: The model-side sender; the differential teeth test swaps in a drifted one.
    send_model: type[SendBitmapsModel] = SendBitmapsModel
    burst_messages = BURST_MESSAGES
    example_messages = EXAMPLE_MESSAGES
    example_rounds = EXAMPLE_ROUNDS

    def __init__(self) -> None:
        super().__init__()
        self.c: SlotRingModel | None = None
        self.m: SlotRingModel | None = None
        self.rounds = 0

    @initialize(nslots=RING_SIZES, eighths=st.integers(1, 8))
    def make_rings(self, nslots: int, eighths: int = 8) -> None:
        """A ring of which the receiver granted ``eighths``/8 at first (it grows)."""
        self.nslots = nslots
        usable = max(1, nslots * eighths // 8)
        self.c = self.ring_class(nslots, send=SendBitmaps(nslots, usable=usable),
                                 recv=RecvBitmaps(nslots))
        self.m = self.ring_class(nslots, send=self.send_model(nslots, usable=usable))

    # ---- lockstep plumbing
    def both(self, name: str, *args: Any, check: bool = True) -> Any:
        """Run one protocol step on both rings; they must return the same thing.
        ``check=False`` (inside a loop of releases) defers the full comparison."""
        rc = getattr(self.c, name)(*args)
        rm = getattr(self.m, name)(*args)
        assert rc == rm, f"{name}{args}: cython returned {rc!r}, model {rm!r}"
        if check:
            self.check()
        return rm

    def release_all(self, slots: list[int], check: bool = True) -> None:
        for slot in slots:
            self.both("release", slot, check=False)
        if check:
            self.check()

    def check(self) -> None:
        c, m = self.c, self.m
        assert c is not None and m is not None
        for attr in ("arrival_truth", "arrival_remote", "reclaim_truth", "reclaim_remote"):
            assert words(getattr(c, attr)) == words(getattr(m, attr)), attr
        assert words(c.recv.consumed_words) == words(m.recv.consumed_words)
        assert c.send.free_slots() == m.send.free_slots()
        assert c.recv.unflushed == m.recv.unflushed
        pending = m.recv.pending_slots()
        assert c.recv.pending_slots() == pending
        assert (c.wire, c.back) == (m.wire, m.back)
        self.check_ghost(m, pending)

    def check_ghost(self, m: SlotRingModel, pending: list[int]) -> None:
        """The bitmaps' view must match what really happened to each slot."""
        uses, rel, vis = (np.array(x) for x in (m.uses, m.releases, m.visible_releases))
        # a release becomes visible only after it happened, and the sender never gets
        # more than one use ahead of what it has seen released
        ok = (vis >= 0) & (vis <= rel) & (rel <= uses) & (uses <= vis + 1)
        assert ok.all(), f"ghost counters broken at slots {np.flatnonzero(~ok).tolist()}"
        sender_busy = bits(m.arrival_truth, self.nslots) ^ bits(m.reclaim_remote, self.nslots)
        wrong = np.flatnonzero(sender_busy != (uses != vis)).tolist()
        assert not wrong, f"sender's free view is wrong for slots {wrong}"
        outstanding = bits(m.recv.consumed_words, self.nslots) ^ bits(m.reclaim_truth, self.nslots)
        assert np.flatnonzero(outstanding).tolist() == sorted(m.outstanding)
        for slot in pending:
            # the arrival bit is never ahead of the slot's data
            assert m.headers[slot] == m.last_seq[slot], f"slot {slot} pending with stale data"

    # ---- protocol steps with their per-step properties
    def do_send(self, n: int, publish: bool, check: bool = True) -> None:
        m = self.m
        uses, visible = list(m.uses), list(m.visible_releases)
        first = m.next_seq
        batch = self.both("send_batch", n, publish, check=check)
        slots = [slot for slot, _ in batch]
        assert len(slots) <= n and len(set(slots)) == len(slots)
        assert [seq for _, seq in batch] == list(range(first, first + len(batch)))
        for slot in slots:
            assert visible[slot] == uses[slot], (
                f"slot {slot} reused before its release was visible to the sender"
            )
        if len(slots) < n:
            assert m.send.free_slots() == 0, "alloc returned fewer slots than were free"

    def do_receive(self, check: bool = True) -> None:
        first = self.m.expected
        got = self.both("receive", check=check)
        assert [seq for _, seq in got] == list(range(first, first + len(got)))
        assert self.m.delivered[first:] == [seq for _, seq in got]

    # ---- rules
    @rule(data=st.data(), publish=st.booleans())
    def send(self, data: st.DataObject, publish: bool) -> None:
        # up to one and a half rings: batches often exceed the free space
        self.do_send(data.draw(st.integers(0, self.nslots + self.nslots // 2 + 2)), publish)

    @rule()
    def publish(self) -> None:
        self.both("publish")

    @rule(k=st.one_of(st.none(), st.integers(1, 8)))
    def deliver_wire(self, k: int | None) -> None:
        self.both("deliver_wire", k)

    @rule()
    def receive(self) -> None:
        self.do_receive()

    @rule(data=st.data())
    def release_some(self, data: st.DataObject) -> None:
        """Release delivered slots in any order (no precondition: empty is a no-op)."""
        order = data.draw(st.permutations(sorted(self.m.outstanding)))
        self.release_all(order[: data.draw(st.integers(0, len(order)))])

    @rule(extra=st.integers(1, 64))
    def grant(self, extra: int) -> None:
        """The receiver registers more of its ring: the sender may use more slots."""
        n = min(self.nslots, self.m.send.usable + extra)
        self.c.send.grant(n)
        self.m.send.grant(n)
        self.check()

    @rule(coalesce=st.booleans())
    def flush(self, coalesce: bool) -> None:
        self.both("flush", coalesce)

    @rule(k=st.one_of(st.none(), st.integers(1, 4)))
    def land_write_backs(self, k: int | None) -> None:
        self.both("land_write_backs", k)

    @rule(seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, BURST_ROUNDS))
    def burst(self, seed: int, rounds: int) -> None:
        """Many rounds of random traffic in one step: this is what wraps the ring tens to
        hundreds of times. Return values are compared at every operation, the whole
        state once per round (per operation it would cost most of the time budget)."""
        rnd = random.Random(seed)
        n = self.nslots
        budget = min(self.m.next_seq + self.burst_messages, self.example_messages)
        for _ in range(rounds):
            if self.m.next_seq >= budget or self.rounds >= self.example_rounds:
                break  # keeps the slowest examples bounded
            self.rounds += 1
            self.do_send(rnd.randint(0, n + n // 2 + 1), rnd.random() < 0.75, check=False)
            if rnd.random() < 0.2:
                self.both("publish", check=False)
            k = rnd.randint(0, len(self.m.wire)) if rnd.random() < 0.5 else None
            self.both("deliver_wire", k, check=False)
            self.do_receive(check=False)
            out = sorted(self.m.outstanding)
            rnd.shuffle(out)
            self.release_all(out[: rnd.randint(0, len(out))], check=False)
            if rnd.random() < 0.3:
                self.both("flush", rnd.random() < 0.5, check=False)
            k = rnd.randint(0, len(self.m.back)) if rnd.random() < 0.6 else None
            self.both("land_write_backs", k, check=False)
            self.check()

    def teardown(self) -> None:
        if self.m is None:
            return
        self.both("drain")
        if currently_in_test_context():
            laps, n = self.m.laps(), self.nslots
            size = "<=8" if n <= 8 else "9-64" if n <= 64 else ">64"
            many = ">=100" if laps >= 100 else "10-99" if laps >= 10 else "<10"
            event(f"ring {size}, laps {many}")
        for ring in (self.c, self.m):
            assert ring.delivered == list(range(ring.next_seq)), "a message was lost"
            assert not ring.outstanding and ring.recv.pending_slots() == []
            assert ring.recv.unflushed == 0
            assert ring.send.free_slots() == ring.send.usable, "slots leaked"


FAST = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SlotRingMachine.TestCase.settings = FAST
TestSlotRing = SlotRingMachine.TestCase


class LongSlotRingMachine(SlotRingMachine):
    burst_messages = 4 * BURST_MESSAGES
    example_messages = 4 * EXAMPLE_MESSAGES
    example_rounds = 4 * EXAMPLE_ROUNDS


@pytest.mark.slow
def test_slot_ring_long() -> None:
    """More and longer examples, with four times the traffic per burst."""
    run_state_machine_as_test(
        LongSlotRingMachine,
        settings=settings(FAST, max_examples=120, stateful_step_count=50),
    )


@pytest.mark.parametrize("nslots", [1, 7, 63, 64, 65, 128, 200])
def test_hundreds_of_laps(nslots: int) -> None:
    """Deterministic long haul: random bursts in lockstep until the ring has wrapped
    200 times (hypothesis examples rarely get that far on the larger rings)."""
    machine = SlotRingMachine()
    machine.make_rings(nslots)
    machine.example_messages = machine.example_rounds = 10**9
    for seed in range(200):
        machine.burst(seed, BURST_ROUNDS)
        if machine.m.laps() >= 200:
            break
    assert machine.m.laps() >= 200, machine.m.laps()
    machine.teardown()


# ---------------------------------------------------------------- teeth


class SkipFirstWordWriteBack(SlotRingModel):
    """Bug: the write-back copies words [lo+1, hi) instead of [lo, hi)."""

    def _execute_write_back(self, wr: ReclaimWrite) -> None:
        for w in range(wr.lo + 1, wr.hi):
            self._store_reclaim_word(wr, w)


class ArrivalBeforeData(SlotRingModel):
    """Bug: the arrival words are posted first in the chain, before the data WRITEs."""

    def _post_chain(self, data: list[DataWrite], arrival: ArrivalWrite | None) -> None:
        if arrival is not None:
            self.wire.append(arrival)
        self.wire.extend(data)


class LinearArrivalSpan(SlotRingModel):
    """Bug: the circular dirty span is published as if linear; wrapped words are lost."""

    def _arrival_span(self, start: int, count: int) -> list[int]:
        return list(range(start, min(start + count, self.nwords)))


class NewestWriteBackFirst(SlotRingModel):
    """Bug: write-backs land newest first (e.g. spread over several QPs), so an old
    snapshot can overwrite a newer one."""

    def land_write_backs(self, k: int | None = None) -> int:
        done = 0
        while self.back and (k is None or done < k):
            self._execute_write_back(self.back.pop())
            done += 1
        return done


class UnchunkedAllocModel(SendBitmapsModel):
    """Model drift: one ``alloc`` call per batch instead of chunks of 64. Same slots
    taken, but the cursor can end on a different word, so later batches diverge."""

    def alloc_slots(self, n: int) -> list[int]:
        return self._alloc(n)


#: (protocol variant, sender model, what the failure must be about)
BROKEN = {
    "skip-first-word-write-back": (SkipFirstWordWriteBack, None, "leaked|visible|free view"),
    "arrival-before-data": (ArrivalBeforeData, None, "ahead of its data|stale"),
    "linear-arrival-span": (LinearArrivalSpan, None, "lost"),
    "newest-write-back-first": (NewestWriteBackFirst, None, "leaked|visible|free view|ghost"),
    "model-unchunked-alloc": (SlotRingModel, UnchunkedAllocModel, "cython returned"),
}


def hunt(name: str, shrink: bool) -> BaseException:
    """Run the property machine on a broken variant; return the failure it finds."""
    ring, send_model, _ = BROKEN[name]
    attrs: dict[str, Any] = {"ring_class": ring}
    if send_model is not None:
        attrs["send_model"] = send_model
    machine = type(f"Broken{ring.__name__}", (SlotRingMachine,), attrs)
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    with pytest.raises((AssertionError, ProtocolError)) as info:
        run_state_machine_as_test(
            machine,
            settings=settings(
                FAST,
                max_examples=200,
                derandomize=True,  # deterministic: the same counterexample every run
                database=None,
                report_multiple_bugs=False,
                print_blob=False,
                phases=phases,  # never the slow "explain" phase
            ),
        )
    return info.value


def _check_caught(name: str, shrink: bool) -> None:
    err = hunt(name, shrink)
    report = f"{name}: {type(err).__name__}: {err}"
    print(report)
    print("\n".join(getattr(err, "__notes__", [])))
    assert re.search(BROKEN[name][2], report), report


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_variant_is_caught(name: str) -> None:
    _check_caught(name, shrink=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_variant_minimal_example(name: str) -> None:
    """Same, shrunk to a minimal counterexample (slow: shrinking replays long bursts)."""
    _check_caught(name, shrink=True)
