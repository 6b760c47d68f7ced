# The verbs provider's endpoint: an RC queue pair and its data path (VerbsTransport),
# on the device resources and registrations of _verbs_dev.pxd, with the first cause of
# its failure (VerbsFailure). Declared here so that the test-only hooks
# (rdmamw/testing/_hooks.pyx) can reach its queue pair and, through ``mem``, its
# exposure table; the package itself never imports them.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from rdmamw.transport._base cimport RM_NREGIONS, Transport, rm_mem, rm_wc, rm_wr
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._device cimport (
    RECV_BUF,
    GRANT_OFF,
    RECV_POOL,
    WC_BATCH,
    VerbsBlock,
    VerbsDevice,
    VerbsMemory,
    rmv_route,
)

cdef enum:                 # what failed the connection first (error_detail)
    FAIL_OTHER = 1
    FAIL_SEND_WC = 2
    FAIL_RECV_WC = 3
    FAIL_POST = 4
    FAIL_POLL = 5
    FAIL_STUCK = 6
    FAIL_SOCKET = 7


cdef class VerbsFailure:
    """Why the connection failed, the first cause only (error_detail())."""
    cdef readonly int kind          # FAIL_*, 0 while nothing failed
    cdef readonly int status, opcode, err_errno
    cdef readonly uint32_t vendor
    cdef readonly uint64_t wr_id

    cdef void call(self, int kind, int err) noexcept nogil
    cdef void completion(self, ibv_wc *wc, int kind, bint live) noexcept nogil


cdef class VerbsTransport(Transport):
    cdef readonly VerbsDevice dev       # context, channel, shared CQs (the process's)
    cdef readonly VerbsMemory mem       # this endpoint's PD and its MRs
    cdef readonly VerbsMemory cache_mem # the registration caches' MRs (mem, or shared)
    cdef rmv_route *route               # the QP's share of the device's CQs
    cdef bint joined                    # route holds room on the device's CQs
    cdef uint64_t recv_seen             # route.recv_ok taken so far (rlock)
    cdef readonly int port, gid_index, lid, mtu     # the port used (mtu: enum)
    cdef readonly bytes gid
    cdef readonly VerbsFailure failure
    cdef ibv_qp *qp
    cdef ibv_mr *recv_mr
    cdef char *recv_buf
    cdef uint64_t peer_addr[RM_NREGIONS]
    cdef uint32_t peer_rkey
    cdef readonly VerbsBlock block      # my block, its registrations; rings that grow
    cdef uint32_t ring_slots, peer_slots    # both rings' sizes (set_rings), for stats
    cdef readonly bint peer_imm         # the peer wants its bitmap words WITH_IMM
    cdef readonly bint event_mode       # my peer sends WITH_IMM: sleep on the channel
    cdef int poll_ms
    cdef readonly uint32_t sq_depth, rq_depth, max_chain, sig_bound
    cdef uint64_t sq_posted, sq_done
    cdef uint32_t unsig
    cdef uint64_t *sig_pos
    cdef uint64_t sig_head, sig_tail
    cdef rm_wc *stash
    cdef uint32_t stash_head, stash_len, stash_cap
    cdef bint error_reported
    cdef bint last_imm
    cdef ibv_send_wr *swr
    cdef ibv_sge *sge
    cdef ibv_wc wcb[WC_BATCH]
    cdef int sock
    cdef int state
    cdef int lock                       # send queue and its accounting
    cdef int rlock                      # recv_seen and the receive counters
    cdef readonly uint64_t n_recv_completions
    cdef readonly uint64_t n_binds      # memory-window binds posted (exposures, parts)
    cdef readonly uint32_t qpn
    cdef uint8_t timeout_exp
    cdef readonly uint32_t read_chunk   # longest READ one WR asks for (0: no limit)

    cdef void _destroy(self) noexcept
    cdef void _fail(self, int code, int kind=*, int err=*) noexcept nogil
    cdef void _wc_error(self, ibv_wc *wc, int kind) noexcept nogil
    cdef inline int _dead(self) noexcept nogil
    cdef void _fill(self, uint32_t j, rm_wr *wr) noexcept nogil
    cdef int _post_chain(self, uint32_t count, bint final) noexcept nogil
    cdef int _room(self, uint32_t count) noexcept nogil
    cdef int _poll_send_locked(self) noexcept nogil
    cdef inline void _stash(self, uint64_t wr_id, int status, int opcode) noexcept nogil
    cdef int _drain_recv(self) noexcept nogil
    cdef bint _woken(self) noexcept nogil
    cdef int _settle(self) noexcept nogil
