from libc.stdint cimport uint32_t, uint64_t

from rdmamw.bitmap._phase cimport SendBitmaps
from rdmamw.engine._batch cimport SendBatch
from rdmamw.engine._link cimport Link
from rdmamw.engine._rndv_send cimport RndvSender
from rdmamw.engine._trace cimport rm_trace_on
from rdmamw.transport._base cimport rm_wr


cdef enum:
    MAX_PARTS = 40                  # a ring of 2^20 slots, doubling from one slot
    # a SINGLE payload up to this size goes into the staged slot behind its header (one
    # WRITE of both) even where the provider reads the user's buffer: a copy this small
    # costs less than the second work request
    SMALL_COPY = 256


cdef class EagerSender:
    cdef Link link
    cdef SendBatch batch
    cdef RndvSender rs
    cdef SendBitmaps sbm            # the peer's arrival bitmap (mine to write)
    cdef readonly uint32_t peer_nslots
    cdef uint32_t peer_stride
    cdef readonly uint32_t peer_slot_size
    cdef char *staging              # mirrors the peer's ring slot for slot
    # staging is registered in parts, as the peer grants its ring (a ring that grows):
    # part p holds the slots below part_end[p], with key part_lkey[p]
    cdef uint32_t nparts
    cdef uint32_t part_end[MAX_PARTS]
    cdef uint32_t part_lkey[MAX_PARTS]
    cdef bint grow_failed           # registering a part failed: stay at what we have
    cdef uint32_t lkey_arrival
    cdef readonly uint64_t send_seq
    cdef uint32_t *alloc_tmp        # the peer slots of the chain being built
    cdef rm_wr *wrs                 # the chain
    cdef uint32_t wr_cap
    cdef uint64_t *snap             # SNAP_DEPTH copies of the arrival words (async transports)
    cdef uint32_t lkey_snap
    cdef readonly int blocked_on    # what post_planned ran out of (WAIT_SLOTS / WAIT_ENTRY)
    cdef readonly uint32_t ask      # short of a ring that grows: the slots to ask for

    cdef int _grow(self, uint32_t n) except -1
    cdef inline int grow(self, uint32_t n) except -1:
        """A chain for batches of n messages: each may take a slot write and a data
        WRITE, plus the arrival words (inline: once per send call, mostly room)."""
        if 2 * n + 4 <= self.wr_cap:
            return 0
        return self._grow(n)
    cdef uint32_t post_planned(self, uint32_t k, uint32_t nplan, int *rc) noexcept nogil
    cdef uint32_t alloc(self, uint32_t want) noexcept nogil
    cdef void ask_for(self, uint32_t k, uint32_t got, uint32_t nplan) noexcept nogil
    cdef bint take_grant(self) noexcept nogil
    cdef bint use_grant(self, uint32_t n) noexcept with gil
    cdef int stage(self, uint32_t n) except -1
    cdef inline uint32_t lkey_of(self, uint32_t slot) noexcept nogil:
        """The key of the staging part that holds ``slot`` (the last part holds
        half the ring, so most slots take one compare)."""
        cdef uint32_t p = self.nparts - 1
        while p and slot < self.part_end[p - 1]:
            p -= 1
        return self.part_lkey[p]
    cdef inline bint takes_one(self, size_t L) noexcept nogil:
        """send_one() may take an eager message of L bytes: a synchronous transport, a
        size that goes eager in one slot WRITE (copied into staging), no timeline
        recording (inline: every send of one message asks)."""
        return (self.link.synchronous() and L <= self.batch.eager_limit
                and not (self.batch.rndv_on and L > self.batch.rndv_threshold)
                and (L <= SMALL_COPY or not self.link.direct_source())
                and not rm_trace_on(self.link.trace))
    cdef int send_one(self, const char *p, uint32_t L) noexcept nogil
    cdef inline void count(self, Py_ssize_t n, uint64_t nbytes, uint32_t slots) noexcept nogil:
        """A batch of ``n`` messages, ``nbytes`` in ``slots`` slots, posted whole (the
        sender's counters: one writer, this unit; inline: once per send call)."""
        self.link.cnt.msgs_sent += n
        self.link.cnt.bytes_sent += nbytes
        self.link.cnt.slots_sent += slots
        self.link.cnt.batches += 1
    cdef int post_slots(self, uint32_t k0, uint32_t got) noexcept nogil
    cdef void doorbell(self, uint32_t k0, uint32_t got, uint32_t nplan, int rc) noexcept nogil
    cdef uint32_t build_slot(self, uint32_t k, uint32_t slot, uint32_t nw) noexcept nogil
    cdef uint32_t arrival_wrs(self, uint32_t nw) noexcept nogil
    cdef dict diagnostics(self)
