# The protection domain of one endpoint and what is registered on it: local MRs, the
# registration caches' MRs and the exposure table of rendezvous (one PD per peer: the
# NIC keeps each peer to the memory registered for it), and the process's budget of
# pinned memory they are all charged to.
from libc.stdint cimport uint32_t, uint64_t

from rdmamw.transport._base cimport rm_mem
from rdmamw.providers.verbs._ibverbs cimport ibv_mr, ibv_mw, ibv_pd
from rdmamw.providers.verbs._device cimport VerbsDevice

cdef enum:
    XMR_N = 512         # exposed ranges at once (64 sends + 64 posted + reads per side)

# the process's pinned-memory budget (RDMAMW_VERBS_PINNED_BYTES): every registration
# of an endpoint (block, receive buffer, local MRs, cached MRs) is charged before it is
# made and refunded when it goes; 0 charged, -1 over the budget
cdef int pin_charge(uint64_t n) noexcept nogil
# IBV_ACCESS_REMOTE_READ / _WRITE of RM_ACCESS_REMOTE_* bits (a region may have both)
cdef int ibv_remote(uint32_t access) noexcept nogil
cdef void pin_refund(uint64_t n) noexcept nogil


cdef class VerbsMemory:
    cdef readonly VerbsDevice dev
    cdef ibv_pd *pd                 # this endpoint's
    # windows: every range the peer may touch is an MR without remote access plus a
    # type-2 memory window over it, bound to this endpoint's QP (the transport posts
    # the bind); the key the peer gets is the window's, which no other QP can use
    cdef readonly bint windows
    cdef bint own_pd                # pd is this endpoint's (no windows): freed with it
    # the registration caches over this memory's MRs, when it is the process's shared
    # one (set by the channel layer on first use: rdmamw.channel.channel)
    cdef public object regcaches
    cdef uint64_t charged           # of the pinned budget, by register_local/mr_register
    cdef ibv_mr **lmrs              # register_local's, for the transport's life
    cdef uint32_t n_lmrs
    # MRs of the registration caches (mr_register), deregistered by the cache, or here
    # when the transport dies with some still cached (xlock: expose_cached looks up)
    cdef ibv_mr **cmrs
    cdef uint32_t n_cmrs, cap_cmrs
    # rendezvous: one MR per exposed range, handle = index + 1. The engine's send and
    # receive threads expose and unexpose at the same time: xlock guards the table
    # (a slot is claimed with XMR_BUSY before ibv_reg_mr, which runs unlocked).
    cdef ibv_mr *xmrs[XMR_N]
    cdef ibv_mw *xmws[XMR_N]        # with windows: the exposure's window
    cdef uint64_t xbind[XMR_N]      # ... and the send-queue count that ends its bind
    cdef bint xborrowed[XMR_N]      # the MR is a cached one (expose_cached): keep it
    cdef uint32_t xmr_hint
    cdef int xlock

    cdef int remote_flags(self, int access) noexcept nogil
    cdef int _claim(self) noexcept nogil
    cdef int _fill(self, uint32_t i, ibv_mr *mr, bint remote, rm_mem *out) noexcept nogil
    cdef ibv_mr *_uncache(self, size_t p) noexcept nogil
    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil
    cdef int expose_cached(self, VerbsMemory owner, uint32_t lkey, rm_mem *out) noexcept nogil
    cdef int unexpose(self, uint32_t handle) noexcept nogil
    cdef void drop_windows(self) noexcept
    cdef void release(self) noexcept
