# cython: freethreading_compatible = False
"""Eager receive: scan the arrival bitmap word-at-a-time, put arrived slots in
sequence order, check every header and record before anything is handed out, and
count the messages of each slot still held; a slot goes back (reclaim bit) when all
are released, and the reclaim words travel back lazily, in batches."""

cimport cython
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from rdmamw.engine._frames cimport (
    CTRL_CREDIT_WAIT,
    CTRL_RNDV_DONE,
    DESC_BYTES,
    REC_HDR,
    REC_RNDV,
    RM_NO_SLOT,
    SLOT_HEADER,
    SLOT_PACKED,
    SLOT_SINGLE,
    WORD_DONE,
    rm_slot_hdr,
)
from rdmamw.transport._base cimport (
    RM_REGION_RECLAIM,
    RM_REGION_RING,
    RM_WR_PUBLISH,
    RM_WR_WRITE,
    now_ns,
    rm_wr,
)
from rdmamw.transport.atomics cimport rm_copy, rm_fence_seq_cst, rm_load_acquire64

from rdmamw.transport import layout

cdef uint32_t RECV_CALL_BYTES = 1 << 20 # slot memory one recv_batch call may hand out
cdef uint32_t FLUSH_BYTES = 1 << 18     # slot memory released before a lazy write-back
cdef uint32_t NOGIL_COPY = 16384        # recv_many_into copies a slot from this size on
                                        # without the GIL (as a send its batch)


