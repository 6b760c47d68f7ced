# The verbs provider's device resources, each unit the one writer of its fields (the
# pointers too: Cython cannot declare a pointer readonly, so the rule is the comment's):
#   VerbsDevice  an opened device port: context, protection domain, completion
#                channel, send and receive CQs (one per transport for now; the QP of
#                _verbs.VerbsTransport posts and polls on them)
#   VerbsMemory  what is registered on that PD for one transport: local MRs, the
#                registration caches' MRs and the exposure table of rendezvous
from libc.stdint cimport uint32_t, uint64_t

from rdmamw.transport._base cimport rm_mem
from rdmamw.providers._ibverbs cimport ibv_comp_channel, ibv_context, ibv_cq, ibv_mr, ibv_pd

cdef enum:
    XMR_N = 512         # exposed ranges at once (64 sends + 64 posted + reads per side)

cdef extern from *:
    """
    #define RMV_XMR_BUSY ((struct ibv_mr *)1)
    """
    ibv_mr *XMR_BUSY "RMV_XMR_BUSY"     # a claimed slot whose ibv_reg_mr is under way


# this extension's table of libibverbs calls (rm_ibverbs.h keeps one per extension),
# filled from the library _verbs.load() chose: rm_ibv_load's result
cdef int load_table(const char *lib, char *err, size_t errlen) noexcept


cdef class VerbsDevice:
    # all made by __init__ (or none: it raises and __dealloc__ frees what was made)
    cdef ibv_context *ctx
    cdef ibv_pd *pd
    cdef ibv_comp_channel *chan     # events of the receive CQ (wake-ups, immediates)
    cdef ibv_cq *scq
    cdef ibv_cq *rcq
    cdef readonly int fd            # the channel's (non-blocking)
    cdef readonly int port, gid_index, lid, mtu     # mtu: the port's active MTU (enum)
    cdef readonly bytes gid
    # the queue depths the CQs are sized for: the asked ones, cut to the device's limit
    cdef readonly uint32_t sq_depth, rq_depth
    cdef int elock                  # the channel's events and their count
    cdef uint32_t unacked_events
    cdef int owner_pid              # the process that opened it (a fork child must not
    cdef const int *pid_now         # destroy the parent's objects: same uverbs file)

    cdef inline bint inherited(self) noexcept nogil:
        return self.owner_pid != self.pid_now[0]

    cdef void take_events(self) noexcept nogil
    cdef void arm(self) noexcept nogil
    cdef void close(self) noexcept


cdef class VerbsMemory:
    cdef readonly VerbsDevice dev
    cdef ibv_mr **lmrs              # register_local's, for the transport's life
    cdef uint32_t n_lmrs
    # MRs of the registration caches (mr_register): address -> ibv_mr, deregistered by
    # the cache, or here when the transport dies with some still cached
    cdef dict cached_mrs
    # rendezvous: one MR per exposed range, handle = index + 1. The engine's send and
    # receive threads expose and unexpose at the same time: xlock guards the table
    # (a slot is claimed with XMR_BUSY before ibv_reg_mr, which runs unlocked).
    cdef ibv_mr *xmrs[XMR_N]
    cdef uint32_t xmr_hint
    cdef int xlock

    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil
    cdef int unexpose(self, uint32_t handle) noexcept nogil
    cdef void release(self) noexcept
