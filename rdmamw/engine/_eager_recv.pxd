from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t

from rdmamw.bitmap._phase cimport RecvBitmaps
from rdmamw.engine._frames cimport REC_HDR, SLOT_HEADER, SLOT_SINGLE, pad8
from rdmamw.engine._link cimport Link


cdef class EagerReceiver:
    cdef Link link
    cdef RecvBitmaps rbm            # arrival (the peer writes) and reclaim (mine)
    cdef char *ring
    cdef readonly uint32_t nslots
    cdef uint32_t stride
    cdef readonly uint32_t slot_size
    cdef uint32_t lkey_reclaim
    cdef readonly uint64_t recv_seq # the next sequence number to deliver
    # arrived slots, put in sequence order
    cdef uint32_t *pend             # slots pending in the arrival bitmap
    cdef uint32_t *pend_d           # ... their distance from recv_seq
    cdef uint32_t *order            # distance -> slot (RM_NO_SLOT: not arrived)
    cdef uint32_t *ready            # in order, not yet opened (a ring of nslots)
    cdef uint32_t ready_head
    cdef uint32_t ready_len
    cdef int64_t gap_since          # a slot is missing since (0: no gap)
    cdef uint32_t gap_pending       # slots pending behind the gap (they do not wake us)
    cdef int64_t gap_timeout_ns
    cdef uint32_t next_word         # the arrival word fill_ready looks at first
    # the slot being read
    cdef uint32_t *slot_refs        # messages handed out and not yet released, per slot
    cdef uint32_t cur_slot
    cdef uint32_t cur_left
    cdef uint32_t cur_off
    cdef uint32_t cur_used
    cdef uint16_t cur_flags
    cdef uint32_t max_open          # slots one receive call may open
    # write-back of reclaim words (and the done word of rendezvous messages taken)
    cdef readonly uint32_t flush_threshold
    cdef inline uint32_t threshold(self) noexcept nogil:
        """Releases written back at once: flush_threshold, or a quarter of the slots
        granted while the ring grows (a sender with 4 slots never waits for 32)."""
        cdef uint32_t g = self.link.local_granted()
        if g >= self.nslots:
            return self.flush_threshold
        return max(1, min(self.flush_threshold, g // 4))
    cdef uint32_t done_unflushed    # done bits flipped since the last write-back

    cdef int fill_ready(self) except -1
    cdef uint32_t place(self, uint32_t k) except? 0xFFFFFFFF
    cdef int open_slot(self) except -1
    cdef int peek(self, char **pbase, uint32_t *plen, uint32_t *pflags) except -1
    cdef inline bint next_record(self, char **pbase, uint32_t *plen) noexcept:
        """peek's look at the next record of the open PACKED slot, inline (once per
        message of a batch): 1 if it is an eager message within the slot; else 0, and
        peek looks again (a descriptor, a slot to open, or a bad record it fails on).
        The record's words are read once, into locals, before they are checked."""
        cdef char *base
        cdef uint32_t L, fl
        if self.cur_left == 0 or self.cur_flags == SLOT_SINGLE \
                or self.cur_off + REC_HDR > self.cur_used:
            return 0
        base = self.ring + <size_t>self.cur_slot * self.stride + SLOT_HEADER + self.cur_off
        L = (<volatile uint32_t *>base)[0]
        fl = (<volatile uint32_t *>base)[1]
        if fl != 0 or L > self.cur_used - self.cur_off - REC_HDR:
            return 0
        pbase[0] = base + REC_HDR
        plen[0] = L
        return 1
    cdef inline void advance(self, uint32_t L, uint64_t nbytes) noexcept:
        """The message peek pointed at is consumed (inline: once per message)."""
        if self.cur_flags != SLOT_SINGLE:
            self.cur_off += REC_HDR + pad8(L)
        self.cur_left -= 1
        self.link.cnt.msgs_recv += 1
        self.link.cnt.bytes_recv += nbytes
        if self.cur_left == 0:
            self.link.cnt.slots_recv += 1

    cdef Py_ssize_t copy_many(self, char *dst, size_t room, void *lens, bint wide,
                              Py_ssize_t maxn) except -1
    cdef Py_ssize_t copy_records(self, char *dst, size_t room, size_t *off, void *lens,
                                 bint wide, Py_ssize_t n, Py_ssize_t maxn) noexcept nogil
    cdef bint has_arrivals(self) noexcept nogil
    cdef void release_one(self, uint32_t slot) noexcept
    cdef bint unflushed(self) noexcept nogil
    cdef int flush_locked(self) noexcept nogil
    cdef int flush(self) noexcept nogil
    cdef void flip_done(self, uint16_t entry) noexcept nogil
    cdef dict diagnostics(self)

    cdef inline void release_fast(self, uint32_t slot) noexcept:
        """A Message of ``slot`` goes (inline: once per message)."""
        if self.slot_refs[slot] > 1:    # not the slot's last message
            self.slot_refs[slot] -= 1
        else:
            self.release_one(slot)


cdef inline void put_len(void *lens, bint wide, Py_ssize_t i, uint64_t L) noexcept nogil:
    """recv_many_into: message i's length into the caller's lengths array (8 bytes
    each, or 4)."""
    if wide:
        (<uint64_t *>lens)[i] = L
    else:
        (<uint32_t *>lens)[i] = <uint32_t>L
