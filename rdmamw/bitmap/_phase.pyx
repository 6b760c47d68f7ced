# cython: freethreading_compatible = False
"""Phase bitmaps in Cython: word-at-a-time scans with ctz/popcount.

Slot ``i`` on its k-th use has *arrived* when arrival bit ``i`` equals ``k mod 2`` and is
*free again* when reclaim bit ``i`` equals ``k mod 2``. Each bitmap has exactly one
writer, which keeps the truth in a local shadow and may overwrite a peer's word whole.
See docs/protocol.md; rdmamw/bitmap/model.py is the pure-Python twin.
"""

import array

cimport cython

from cpython.buffer cimport PyBUF_WRITABLE, PyObject_GetBuffer, PyBuffer_Release
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport calloc, free


cdef uint64_t *_borrow_words(object buf, uint32_t nwords, str what) except NULL:
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
    try:
        if <size_t>view.len < <size_t>nwords * 8:
            raise ValueError(f"{what} buffer holds {view.len} bytes, needs {nwords * 8}")
        if (<size_t>view.buf) & 7:
            raise ValueError(f"{what} buffer is not 8-byte aligned")
        return <uint64_t *>view.buf
    finally:
        PyBuffer_Release(&view)


@cython.final
cdef class _Words:
    """A writable uint64 buffer over bitmap words that keeps their owner alive."""
    cdef object owner
    cdef uint64_t *ptr
    cdef Py_ssize_t n
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __getbuffer__(self, Py_buffer *view, int flags):
        view.buf = self.ptr
        view.obj = self
        view.len = self.n * 8
        view.readonly = 0
        view.itemsize = 8
        view.format = "Q"
        view.ndim = 1
        self.shape[0] = self.n
        self.strides[0] = 8
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass


cdef object _words(object owner, uint64_t *ptr, uint32_t n):
    cdef _Words w = _Words.__new__(_Words)
    w.owner = owner
    w.ptr = ptr
    w.n = n
    return memoryview(w)


cdef inline uint32_t words_for(uint32_t nslots) noexcept nogil:
    return <uint32_t>((<uint64_t>nslots + 63u) >> 6)  # 64-bit: nslots near 2**32 must not wrap


cdef class SendBitmaps:
    """The sender's half of one direction: allocates free slots and records which
    arrival words changed so exactly those words are written to the peer."""

    def __cinit__(self, uint32_t nslots, object reclaim=None, uint32_t usable=0):
        if nslots == 0:
            raise ValueError("a ring needs at least one slot")
        self.nslots = nslots
        self.nwords = words_for(nslots)
        self.last_mask = rm_tail_mask(nslots)
        self.arrival = <uint64_t *>calloc(self.nwords, 8)
        if self.arrival == NULL:
            raise MemoryError()
        if reclaim is None:
            self._reclaim_owner = bytearray(self.nwords * 8 + 8)
            reclaim = memoryview(self._reclaim_owner)
            # bytearray storage is 8-aligned on CPython's allocator but do not rely on it
            off = (-_address_of(reclaim)) & 7
            reclaim = reclaim[off:off + self.nwords * 8]
        else:
            self._reclaim_owner = reclaim
        self.reclaim = _borrow_words(reclaim, self.nwords, "reclaim")
        self.set_usable(usable or nslots)

    def __dealloc__(self):
        free(self.arrival)

    cdef int set_usable(self, uint32_t n) except -1:
        """Hand out only slots below ``n`` (what the receiver registered so far); a
        ring only grows."""
        if n == 0 or n > self.nslots or n < self.usable:
            raise ValueError(f"usable slots {n} outside [{max(1, self.usable)}, {self.nslots}]")
        self.usable = n
        self.usable_words = words_for(n)
        self.usable_mask = rm_tail_mask(n)
        return 0

    def grant(self, uint32_t n):
        """Python view of set_usable (tests)."""
        self.set_usable(n)

    cdef uint32_t alloc(self, uint32_t n, uint32_t *out) noexcept nogil:
        """Take up to ``n`` free slots (flipping their arrival phase); return how many."""
        cdef uint32_t got = 0, scanned = 0, w = self.cursor, d
        cdef uint64_t free_bits, bit
        while got < n and scanned < self.nwords:
            free_bits = ~(self.arrival[w] ^ rm_load_acquire64(&self.reclaim[w])) \
                & self.usable_bits(w)
            if free_bits:
                while free_bits and got < n:
                    bit = free_bits & (~free_bits + 1)
                    out[got] = (w << 6) + <uint32_t>rm_ctz64(free_bits)
                    got += 1
                    self.arrival[w] ^= bit
                    free_bits ^= bit
                if self.dirty_count == 0:
                    self.dirty_start = w
                    self.dirty_count = 1
                else:
                    d = (w + self.nwords - self.dirty_start) % self.nwords
                    if d + 1 > self.dirty_count:
                        self.dirty_count = d + 1
                if got == n:
                    break
            w += 1
            if w == self.nwords:
                w = 0
            scanned += 1
        self.cursor = w
        return got

    cdef uint32_t count_free(self) noexcept nogil:
        cdef uint32_t w, total = 0
        cdef uint64_t free_bits
        for w in range(self.nwords):
            free_bits = ~(self.arrival[w] ^ rm_load_acquire64(&self.reclaim[w])) \
                & self.usable_bits(w)
            total += <uint32_t>rm_popcount64(free_bits)
        return total

    cdef bint take_dirty(self, uint32_t *start, uint32_t *count) noexcept nogil:
        """The circular span of arrival words to publish; resets it."""
        if self.dirty_count == 0:
            return False
        start[0] = self.dirty_start
        count[0] = self.dirty_count
        self.dirty_count = 0
        return True

    # ---- Python view, for tests and debugging ----
    def alloc_slots(self, uint32_t n):
        """Allocate up to n slots; return their indices in allocation order."""
        cdef uint32_t[64] small
        cdef list res = []
        cdef uint32_t k, i
        while n:
            k = self.alloc(n if n < 64 else 64, small)
            for i in range(k):
                res.append(small[i])
            if k == 0:
                break
            n -= k
        return res

    def free_slots(self):
        return self.count_free()

    def take_dirty_words(self):
        """(start, count) of the circular span of changed arrival words, or None."""
        cdef uint32_t s, c
        if self.take_dirty(&s, &c):
            return (s, c)
        return None

    @property
    def arrival_words(self):
        return _words(self, self.arrival, self.nwords)

    @property
    def reclaim_words(self):
        return _words(self, self.reclaim, self.nwords)


