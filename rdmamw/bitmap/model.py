"""Pure-Python reference model of the phase-bitmap slot ring (one direction).

Why: the Cython bitmaps in ``_phase.pyx`` are fast but hard to reason about; this
model is slow and obvious, and the property tests drive both side by side and
demand bit-exact agreement (same slots, same dirty spans, same words).

* :class:`SendBitmapsModel` / :class:`RecvBitmapsModel` mirror ``SendBitmaps`` /
  ``RecvBitmaps`` method for method, including the allocation order (round-robin by
  word from a cursor, lowest free bit first, in chunks of at most 64 slots) and the
  dirty-span rules. Word buffers are plain lists of ints.
* :class:`SlotRingModel` is the whole protocol of one direction on top of either
  implementation: sequence-numbered batches, the receiver's ring memory (slot
  headers) and both peer-written bitmap copies, in-order (RC) but arbitrarily
  delayed delivery of the sender's WRITE chain and of the receiver's reclaim
  write-backs, in-order delivery by sequence number, out-of-order release and
  lazy, batched write-back. It also keeps *ghost* counters that no real peer
  could see, so checkers can state the safety properties directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import MutableSequence
from dataclasses import dataclass
from typing import Protocol

# the receiver saw something a correct peer can never produce (e.g. a stale slot): the
# package's own error, as the engine raises it
from rdmamw.errors import ProtocolError

WORD_BITS = 64
WORD_MASK = (1 << WORD_BITS) - 1
U32_MAX = (1 << 32) - 1
#: ``SendBitmaps.alloc_slots`` calls ``alloc`` with at most this many slots at a time;
#: chunking changes where the cursor ends up, so the model must chunk the same way.
ALLOC_CHUNK = 64

Words = MutableSequence[int]


def words_for(nslots: int) -> int:
    """Number of 64-bit words holding ``nslots`` bits."""
    return (nslots + WORD_BITS - 1) >> 6


def tail_mask(nslots: int) -> int:
    """Valid bits of the last word (``rm_tail_mask``)."""
    r = nslots & 63
    return (1 << r) - 1 if r else WORD_MASK


def circular_words(start: int, count: int, nwords: int) -> list[int]:
    """The word indices of the circular span ``(start, count)``."""
    return [(start + k) % nwords for k in range(count)]


def _u32(value: int, what: str) -> int:
    """Mirror Cython's ``uint32_t`` argument conversion (negative/too big overflow)."""
    value = value.__index__()
    if value < 0 or value > U32_MAX:
        raise OverflowError(f"{what}={value} does not fit in uint32_t")
    return value


def _check_nslots(nslots: int) -> int:
    nslots = _u32(nslots, "nslots")
    if nslots == 0:
        raise ValueError("a ring needs at least one slot")
    return nslots


def _words_buffer(buf: Words | None, nwords: int, what: str) -> Words:
    """A peer-written bitmap: our own zeroed list, or the caller's (checked) list."""
    if buf is None:
        return [0] * nwords
    if len(buf) < nwords:
        raise ValueError(f"{what} buffer holds {len(buf)} words, needs {nwords}")
    return buf


def _bits(word: int) -> list[int]:
    """Set bit positions of ``word``, lowest first (the ``ctz`` loop)."""
    out = []
    while word:
        low = word & -word
        out.append(low.bit_length() - 1)
        word ^= low
    return out


