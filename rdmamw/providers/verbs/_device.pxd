# The verbs provider's device resources, each unit the one writer of its fields (the
# pointers too: Cython cannot declare a pointer readonly, so the rule is the comment's):
#   VerbsDevice  an opened device, once per process: context, completion channel, the
#                shared send and receive CQs, the table that routes their completions
#                to the queue pair they belong to, and the thread that turns the
#                channel's events into wake-ups of sleeping endpoints
#   rmv_route    one queue pair's share of those CQs: the completions routed to it,
#                written by whichever thread polled them, read by the QP's owner
#   VerbsMemory  the protection domain of one endpoint and what is registered on it:
#                local MRs, the registration caches' MRs and the exposure table of
#                rendezvous (one PD per peer: the NIC keeps each peer to the memory
#                registered for it)
from libc.stdint cimport uint32_t, uint64_t

from rdmamw.transport._base cimport rm_mem
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
    XMR_N = 512         # exposed ranges at once (64 sends + 64 posted + reads per side)
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


# this extension's table of libibverbs calls (rm_ibverbs.h keeps one per extension),
# filled from the library _verbs.load() chose: rm_ibv_load's result
cdef int load_table(const char *lib, char *err, size_t errlen) noexcept
# a route's life: made with its eventfd and inbox, its receive WRs filled and posted
# (before the device routes to it), freed after the device let go of it
cdef rmv_route *route_new(uint32_t inbox_cap) except NULL
cdef int route_fill(rmv_route *r, uint64_t buf, uint32_t lkey, uint32_t depth) except -1
cdef int route_post(rmv_route *r, int k) noexcept nogil
cdef void route_free(rmv_route *r) noexcept
# the process's pinned-memory budget (RDMAMW_VERBS_PINNED_BYTES): every registration
# of an endpoint (block, receive buffer, local MRs, cached MRs) is charged before it is
# made and refunded when it goes; 0 charged, -1 over the budget
cdef int pin_charge(uint64_t n) noexcept nogil
cdef void pin_refund(uint64_t n) noexcept nogil


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


cdef enum:
    MAX_PARTS = 40             # parts of a ring that grows (doubling from one slot)
    GRANT_OFF = 1536           # the grant words: control-page words 192..231 (bytes)


cdef class VerbsBlock:
    # the block (mmap: zero pages on demand) and its first part, registered at connect:
    # the header (control words, bitmaps) and the first slots of my ring, or all of it
    cdef VerbsMemory mem
    cdef char *base
    cdef uint64_t length
    cdef ibv_mr *head_mr
    cdef ibv_mw *head_mw                # with windows: the one the peer writes through
    cdef readonly uint32_t head_rkey    # the key the peer gets for the header
    # my ring: the slots the peer may write are registered in parts; offer() registers
    # the next part
    cdef readonly bint on               # my ring started short of its size
    cdef readonly uint32_t slots        # my ring's size, in slots
    cdef uint64_t stride, off           # its slots' stride, where it starts in the block
    cdef readonly uint32_t granted      # slots the peer may write
    cdef uint32_t pending               # slots of a part registered, its word not sent
    cdef ibv_mr *mrs[MAX_PARTS]         # the parts registered after the first
    cdef ibv_mw *mws[MAX_PARTS]         # with windows: theirs (bound with the grant)
    cdef uint32_t n_mrs
    cdef uint64_t charged               # their bytes, charged to the pinned budget
    cdef int lock                       # offer(): one at a time
    cdef bint stopped                   # the budget or a registration said no
    cdef uint64_t *words                # the grant words, as posted (registered)
    cdef ibv_mr *words_mr
    cdef readonly uint64_t given, taken
    # the peer's ring: the parts granted so far (part p: ring bytes below part_end[p],
    # key part_rkey[p]); every WRITE into it stays below ``limit``
    cdef readonly uint32_t peer_slots, peer_granted     # peer_granted 0: all
    cdef uint64_t peer_stride
    cdef readonly uint64_t limit
    cdef uint64_t part_end[MAX_PARTS]
    cdef uint32_t part_rkey[MAX_PARTS]
    cdef uint32_t n_parts
    cdef bint peer_bad                  # a grant word failed its checks: take no more

    cdef int offer(self) noexcept nogil
    cdef void done(self, bint posted) noexcept nogil
    cdef bint take(self, const char *ctrl) noexcept nogil
    cdef void drop_windows(self) noexcept
    cdef inline uint32_t rkey_of(self, uint64_t off) noexcept nogil:
        """The key of the peer's ring part that holds ring offset ``off`` (most slots
        are in the last part: one compare)."""
        cdef uint32_t p = self.n_parts - 1
        while p and off < self.part_end[p - 1]:
            p -= 1
        return self.part_rkey[p]
    cdef void release(self) noexcept