@cython.final
cdef class EagerReceiver:
    """The receiving half of the slot ring: my ring, its arrivals and reclaims."""

    def __cinit__(self, Link link, uint32_t nslots, uint32_t slot_size, arrival,
                  double gap_timeout, double flush_fraction, bint ack):
        self.link = link
        self.nslots, self.slot_size = nslots, slot_size
        self.stride = layout.slot_stride(slot_size)
        if link.local_length(RM_REGION_RING) < <uint64_t>nslots * self.stride:
            raise ValueError("transport ring region is smaller than the ring")
        self.ring = link.local_addr(RM_REGION_RING)
        self.rbm = RecvBitmaps(nslots, arrival)
        self.pend = <uint32_t *>malloc(4 * nslots)
        self.pend_d = <uint32_t *>malloc(4 * nslots)
        self.order = <uint32_t *>malloc(4 * nslots)
        self.ready = <uint32_t *>malloc(4 * nslots)
        self.slot_refs = <uint32_t *>malloc(4 * nslots)
        if (self.pend == NULL or self.pend_d == NULL or self.order == NULL
                or self.ready == NULL or self.slot_refs == NULL):
            raise MemoryError()
        memset(self.order, 0xFF, 4 * nslots)
        memset(self.slot_refs, 0, 4 * nslots)
        self.lkey_reclaim = link.register_local(<size_t>self.rbm.reclaim, self.rbm.nwords * 8)
        self.cur_slot = RM_NO_SLOT
        self.gap_timeout_ns = <int64_t>(gap_timeout * 1e9)
        # per receive call: at most a quarter of the ring and about RECV_CALL_BYTES of
        # slots, so a caller holding the previous list never starves the sender and
        # big slots come back in small groups
        self.max_open = max(1, min(nslots // 4, RECV_CALL_BYTES // self.stride))
        # write releases back after a quarter of the ring, or sooner when slots are big
        self.flush_threshold = max(1, min(<uint32_t>(nslots * flush_fraction),
                                          FLUSH_BYTES // self.stride))
        if ack:
            self.flush_threshold = 1

    def __dealloc__(self):
        free(self.pend); free(self.pend_d); free(self.order); free(self.ready)
        free(self.slot_refs)

    cdef int fill_ready(self) except -1:
        """Move arrived slots, in sequence order, to the ready queue. The first look is
        at the one word where the next slot most likely is (the sender takes slots in
        ring order: next_word follows the last slot delivered); only when that word
        does not hold the next sequence number is the whole bitmap scanned."""
        cdef uint32_t k, delivered
        cdef int64_t t
        k = self.rbm.pending_word(self.pend, self.next_word)
        if k:
            delivered = self.place(k)
            if delivered:
                self.gap_since = 0
                return delivered
        k = self.rbm.pending(self.pend, self.nslots)
        if k == 0:
            self.gap_since = 0
            return 0
        delivered = self.place(k)
        if delivered:
            self.gap_since = 0
        else:
            t = now_ns()
            self.gap_pending = k
            if self.gap_since == 0:
                self.gap_since = t
            elif t - self.gap_since > self.gap_timeout_ns:
                self.link.fail(f"sequence number {self.recv_seq} never arrived while later "
                               f"slots did")
        return delivered

    cdef uint32_t place(self, uint32_t k) except? 0xFFFFFFFF:
        """The k slots in ``pend``: each header checked, then those that continue the
        sequence (from recv_seq) moved to the ready queue and consumed; how many. One
        slot that is the next in sequence goes without the ordering array."""
        cdef uint32_t i, j, s, d, delivered = 0
        cdef rm_slot_hdr *h
        cdef uint64_t seq
        cdef uint32_t check
        if k == 1:      # (most looks at batch 1: one slot, the next in sequence)
            s = self.pend[0]
            h = <rm_slot_hdr *>(self.ring + <size_t>s * self.stride)
            seq = (<volatile uint64_t *>&h.seq)[0]
            check = (<volatile uint32_t *>&h.check)[0]
            if seq == self.recv_seq and check == <uint32_t>~(<uint32_t>seq):
                self.ready[(self.ready_head + self.ready_len) % self.nslots] = s
                self.ready_len += 1
                self.rbm.consume(s)
                self.next_word = ((s + 1) % self.nslots) >> 6
                self.recv_seq += 1
                return 1
        for j in range(k):
            s = self.pend[j]
            h = <rm_slot_hdr *>(self.ring + <size_t>s * self.stride)
            seq = (<volatile uint64_t *>&h.seq)[0]
            check = (<volatile uint32_t *>&h.check)[0]
            d = <uint32_t>(seq - self.recv_seq) if seq - self.recv_seq < self.nslots else RM_NO_SLOT
            if (d == RM_NO_SLOT or check != <uint32_t>~(<uint32_t>seq)
                    or self.order[d] != RM_NO_SLOT):
                for i in range(j):
                    self.order[self.pend_d[i]] = RM_NO_SLOT
                self.link.fail(
                    f"slot {s} carries sequence number {seq} (check {check:#x}); "
                    f"expected one of {self.recv_seq}..{self.recv_seq + self.nslots - 1}, "
                    f"each once")
            self.order[d] = s
            self.pend_d[j] = d
        while delivered < self.nslots and self.order[delivered] != RM_NO_SLOT:
            s = self.order[delivered]
            self.ready[(self.ready_head + self.ready_len) % self.nslots] = s
            self.ready_len += 1
            self.rbm.consume(s)
            delivered += 1
        if delivered:
            self.next_word = ((s + 1) % self.nslots) >> 6
        for j in range(k):
            self.order[self.pend_d[j]] = RM_NO_SLOT
        self.recv_seq += delivered
        return delivered

    cdef int open_slot(self) except -1:
        """Open the next ready slot: its header is read once and checked."""
        cdef uint32_t s = self.ready[self.ready_head]
        cdef rm_slot_hdr h = (<rm_slot_hdr *>(self.ring + <size_t>s * self.stride))[0]
        self.ready_head = (self.ready_head + 1) % self.nslots
        self.ready_len -= 1
        if h.used > self.slot_size or h.count == 0 or not (
                (h.flags == SLOT_SINGLE and h.count == 1)
                or (h.flags == SLOT_PACKED and <uint64_t>h.count * REC_HDR <= h.used)):
            self.link.fail(f"slot {s} (seq {h.seq}) has a malformed header: used={h.used} "
                           f"count={h.count} flags={h.flags}")
        self.cur_slot = s
        self.cur_left = h.count
        self.cur_off = 0
        self.cur_used = h.used
        self.cur_flags = h.flags
        self.slot_refs[s] = h.count
        return 0

    cdef int peek(self, char **pbase, uint32_t *plen, uint32_t *pflags) except -1:
        """Point at the next message without consuming it: 1 if there is one, else 0."""
        cdef char *base
        cdef uint32_t L, fl = 0
        if self.cur_left == 0:
            if self.ready_len == 0:
                self.fill_ready()
                if self.ready_len == 0:
                    return 0
            self.open_slot()
        base = self.ring + <size_t>self.cur_slot * self.stride + SLOT_HEADER
        if self.cur_flags == SLOT_SINGLE:
            L = self.cur_used
        else:
            if self.cur_off + REC_HDR > self.cur_used:
                self.link.fail(f"slot {self.cur_slot}: record {self.cur_off} past used bytes")
            L = (<volatile uint32_t *>(base + self.cur_off))[0]
            fl = (<volatile uint32_t *>(base + self.cur_off))[1]
            if L > self.cur_used - self.cur_off - REC_HDR:
                self.link.fail(f"slot {self.cur_slot}: record of {L} bytes overruns the slot")
            if fl > REC_RNDV or (fl == REC_RNDV and L != DESC_BYTES):
                self.link.fail(f"slot {self.cur_slot}: record flags {fl} with {L} bytes")
            base += self.cur_off + REC_HDR
        pbase[0] = base
        plen[0] = L
        pflags[0] = fl
        return 1

    cdef Py_ssize_t copy_many(self, char *dst, size_t room, void *lens, bint wide,
                              Py_ssize_t maxn) except -1:
        """recv_many_into: copy the eager messages at the head of the ring into ``dst``,
        back to back (at most ``room`` bytes and ``maxn`` messages), their lengths into
        ``lens`` (put_len); how many. Each is consumed as it is copied and its slot goes
        back once all of its messages are. It stops before a rendezvous record or a
        malformed one (left for peek: the next call's first look), before a message
        that does not fit (0: the first did not), and when the slots found ready are
        used up (one look at the arrival bitmap per call, as take_eager). Slots of
        NOGIL_COPY bytes or more are copied without the GIL."""
        cdef Py_ssize_t n = 0, k
        cdef size_t off = 0
        cdef uint32_t s, L
        while n < maxn:
            if self.cur_left == 0:
                if self.ready_len == 0:
                    if n:
                        break
                    self.fill_ready()
                    if self.ready_len == 0:
                        break
                self.open_slot()
            s = self.cur_slot
            if self.cur_flags == SLOT_SINGLE:
                L = self.cur_used
                if L > room - off:
                    break
                if L >= NOGIL_COPY:
                    with nogil:
                        memcpy(dst + off, self.ring + <size_t>s * self.stride + SLOT_HEADER, L)
                else:
                    memcpy(dst + off, self.ring + <size_t>s * self.stride + SLOT_HEADER, L)
                put_len(lens, wide, n, L)
                off += L
                n += 1
                self.advance(L, L)
                self.release_one(s)
                continue
            if self.cur_used - self.cur_off >= NOGIL_COPY:
                with nogil:
                    k = self.copy_records(dst, room, &off, lens, wide, n, maxn)
            else:
                k = self.copy_records(dst, room, &off, lens, wide, n, maxn)
            if k == n:
                break           # a record that does not fit, a descriptor or a bad one
            self.slot_refs[s] -= <uint32_t>(k - n - 1)
            self.release_one(s)     # (the last of them: the slot goes back once all are)
            n = k
        return n

    cdef Py_ssize_t copy_records(self, char *dst, size_t room, size_t *off, void *lens,
                                 bint wide, Py_ssize_t n, Py_ssize_t maxn) noexcept nogil:
        """copy_many's loop over the records of the open PACKED slot, from message n of
        the call on: each checked as peek checks it (one that fails is left for peek),
        copied to ``dst + off[0]`` and consumed; the call's message count after."""
        cdef char *base = self.ring + <size_t>self.cur_slot * self.stride + SLOT_HEADER
        cdef uint32_t o = self.cur_off, left = self.cur_left, used = self.cur_used, L, fl
        cdef size_t at = off[0]
        cdef uint64_t nbytes = 0
        cdef Py_ssize_t first = n
        while left and n < maxn:
            if o + REC_HDR > used:
                break
            L = (<volatile uint32_t *>(base + o))[0]
            fl = (<volatile uint32_t *>(base + o))[1]
            if fl != 0 or L > used - o - REC_HDR or L > room - at:
                break       # a descriptor, a bad record (peek says which), no room
            rm_copy(dst + at, base + o + REC_HDR, L)     # (inline: small ones in registers)
            put_len(lens, wide, n, L)
            at += L
            nbytes += L
            o += REC_HDR + pad8(L)
            left -= 1
            n += 1
        self.cur_off, self.cur_left = o, left
        off[0] = at
        self.link.cnt.msgs_recv += <uint64_t>(n - first)
        self.link.cnt.bytes_recv += nbytes
        if left == 0 and n > first:
            self.link.cnt.slots_recv += 1
        return n

    cdef bint has_arrivals(self) noexcept nogil:
        """Something to deliver, or a slot arrived since the last look found a gap (the
        slots waiting behind a gap do not count: waiting for the gap sleeps)."""
        if self.cur_left != 0 or self.ready_len != 0:
            return True
        if self.gap_since == 0:
            return self.rbm.pending(self.pend, 1) != 0
        return self.rbm.pending(self.pend, self.gap_pending + 1) > self.gap_pending

    cdef void release_one(self, uint32_t slot) noexcept:
        """One message of ``slot`` is released; the slot goes back when all are."""
        cdef Link link = self.link
        if slot >= self.nslots or self.slot_refs[slot] == 0:
            return
        self.slot_refs[slot] -= 1
        if self.slot_refs[slot] or link.inherited():
            return          # in a fork child the slot is the parent's to give back
        link.lock()
        self.rbm.release(slot)
        if not link.closed and not link.peer_gone and (
                self.rbm.unflushed >= self.threshold()
                or rm_load_acquire64(&link.ctrl[CTRL_CREDIT_WAIT])):
            self.flush_locked()
        link.unlock()

    cdef inline bint unflushed(self) noexcept nogil:
        return self.rbm.unflushed != 0 or self.done_unflushed != 0

    cdef int flush_locked(self) noexcept nogil:
        """Write the changed reclaim words, and the rendezvous-done word, back to the
        sender (caller holds the link's spin lock)."""
        cdef uint32_t lo, hi
        cdef rm_wr wr
        cdef int rc
        if self.done_unflushed:
            self.done_unflushed = 0
            self.link.cnt.done_wb += 1
            rc = self.link.put_ctrl(CTRL_RNDV_DONE, WORD_DONE)
            if not self.rbm.take_dirty(&lo, &hi):
                rm_fence_seq_cst()
                if rc == 0 and rm_load_acquire64(&self.link.ctrl[CTRL_CREDIT_WAIT]):
                    self.link.wake_peer()
                return rc
        elif not self.rbm.take_dirty(&lo, &hi):
            return 0
        wr.wr_id = 0
        wr.local_addr = <uint64_t>&self.rbm.reclaim[lo]
        wr.remote_off = lo * 8
        wr.length = (hi - lo) * 8
        wr.lkey = self.lkey_reclaim
        wr.rkey = RM_REGION_RECLAIM
        wr.opcode = RM_WR_WRITE
        wr.flags = RM_WR_PUBLISH
        wr.imm = 0
        rc = self.link.post(&wr, 1)
        self.link.cnt.reclaim_wb += 1
        rm_fence_seq_cst()
        if rc == 0 and rm_load_acquire64(&self.link.ctrl[CTRL_CREDIT_WAIT]):
            self.link.wake_peer()
        return rc

    cdef int flush(self) noexcept nogil:
        cdef int rc
        self.link.lock()
        rc = self.flush_locked()
        self.link.unlock()
        return rc

    cdef void flip_done(self, uint16_t entry) noexcept nogil:
        """A rendezvous message (done bit ``entry``) is taken out of the stream: the
        sender may release its source once the done word reaches it."""
        self.link.lock()
        self.link.flip_bit(WORD_DONE, entry)
        self.done_unflushed += 1
        if not self.link.closed and not self.link.peer_gone and (
                rm_load_acquire64(&self.link.ctrl[CTRL_CREDIT_WAIT])):
            self.flush_locked()
        self.link.unlock()

    cdef dict diagnostics(self):
        cdef uint32_t i, held = 0
        for i in range(self.nslots):
            if self.slot_refs[i]:
                held += 1
        return {
            "recv_seq": self.recv_seq, "unflushed": self.rbm.unflushed, "slots_held": held,
            "ready_len": self.ready_len, "cur_left": self.cur_left,
            "pending": self.rbm.pending_slots(),
            "arrival": list(self.rbm.arrival_words), "consumed": list(self.rbm.consumed_words),
            "reclaim_shadow": list(self.rbm.reclaim_words),
            "ring": {"address": <size_t>self.ring, "stride": self.stride, "slots": self.nslots},
        }