class SendBitmapsModel:
    """Sender half: owns the arrival truth, reads the receiver-written reclaim copy."""

    def __init__(self, nslots: int, reclaim: Words | None = None, usable: int = 0) -> None:
        self.nslots = _check_nslots(nslots)
        self.nwords = words_for(self.nslots)
        self.last_mask = tail_mask(self.nslots)
        self.arrival: list[int] = [0] * self.nwords
        self.reclaim: Words = _words_buffer(reclaim, self.nwords, "reclaim")
        self.cursor = 0
        self.dirty_start = 0
        self.dirty_count = 0
        self.usable = 0
        self.grant(usable or self.nslots)

    def grant(self, n: int) -> None:
        """Hand out only slots below ``n`` (what the receiver registered so far); a ring
        only grows."""
        if n < max(1, self.usable) or n > self.nslots:
            raise ValueError(f"usable slots {n} outside [{max(1, self.usable)}, {self.nslots}]")
        self.usable = n

    def _free_bits(self, w: int) -> int:
        free = ~(self.arrival[w] ^ self.reclaim[w]) & WORD_MASK
        if (w + 1) * 64 > self.usable:
            free &= tail_mask(self.usable) if w == (self.usable - 1) // 64 else 0
        return free

    def _mark_dirty(self, w: int) -> None:
        """Grow the circular dirty span forward so that it covers word ``w``."""
        if self.dirty_count == 0:
            self.dirty_start = w
            self.dirty_count = 1
        else:
            d = (w + self.nwords - self.dirty_start) % self.nwords
            self.dirty_count = max(self.dirty_count, d + 1)

    def _alloc(self, n: int) -> list[int]:
        """``SendBitmaps.alloc``: one pass over at most every word, from the cursor."""
        out: list[int] = []
        w = self.cursor
        scanned = 0
        while len(out) < n and scanned < self.nwords:
            free = self._free_bits(w)
            if free:
                while free and len(out) < n:
                    bit = free & -free
                    out.append((w << 6) + bit.bit_length() - 1)
                    self.arrival[w] ^= bit
                    free ^= bit
                self._mark_dirty(w)
                if len(out) == n:
                    break  # the cursor stays on a word that may still have free bits
            w += 1
            if w == self.nwords:
                w = 0
            scanned += 1
        self.cursor = w
        return out

    def alloc_slots(self, n: int) -> list[int]:
        """Up to ``n`` free slots in allocation order (fewer if the ring is short)."""
        n = _u32(n, "n")
        res: list[int] = []
        while n:
            got = self._alloc(min(n, ALLOC_CHUNK))
            res.extend(got)
            if not got:
                break
            n -= len(got)
        return res

    def free_slots(self) -> int:
        return sum(self._free_bits(w).bit_count() for w in range(self.nwords))

    def take_dirty_words(self) -> tuple[int, int] | None:
        """(start, count): the circular span of arrival words to publish; resets it."""
        if self.dirty_count == 0:
            return None
        span = (self.dirty_start, self.dirty_count)
        self.dirty_count = 0
        return span

    @property
    def arrival_words(self) -> list[int]:
        return self.arrival

    @property
    def reclaim_words(self) -> Words:
        return self.reclaim