cdef class RecvBitmaps:
    """The receiver's half of one direction: finds arrived slots, records releases and
    which reclaim words changed, so they can be written back lazily in one write."""

    def __cinit__(self, uint32_t nslots, object arrival=None):
        if nslots == 0:
            raise ValueError("a ring needs at least one slot")
        self.nslots = nslots
        self.nwords = words_for(nslots)
        self.last_mask = rm_tail_mask(nslots)
        self.consumed = <uint64_t *>calloc(self.nwords, 8)
        self.reclaim = <uint64_t *>calloc(self.nwords, 8)
        if self.consumed == NULL or self.reclaim == NULL:
            raise MemoryError()
        if arrival is None:
            self._arrival_owner = bytearray(self.nwords * 8 + 8)
            arrival = memoryview(self._arrival_owner)
            off = (-_address_of(arrival)) & 7
            arrival = arrival[off:off + self.nwords * 8]
        else:
            self._arrival_owner = arrival
        self.arrival = _borrow_words(arrival, self.nwords, "arrival")
        self.dirty_lo = self.nwords

    def __dealloc__(self):
        free(self.consumed)
        free(self.reclaim)

    cdef uint32_t pending(self, uint32_t *out, uint32_t maxn) noexcept nogil:
        """Slots whose arrival phase differs from what was consumed, in index order.
        (Once or twice per receive call, mostly over words with nothing new: the
        pointers in locals, so each word is two loads and a test.)"""
        cdef uint32_t w, got = 0, last = self.nwords - 1
        cdef uint64_t *arrival = self.arrival
        cdef uint64_t *consumed = self.consumed
        cdef uint64_t p
        for w in range(self.nwords):
            p = rm_load_acquire64(&arrival[w]) ^ consumed[w]
            if p == 0:
                continue
            if w == last:
                p &= self.last_mask
            while p and got < maxn:
                out[got] = (w << 6) + <uint32_t>rm_ctz64(p)
                got += 1
                p &= p - 1
            if got == maxn:
                break
        return got

    cdef bint take_dirty(self, uint32_t *lo, uint32_t *hi) noexcept nogil:
        """The span [lo, hi) of reclaim words to write back; resets it."""
        if self.dirty_hi == 0:
            return False
        lo[0] = self.dirty_lo
        hi[0] = self.dirty_hi
        self.dirty_lo = self.nwords
        self.dirty_hi = 0
        self.unflushed = 0
        return True

    # ---- Python view, for tests and debugging ----
    def pending_slots(self):
        """Arrived, not yet consumed slots, in index order."""
        arr = array.array("I", bytes(4 * self.nslots))
        k = self._pending_into(arr)
        return arr[:k].tolist()

    def _pending_into(self, object arr):
        cdef uint32_t[::1] mv = arr
        return self.pending(&mv[0], <uint32_t>mv.shape[0])

    def is_outstanding(self, uint32_t slot):
        """Delivered (consumed) and not yet released."""
        if slot >= self.nslots:
            raise IndexError(slot)
        cdef uint64_t bit = (<uint64_t>1) << (slot & 63)
        return bool((self.consumed[slot >> 6] ^ self.reclaim[slot >> 6]) & bit)

    def consume_slot(self, uint32_t slot):
        if slot >= self.nslots:
            raise IndexError(slot)
        cdef uint64_t bit = (<uint64_t>1) << (slot & 63)
        if not ((rm_load_acquire64(&self.arrival[slot >> 6]) ^ self.consumed[slot >> 6]) & bit):
            raise ValueError(f"slot {slot} has not arrived")
        self.consume(slot)

    def release_slot(self, uint32_t slot):
        if not self.is_outstanding(slot):
            raise ValueError(f"slot {slot} is not delivered-and-unreleased")
        self.release(slot)

    def take_dirty_words(self):
        cdef uint32_t lo, hi
        if self.take_dirty(&lo, &hi):
            return (lo, hi)
        return None

    @property
    def arrival_words(self):
        return _words(self, self.arrival, self.nwords)

    @property
    def reclaim_words(self):
        return _words(self, self.reclaim, self.nwords)

    @property
    def consumed_words(self):
        return _words(self, self.consumed, self.nwords)


def _address_of(object buf):
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, 0)
    addr = <size_t>view.buf
    PyBuffer_Release(&view)
    return addr
