# The verbs provider's device, each unit the one writer of its fields (the pointers
# too: Cython cannot declare a pointer readonly, so the rule is the comment's):
#   VerbsDevice  an opened device, once per process: context, completion channel, the
#                shared send and receive CQs, the table that routes their completions
#                to the queue pair they belong to, and the thread that turns the
#                channel's events into wake-ups of sleeping endpoints
#   rmv_route    one queue pair's share of those CQs: the completions routed to it,
#                written by whichever thread polled them, read by the QP's owner
# What an endpoint registers is _memory.pxd's (VerbsMemory) and _block.pxd's.
from libc.stdint cimport uint32_t, uint64_t

from rdmamw.providers.verbs._ibverbs cimport (
    ibv_comp_channel,
    ibv_context,
    ibv_cq,
    ibv_mr,
    ibv_mw,
    ibv_pd,
    ibv_qp,
    ibv_recv_wr,
    ibv_sge,
    ibv_wc,
)

cdef enum:
    WC_BATCH = 32       # completions polled at once
    RECV_POOL = 64      # receive WRs posted with one call
    RECV_BUF = 64       # the bytes of the one buffer every receive WR points at
    MAX_CQS = 256       # CQs of each kind per device (each holds cq_cap completions)
    NOT_TAKEN = -1000   # _take: another thread holds that CQ's lock

cdef extern from *:
    """
    #include <errno.h>
    #define RMV_XMR_BUSY ((struct ibv_mr *)1)
    static inline void rmv_set_errno(int e) { errno = e; }   /* Cython: errno = would be a local */
    static inline uint64_t rmv_add64(volatile uint64_t *p, uint64_t v) {
        return __atomic_add_fetch((uint64_t *)p, v, __ATOMIC_SEQ_CST);
    }
    static inline uint64_t rmv_load64(const volatile uint64_t *p) {
        return __atomic_load_n((const uint64_t *)p, __ATOMIC_SEQ_CST);
    }
    static inline int rmv_cas64(volatile uint64_t *p, uint64_t *expected, uint64_t v) {
        return __atomic_compare_exchange_n((uint64_t *)p, expected, v, 0,
                                           __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    static inline int rmv_load32(const volatile int *p) {
        return __atomic_load_n((const int *)p, __ATOMIC_SEQ_CST);
    }
    static inline void rmv_store32(volatile int *p, int v) {
        __atomic_store_n((int *)p, v, __ATOMIC_SEQ_CST);
    }
    static inline int rmv_add32(volatile int *p, int v) {
        return __atomic_add_fetch((int *)p, v, __ATOMIC_SEQ_CST);
    }
    static inline int rmv_flip32(volatile int *p, int from, int to) {
        return __atomic_compare_exchange_n((int *)p, &from, to, 0, __ATOMIC_SEQ_CST,
                                           __ATOMIC_SEQ_CST);
    }
    """
    ibv_mr *XMR_BUSY "RMV_XMR_BUSY"     # a claimed slot whose ibv_reg_mr is under way
    uint64_t rmv_add64(uint64_t *p, uint64_t v) nogil
    uint64_t rmv_load64(uint64_t *p) nogil
    bint rmv_cas64(uint64_t *p, uint64_t *expected, uint64_t v) nogil
    int rmv_load32(int *p) nogil
    void rmv_store32(int *p, int v) nogil
    int rmv_add32(int *p, int v) nogil
    bint rmv_flip32(int *p, int frm, int to) nogil
    void rmv_set_errno(int e) nogil


cdef struct rmv_route:
    uint32_t qpn
    ibv_qp *qp
    uint32_t scq, rcq               # its CQs: indices into the device's tables
    uint32_t sq_need, rq_need       # the completions it may have in them at once
    # send completions, moved here by whoever polled the CQ (ilock: a leaf lock)
    ibv_wc *inbox
    uint32_t inbox_cap, inbox_head, inbox_len
    int ilock
    int overflow                    # a completion found no room (never, if sized right)
    # receive completions: counted, their WRs reposted by whoever polled them (under
    # the CQ's lock); the first failed one kept for the owner
    uint64_t recv_ok
    int recv_failed
    int post_errno
    ibv_wc recv_err
    ibv_recv_wr rwr[RECV_POOL]
    ibv_sge rsge
    # wake-ups: the owner sleeps on evfd with ``sleeping`` set; a poller that routes a
    # receive completion to a sleeping route writes evfd
    int evfd
    int sleeping
    # a ring that grows: a poller that routes a receive completion while *hook_want
    # is nonzero (the peer waits for credit) calls hook(hook_owner), under the CQ's
    # lock (leave() takes it: no call after the route left)
    void (*hook)(void *owner) noexcept nogil
    void *hook_owner
    uint64_t *hook_want


