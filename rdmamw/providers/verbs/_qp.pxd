# The verbs provider's endpoint: an RC queue pair (VerbsQP: its set-up here, its data
# path in the subclass _transport.VerbsTransport), on the device of _device.pxd and the
# registrations of _memory.pxd and _block.pxd, with the first cause of its failure
# (VerbsFailure). Declared here so that the data path and the test-only hooks
# (rdmamw/testing/_hooks.pyx) reach its fields.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from rdmamw.transport._base cimport RM_NREGIONS, Transport, rm_mem, rm_wc, rm_wr
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._device cimport WC_BATCH, VerbsDevice, rmv_route
from rdmamw.providers.verbs._memory cimport VerbsMemory
from rdmamw.providers.verbs._block cimport VerbsBlock
from rdmamw.providers.verbs._backlog cimport rmv_backlog

cdef enum:                 # VerbsQP.state besides the RM_ERR_* code that ended it
    QP_CONNECTED = 1       # the handshake's socket attached: the data path runs

cdef extern from *:
    """
    #define RMV_INTERNAL (((uint64_t)1) << 63)
    #define RMV_STUCK_NS 10000000000LL
    """
    uint64_t INTERNAL "RMV_INTERNAL"    # wr_id of WRs the engine never sees
    int64_t STUCK_NS "RMV_STUCK_NS"     # no completion at all for this long: peer gone

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


cdef class VerbsQP(Transport):
    cdef readonly VerbsDevice dev       # context, channel, shared CQs (the process's)
    cdef readonly VerbsMemory mem       # this endpoint's PD and its MRs
    cdef readonly VerbsMemory cache_mem # the registration caches' MRs (mem, or shared)
    cdef rmv_route *route               # the QP's share of the device's CQs
    cdef bint joined                    # route holds room on the device's CQs
    cdef uint64_t recv_seen             # route.recv_ok taken so far (rlock)
    cdef uint64_t wake_seen             # route.recv_ok when wait() last returned (the poller)
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
    cdef rmv_backlog bl                 # WRs accepted past a deadline (_backlog.pxd)
    cdef int64_t room_deadline          # _room gives up then (RM_ERR_LATE); 0: never
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
    cdef int state                      # QP_CONNECTED, or the RM_ERR_* that ended it
    cdef int lock                       # send queue and its accounting
    cdef int rlock                      # recv_seen and the receive counters
    cdef readonly uint64_t n_recv_completions
    cdef readonly uint64_t n_binds      # memory-window binds posted (exposures, parts)
    cdef readonly uint64_t n_wakeups_held   # wake-ups not posted: the send queue was
                                            # more than half full (wake_peer)
    cdef readonly uint64_t n_wakeups_chained    # wake-ups posted behind a control
                                                # word's WRITE, its doorbell (put_wake)
    cdef readonly uint32_t qpn
    cdef uint8_t timeout_exp
    cdef readonly uint32_t read_chunk   # longest READ one WR asks for (0: no limit)

    cdef void _destroy(self) noexcept
    cdef void _fail(self, int code, int kind=*, int err=*) noexcept nogil
    cdef void _wc_error(self, ibv_wc *wc, int kind) noexcept nogil
    cdef inline int _dead(self) noexcept nogil
    # the data path's (VerbsTransport), called by the set-up and the window binds
    cdef int _post_chain(self, uint32_t count, bint final) noexcept nogil
    cdef int _poll_send_locked(self) noexcept nogil
    cdef void _offer(self) noexcept nogil


cdef inline void bind_wr(ibv_send_wr *w, ibv_mw *mw, ibv_mr *mr, uint64_t addr, uint64_t length,
                        unsigned int access, uint32_t rkey) noexcept nogil:
    """w: the signaled BIND_MW of type-2 window ``mw`` over [addr, addr+length) of
    ``mr`` with ``access``, giving it key ``rkey`` (ibv_inc_rkey of its last)."""
    memset(w, 0, sizeof(ibv_send_wr))
    w.wr_id, w.opcode, w.send_flags = INTERNAL, IBV_WR_BIND_MW, IBV_SEND_SIGNALED
    w.bind_mw.mw, w.bind_mw.rkey = mw, rkey
    w.bind_mw.bind_info.mr, w.bind_mw.bind_info.addr = mr, addr
    w.bind_mw.bind_info.length, w.bind_mw.bind_info.mw_access_flags = length, access

