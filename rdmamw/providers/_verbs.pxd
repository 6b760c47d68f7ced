# The verbs provider's endpoint, declared here so that the test-only hooks
# (rdmamw/testing/_hooks.pyx) can reach its queue pair and exposure table; the package
# itself never imports them.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from rdmamw.transport._base cimport RM_NREGIONS, Transport, rm_wc, rm_wr
from rdmamw.providers._ibverbs cimport *

cdef enum:
    WC_BATCH = 32
    RECV_POOL = 64
    RECV_BUF = 64
    ACK_EVERY = 16

cdef enum:
    XMR_N = 512         # exposed ranges at once (64 sends + 64 posted + reads per side)

cdef extern from *:
    """
    #define RMV_XMR_BUSY ((struct ibv_mr *)1)
    """
    ibv_mr *XMR_BUSY "RMV_XMR_BUSY"     # a claimed slot whose ibv_reg_mr is under way


cdef class VerbsTransport(Transport):
    cdef ibv_context *ctx
    cdef ibv_pd *pd
    cdef ibv_comp_channel *chan
    cdef ibv_cq *scq
    cdef ibv_cq *rcq
    cdef ibv_qp *qp
    cdef ibv_mr *block_mr
    cdef ibv_mr *recv_mr
    cdef char *block
    cdef size_t block_len
    cdef char *recv_buf
    cdef ibv_mr **lmrs
    # rendezvous: one MR per exposed range, handle = index + 1. The engine's send and
    # receive threads expose and unexpose at the same time: xlock guards the table
    # (a slot is claimed with XMR_BUSY before ibv_reg_mr, which runs unlocked).
    cdef ibv_mr *xmrs[XMR_N]
    cdef uint32_t xmr_hint
    cdef int xlock
    # MRs of the registration caches (mr_register): address -> ibv_mr, deregistered by
    # the cache, or here when the transport dies with some still cached
    cdef dict cached_mrs
    cdef uint32_t n_lmrs
    cdef uint64_t peer_addr[RM_NREGIONS]
    cdef uint32_t peer_rkey
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
    cdef ibv_wc rwcb[WC_BATCH]
    cdef ibv_recv_wr rwr[RECV_POOL]
    cdef ibv_sge rsge
    cdef int sock
    cdef int state
    cdef int lock                       # send queue and its accounting
    cdef int rlock                      # receive queue and the channel's events
    cdef uint32_t unacked_events
    cdef int64_t last_sock_check
    cdef readonly uint64_t n_recv_completions
    cdef readonly uint32_t qpn
    cdef readonly int port
    cdef readonly int gid_index
    cdef int my_mtu
    cdef uint8_t timeout_exp
    # why the connection failed, the first cause only (error_detail())
    cdef int err_kind
    cdef int err_status, err_opcode, err_errno
    cdef uint32_t err_vendor
    cdef uint64_t err_wr_id

    cdef void _drain_sq(self, int64_t budget_ns) noexcept nogil
    cdef void _destroy(self) noexcept
    cdef void _fail(self, int code, int kind=*, int err=*) noexcept nogil
    cdef void _wc_error(self, ibv_wc *wc, int kind) noexcept nogil
    cdef inline int _dead(self) noexcept nogil
    cdef void _fill(self, uint32_t j, rm_wr *wr) noexcept nogil
    cdef int _post_chain(self, uint32_t count, bint final) noexcept nogil
    cdef int _room(self, uint32_t count) noexcept nogil
    cdef int _poll_send_locked(self) noexcept nogil
    cdef inline void _stash(self, uint64_t wr_id, int status, int opcode) noexcept nogil
    cdef int _post_recvs(self, int k) noexcept nogil
    cdef int _drain_recv(self) noexcept nogil
    cdef bint _sock_dead(self) noexcept nogil