# a route's life: made with its eventfd and inbox, its receive WRs filled and posted
# (before the device routes to it), freed after the device let go of it
cdef rmv_route *route_new(uint32_t inbox_cap) except NULL
cdef int route_fill(rmv_route *r, uint64_t buf, uint32_t lkey, uint32_t depth) except -1
cdef int route_post(rmv_route *r, int k) noexcept nogil
cdef void route_free(rmv_route *r) noexcept

cdef class VerbsDevice:
    # all made by __init__ (or none: it raises and __dealloc__ frees what was made)
    cdef ibv_context *ctx
    cdef ibv_comp_channel *chan     # events of the receive CQs (wake-ups, immediates)
    cdef readonly str name
    cdef readonly int fd            # the channel's (non-blocking), read by the thread
    # the device's limits, read once
    cdef readonly int max_qp, max_qp_wr, max_cq, max_cqe, max_mr, max_pd
    cdef readonly uint32_t cq_cap   # completions per shared CQ
    # the shared CQs: send (no events) and receive (on the channel); each lock is held
    # while the CQ is polled and its completions routed
    cdef ibv_cq *scqs[MAX_CQS]
    cdef ibv_cq *rcqs[MAX_CQS]
    cdef uint32_t s_used[MAX_CQS]
    cdef uint32_t r_used[MAX_CQS]
    cdef uint32_t s_size[MAX_CQS]
    cdef uint32_t r_size[MAX_CQS]
    cdef int s_lock[MAX_CQS]
    cdef int r_lock[MAX_CQS]
    cdef readonly uint32_t n_scqs, n_rcqs
    # routes by QP number (open addressing, tlock; taken inside a CQ lock)
    cdef rmv_route **table
    cdef uint32_t tcap
    cdef readonly uint32_t n_qps
    cdef int tlock
    cdef int sleepers               # routes with ``sleeping`` set
    cdef int n_mrs                  # memory registrations of the process here (<= max_mr)
    cdef int n_mws                  # memory windows of the process here
    cdef readonly bint has_windows  # type-2 memory windows (bound to one QP each)
    cdef readonly bint soft_roce    # the kernel's rdma_rxe (its vendor id, 0xFFFFFF)
    # the process's protection domain, made on the first endpoint with windows and
    # shared by them all (each peer's access is its windows'), with the VerbsMemory
    # that holds the registration caches' MRs for all of them (once per buffer)
    cdef ibv_pd *pd
    cdef readonly object shared_memory
    cdef int n_pds                  # protection domains of the process here
    cdef int stopfd                 # wakes the thread to end (tests, never in use)
    cdef object thread
    cdef readonly uint64_t n_events, n_routed, n_dropped
    cdef int owner_pid              # the process that opened it (a fork child must not
    cdef const int *pid_now         # destroy the parent's objects: same uverbs file)

    cdef inline bint inherited(self) noexcept nogil:
        return self.owner_pid != self.pid_now[0]

    cdef int join(self, rmv_route *r, uint32_t sq_need, uint32_t rq_need) except -1
    cdef uint32_t _room(self, ibv_cq **cqs, uint32_t *used, uint32_t *size, uint32_t *n,
                        uint32_t need, bint events) except? 0xFFFFFFFF
    cdef void _put(self, rmv_route **t, uint32_t cap, rmv_route *r) noexcept nogil
    cdef rmv_route *_find(self, uint32_t qpn) noexcept nogil
    cdef int _take(self, int *lock, ibv_cq *cq, ibv_wc *wcs, bint wait) noexcept nogil
    cdef void _routes(self, ibv_wc *wcs, int k, rmv_route **out) noexcept nogil
    cdef int add(self, rmv_route *r) except -1
    cdef void leave(self, rmv_route *r) noexcept
    cdef void purge(self, rmv_route *r) noexcept
    cdef int poll_send(self, uint32_t i, bint wait) noexcept nogil
    cdef int poll_recv(self, uint32_t i, bint wait) noexcept nogil
    cdef void arm(self, uint32_t i, bint solicited=*) noexcept nogil
    cdef void sleep(self, rmv_route *r, bint up) noexcept nogil
    cdef ibv_mr *reg_mr(self, ibv_pd *pd, void *addr, size_t length, int flags) noexcept nogil
    cdef void dereg_mr(self, ibv_mr *mr) noexcept nogil
    cdef ibv_mw *alloc_mw(self, ibv_pd *pd) noexcept nogil
    cdef void dealloc_mw(self, ibv_mw *mw) noexcept nogil
    cdef void dispatch(self) noexcept nogil
