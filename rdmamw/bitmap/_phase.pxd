# Phase bitmaps: the arrival / reclaim bookkeeping of one direction of one channel.
# The engine (rdmamw/engine/) cimports these; the tests drive them through their
# def-methods side by side with the pure-Python model in rdmamw/bitmap/model.py.
from libc.stdint cimport uint32_t, uint64_t

from rdmamw.transport.atomics cimport (
    rm_copy,
    rm_cpu_relax,
    rm_ctz64,
    rm_fence_seq_cst,
    rm_load_acquire32,
    rm_load_acquire64,
    rm_popcount64,
    rm_spin_lock,
    rm_spin_unlock,
    rm_store_release32,
    rm_store_release64,
    rm_tail_mask,
)


cdef class SendBitmaps:
    """Sender side: owns the truth of the arrival bitmap, reads the peer-written reclaim."""
    cdef uint64_t *arrival          # shadow of the peer's arrival bitmap (we are its only writer)
    cdef uint64_t *reclaim          # written by the receiver (registered memory, or our own)
    cdef object _reclaim_owner      # keeps a Python-supplied reclaim buffer alive
    cdef readonly uint32_t nslots
    cdef readonly uint32_t nwords
    cdef uint32_t cursor            # word where the next allocation search starts
    cdef uint32_t dirty_start       # circular span of arrival words changed since take_dirty
    cdef uint32_t dirty_count
    cdef uint64_t last_mask         # valid bits of the last word
    cdef readonly uint32_t usable   # slots the receiver granted (a ring that grows)
    cdef uint32_t usable_words      # words holding usable slots
    cdef uint64_t usable_mask       # usable bits of the last of them

    cdef uint32_t alloc(self, uint32_t n, uint32_t *out) noexcept nogil
    cdef uint32_t count_free(self) noexcept nogil
    cdef int set_usable(self, uint32_t n) except -1
    cdef inline uint64_t usable_bits(self, uint32_t w) noexcept nogil:
        if w + 1 < self.usable_words:
            return ~(<uint64_t>0)
        return self.usable_mask if w + 1 == self.usable_words else 0
    cdef bint take_dirty(self, uint32_t *start, uint32_t *count) noexcept nogil


cdef class RecvBitmaps:
    """Receiver side: reads the peer-written arrival bitmap, owns the truth of reclaim."""
    cdef uint64_t *arrival          # written by the sender (registered memory, or our own)
    cdef object _arrival_owner
    cdef uint64_t *consumed         # arrival phase already delivered, per slot
    cdef uint64_t *reclaim          # shadow of the sender's reclaim bitmap (we are its only writer)
    cdef readonly uint32_t nslots
    cdef readonly uint32_t nwords
    cdef uint64_t last_mask
    cdef readonly uint32_t unflushed  # releases not yet written back
    cdef uint32_t dirty_lo, dirty_hi  # reclaim words changed since take_dirty: [lo, hi)

    cdef uint32_t pending(self, uint32_t *out, uint32_t maxn) noexcept nogil

    cdef inline uint32_t pending_word(self, uint32_t *out, uint32_t w) noexcept nogil:
        """pending() of word ``w`` alone (inline: the receive's first look, where the
        next slot most likely is)."""
        cdef uint64_t p = rm_load_acquire64(&self.arrival[w]) ^ self.consumed[w]
        cdef uint32_t got = 0
        if w == self.nwords - 1:
            p &= self.last_mask
        while p:
            out[got] = (w << 6) + <uint32_t>rm_ctz64(p)
            got += 1
            p &= p - 1
        return got
    cdef bint take_dirty(self, uint32_t *lo, uint32_t *hi) noexcept nogil

    # once per message (inline: no call)
    cdef inline void consume(self, uint32_t slot) noexcept nogil:
        self.consumed[slot >> 6] ^= (<uint64_t>1) << (slot & 63)

    cdef inline void release(self, uint32_t slot) noexcept nogil:
        cdef uint32_t w = slot >> 6
        self.reclaim[w] ^= (<uint64_t>1) << (slot & 63)
        self.unflushed += 1
        if w < self.dirty_lo:
            self.dirty_lo = w
        if w + 1 > self.dirty_hi:
            self.dirty_hi = w + 1
