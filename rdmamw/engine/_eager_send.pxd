from libc.stdint cimport uint32_t, uint64_t

from rdmamw.bitmap._phase cimport SendBitmaps
from rdmamw.engine._batch cimport SendBatch
from rdmamw.engine._link cimport Link
from rdmamw.engine._rndv_send cimport RndvSender
from rdmamw.transport._base cimport rm_wr


cdef class EagerSender:
    cdef Link link
    cdef SendBatch batch
    cdef RndvSender rs
    cdef SendBitmaps sbm            # the peer's arrival bitmap (mine to write)
    cdef readonly uint32_t peer_nslots
    cdef uint32_t peer_stride
    cdef readonly uint32_t peer_slot_size
    cdef char *staging              # mirrors the peer's ring slot for slot
    cdef uint32_t lkey_staging
    cdef uint32_t lkey_arrival
    cdef readonly uint64_t send_seq
    cdef uint32_t *alloc_tmp        # the peer slots of the chain being built
    cdef rm_wr *wrs                 # the chain
    cdef uint32_t wr_cap
    cdef uint64_t *snap             # SNAP_DEPTH copies of the arrival words (async transports)
    cdef uint32_t lkey_snap
    cdef readonly int blocked_on    # what post_planned ran out of (WAIT_SLOTS / WAIT_ENTRY)

    cdef int grow(self, uint32_t n) except -1
    cdef uint32_t post_planned(self, uint32_t k, uint32_t nplan, int *rc) noexcept nogil
    cdef uint32_t alloc(self, uint32_t want) noexcept nogil
    cdef int post_slots(self, uint32_t k0, uint32_t got) noexcept nogil
    cdef uint32_t build_slot(self, uint32_t k, uint32_t slot, uint32_t nw) noexcept nogil
    cdef uint32_t arrival_wrs(self, uint32_t nw) noexcept nogil
    cdef dict diagnostics(self)