class RecvBitmapsModel:
    """Receiver half: reads the sender-written arrival copy, owns the reclaim truth."""

    def __init__(self, nslots: int, arrival: Words | None = None) -> None:
        self.nslots = _check_nslots(nslots)
        self.nwords = words_for(self.nslots)
        self.last_mask = tail_mask(self.nslots)
        self.arrival: Words = _words_buffer(arrival, self.nwords, "arrival")
        self.consumed: list[int] = [0] * self.nwords
        self.reclaim: list[int] = [0] * self.nwords
        self.unflushed = 0
        self.dirty_lo = self.nwords
        self.dirty_hi = 0

    def _slot(self, slot: int) -> tuple[int, int]:
        slot = _u32(slot, "slot")
        if slot >= self.nslots:
            raise IndexError(slot)
        return slot >> 6, 1 << (slot & 63)

    def pending_slots(self) -> list[int]:
        """Arrived, not yet consumed slots, in index order."""
        out: list[int] = []
        for w in range(self.nwords):
            p = (self.arrival[w] ^ self.consumed[w]) & WORD_MASK
            if w == self.nwords - 1:
                p &= self.last_mask
            out.extend((w << 6) + b for b in _bits(p))
        return out

    def is_outstanding(self, slot: int) -> bool:
        """Delivered (consumed) and not yet released."""
        w, bit = self._slot(slot)
        return bool((self.consumed[w] ^ self.reclaim[w]) & bit)

    def consume_slot(self, slot: int) -> None:
        w, bit = self._slot(slot)
        if not ((self.arrival[w] ^ self.consumed[w]) & bit):
            raise ValueError(f"slot {slot} has not arrived")
        self.consumed[w] ^= bit

    def release_slot(self, slot: int) -> None:
        if not self.is_outstanding(slot):
            raise ValueError(f"slot {slot} is not delivered-and-unreleased")
        w, bit = self._slot(slot)
        self.reclaim[w] ^= bit
        self.unflushed += 1
        self.dirty_lo = min(self.dirty_lo, w)
        self.dirty_hi = max(self.dirty_hi, w + 1)

    def take_dirty_words(self) -> tuple[int, int] | None:
        """[lo, hi): the linear span of reclaim words to write back; resets it."""
        if self.dirty_hi == 0:
            return None
        span = (self.dirty_lo, self.dirty_hi)
        self.dirty_lo = self.nwords
        self.dirty_hi = 0
        self.unflushed = 0
        return span

    @property
    def arrival_words(self) -> Words:
        return self.arrival

    @property
    def reclaim_words(self) -> list[int]:
        return self.reclaim

    @property
    def consumed_words(self) -> list[int]:
        return self.consumed


# ---------------------------------------------------------------- the whole protocol


class SendSide(Protocol):
    """What :class:`SlotRingModel` needs from a sender (Cython or model)."""

    nslots: int
    usable: int

    def alloc_slots(self, n: int) -> list[int]: ...
    def grant(self, n: int) -> None: ...
    def free_slots(self) -> int: ...
    def take_dirty_words(self) -> tuple[int, int] | None: ...
    @property
    def arrival_words(self) -> Words: ...
    @property
    def reclaim_words(self) -> Words: ...


class RecvSide(Protocol):
    """What :class:`SlotRingModel` needs from a receiver (Cython or model)."""

    nslots: int
    unflushed: int

    def pending_slots(self) -> list[int]: ...
    def consume_slot(self, slot: int) -> None: ...
    def release_slot(self, slot: int) -> None: ...
    def is_outstanding(self, slot: int) -> bool: ...
    def take_dirty_words(self) -> tuple[int, int] | None: ...
    @property
    def arrival_words(self) -> Words: ...
    @property
    def reclaim_words(self) -> Words: ...


@dataclass
class DataWrite:
    """RDMA WRITE of one slot; only its header (the sequence number) is modelled."""

    slot: int
    seq: int


@dataclass
class ArrivalWrite:
    """RDMA WRITE of arrival words, snapshotted at post time.

    A snapshot (a staging copy), not the live shadow: a live read at execution time
    could carry the bit of a slot allocated later whose data WRITE is still behind
    this one in the send queue, i.e. an arrival bit ahead of its data.
    """

    start: int
    count: int
    words: list[tuple[int, int]]  # (word index, value)


@dataclass
class ReclaimWrite:
    """RDMA WRITE of reclaim words [lo, hi) back to the sender.

    ``released`` is ghost state: each covered slot's release count when the words were
    read, i.e. exactly which releases this write makes visible to the sender.
    """

    lo: int
    hi: int
    words: list[int]
    released: list[int]


class SlotRingModel:
    """One direction of a channel: sender, wire, receiver, and the way back.

    The sender's WRITE chain and the receiver's write-backs each travel on an RC
    queue pair: executed in posting order, but as late as the caller likes
    (:meth:`deliver_wire`, :meth:`land_write_backs`). Pass ``send``/``recv`` to run the
    protocol on the Cython bitmaps; by default it runs on the Python models.
    """

    def __init__(
        self,
        nslots: int,
        *,
        send: SendSide | None = None,
        recv: RecvSide | None = None,
        flush_fraction: int = 4,
    ) -> None:
        self.send = send if send is not None else SendBitmapsModel(nslots)
        self.recv = recv if recv is not None else RecvBitmapsModel(nslots)
        if self.send.nslots != nslots or self.recv.nslots != nslots:
            raise ValueError("sender, receiver and ring disagree on nslots")
        self.nslots = nslots
        self.nwords = words_for(nslots)
        # Fetch the word views once: the Cython properties build a new view per access.
        self.arrival_truth = self.send.arrival_words  # sender's shadow (the truth)
        self.arrival_remote = self.recv.arrival_words  # receiver memory, sender-written
        self.reclaim_truth = self.recv.reclaim_words  # receiver's shadow (the truth)
        self.reclaim_remote = self.send.reclaim_words  # sender memory, receiver-written
        self.headers: list[int | None] = [None] * nslots  # receiver ring memory: slot seq
        self.wire: deque[DataWrite | ArrivalWrite] = deque()  # sender -> receiver, in order
        self.back: deque[ReclaimWrite] = deque()  # receiver -> sender, in order
        #: Lazy write-back: flush once a quarter of the ring is released-but-unflushed.
        self.flush_threshold = max(1, nslots // flush_fraction)
        #: The sender ran out of slots: the receiver flushes at its next release.
        self.credit_wanted = False
        self.next_seq = 0  # sender: sequence number of the next message
        self.expected = 0  # receiver: next sequence number to deliver
        self.outstanding: dict[int, int] = {}  # slot -> seq, delivered and unreleased
        # ghost state, for checkers only
        self.uses = [0] * nslots  # allocations of each slot
        self.last_seq = [-1] * nslots  # seq of each slot's latest allocation
        self.releases = [0] * nslots  # releases of each slot at the receiver
        self.visible_releases = [0] * nslots  # releases the sender's reclaim copy shows
        self.delivered: list[int] = []  # seqs in delivery order

    # ---- sender
    def send_batch(self, n: int, publish: bool = True) -> list[tuple[int, int]]:
        """Allocate up to ``n`` slots, number them, post their data WRITEs and (if
        ``publish``) the changed arrival words last in the same chain."""
        slots = self.send.alloc_slots(n)
        if len(slots) < n:
            self.credit_wanted = True
        batch = []
        for slot in slots:
            seq = self.next_seq
            self.next_seq += 1
            self.uses[slot] += 1
            self.last_seq[slot] = seq
            batch.append((slot, seq))
        arrival = self._arrival_write() if publish else None
        self._post_chain([DataWrite(slot, seq) for slot, seq in batch], arrival)
        return batch

    def publish(self) -> tuple[int, int] | None:
        """Post the arrival words changed since the last publication (lazy publish)."""
        wr = self._arrival_write()
        self._post_chain([], wr)
        return None if wr is None else (wr.start, wr.count)

    def _arrival_write(self) -> ArrivalWrite | None:
        span = self.send.take_dirty_words()
        if span is None:
            return None
        start, count = span
        words = [(w, int(self.arrival_truth[w])) for w in self._arrival_span(start, count)]
        return ArrivalWrite(start, count, words)

    def _arrival_span(self, start: int, count: int) -> list[int]:
        return circular_words(start, count, self.nwords)

    def _post_chain(self, data: list[DataWrite], arrival: ArrivalWrite | None) -> None:
        """Data first, arrival words last: RC executes a QP's WRs in order."""
        self.wire.extend(data)
        if arrival is not None:
            self.wire.append(arrival)

    def deliver_wire(self, k: int | None = None) -> int:
        """Execute up to ``k`` (default: all) in-flight sender WRs; return how many."""
        done = 0
        while self.wire and (k is None or done < k):
            self._execute_send_wr(self.wire.popleft())
            done += 1
        return done

    def _execute_send_wr(self, wr: DataWrite | ArrivalWrite) -> None:
        if isinstance(wr, DataWrite):
            self.headers[wr.slot] = wr.seq
        else:
            for w, value in wr.words:
                self.arrival_remote[w] = value

    # ---- receiver
    def receive(self) -> list[tuple[int, int]]:
        """Scan for arrived slots and deliver, in sequence order, the contiguous run
        starting at the next expected sequence number; return (slot, seq) pairs."""
        arrived = []
        for slot in self.recv.pending_slots():
            seq = self.headers[slot]
            if seq is None or seq < self.expected:
                raise ProtocolError(
                    f"slot {slot} is marked arrived but its header says {seq!r} "
                    f"(next expected seq {self.expected}): arrival bit ahead of its data"
                )
            arrived.append((seq, slot))
        arrived.sort()
        out = []
        for seq, slot in arrived:
            if seq != self.expected:
                break  # a gap: a later message arrived first, wait for the missing one
            self.recv.consume_slot(slot)
            self.outstanding[slot] = seq
            self.delivered.append(seq)
            self.expected += 1
            out.append((slot, seq))
        return out

    def release(self, slot: int) -> tuple[int, int] | None:
        """Release a delivered slot (any order); flush lazily; return the flushed span."""
        if slot not in self.outstanding:
            raise ValueError(f"slot {slot} is not delivered-and-unreleased")
        self.recv.release_slot(slot)
        del self.outstanding[slot]
        self.releases[slot] += 1
        if self.recv.unflushed >= self.flush_threshold or self.credit_wanted:
            return self.flush()
        return None

    def flush(self, coalesce: bool = False) -> tuple[int, int] | None:
        """Post one WRITE of the changed reclaim words. With ``coalesce``, every
        write-back still queued is folded into it (one WRITE of the union span with
        the current words — newer words only ever carry more releases)."""
        span = self.recv.take_dirty_words()
        if span is None:
            return None
        lo, hi = span
        if coalesce and self.back:
            lo = min(lo, *(e.lo for e in self.back))
            hi = max(hi, *(e.hi for e in self.back))
            self.back.clear()
        self.back.append(self._reclaim_write(lo, hi))
        self.credit_wanted = False
        return span

    def _reclaim_write(self, lo: int, hi: int) -> ReclaimWrite:
        words = [int(self.reclaim_truth[w]) for w in range(lo, hi)]
        released = self.releases[lo << 6 : min(hi << 6, self.nslots)]
        return ReclaimWrite(lo, hi, words, released)

    def land_write_backs(self, k: int | None = None) -> int:
        """Execute up to ``k`` (default: all) in-flight write-backs, oldest first."""
        done = 0
        while self.back and (k is None or done < k):
            self._execute_write_back(self.back.popleft())
            done += 1
        return done

    def _execute_write_back(self, wr: ReclaimWrite) -> None:
        for w in range(wr.lo, wr.hi):
            self._store_reclaim_word(wr, w)

    def _store_reclaim_word(self, wr: ReclaimWrite, w: int) -> None:
        self.reclaim_remote[w] = wr.words[w - wr.lo]
        base = wr.lo << 6
        for slot in range(w << 6, min((w + 1) << 6, self.nslots)):
            self.visible_releases[slot] = wr.released[slot - base]

    # ---- whole-ring helpers
    def drain(self, max_rounds: int = 4) -> None:
        """Quiesce: publish, deliver, release everything, flush, land. A few rounds, so
        a stuck protocol shows up as leftovers rather than as a hang."""
        for _ in range(max_rounds):
            self.publish()
            self.deliver_wire()
            self.receive()
            for slot in sorted(self.outstanding):
                self.release(slot)
            self.flush()
            self.land_write_backs()
            if not self.wire and not self.back and self.expected == self.next_seq:
                return

    def laps(self) -> int:
        """How many times the busiest slot has been used."""
        return max(self.uses)
