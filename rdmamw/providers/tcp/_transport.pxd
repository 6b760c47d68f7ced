# The tcp provider's endpoint and the C side it drives (rdmamw/providers/tcp/rm_tcp.h),
# declared here so the test-only hooks (rdmamw/testing/_hooks.pyx) can run the
# frame decoder on its own; the package itself never imports them.
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from rdmamw.transport._base cimport Transport, rm_wr

cdef extern from "rm_expose.h" nogil:
    enum:
        RM_XACC_READ, RM_XACC_WRITE, RM_XACC_ATOMIC, RM_XTAG_SHIFT, RM_RWHY_GONE
    ctypedef struct rm_xtab:
        pass

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "pthread.h" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_cond_init(pthread_cond_t *c, const void *attr)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_create(pthread_t *t, const void *attr, void *(*fn)(void *) noexcept nogil,
                       void *arg)
    int pthread_join(pthread_t t, void **ret)
    int pthread_mutex_init(pthread_mutex_t *m, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)

cdef extern from "rm_tcp.h" nogil:
    enum:
        RT_WRITE, RT_PUBLISH, RT_WAKE, RT_READ_REQ, RT_READ_RESP, RT_HEARTBEAT
        RT_WRITE_IMM, RT_XREAD_REQ, RT_XWRITE, RT_READ_ERR, RT_RCHAIN, RT_RDONE, RT_NTYPES
        RT_NREG, RT_RD_MAX, RT_RCH_MAX
        RT_RK_READ, RT_RK_RREAD, RT_RK_DONE, RT_RK_DROP
        RT_OP_READ, RT_OP_WRITE, RT_OP_FADD, RT_OP_CSWAP
        RT_UP, RT_LOST, RT_CLOSED
        RT_WHY_NONE, RT_WHY_EOF, RT_WHY_IO, RT_WHY_TIMEOUT, RT_WHY_FRAME, RT_WHY_LOCAL,
        RT_WHY_HOST, RT_WHY_STALLED
        RT_DIRECT, RT_QUEUE, RT_QUEUE_LATE, RT_LATE
    ctypedef struct rt_frame:
        uint16_t type
        uint16_t region
        uint32_t length
        uint64_t offset
    uint32_t RT_PIECE
    ctypedef struct rt_rdesc:
        uint16_t op
        uint16_t key
        uint32_t tag
        uint64_t addr
        uint32_t length
        uint32_t reserved
    ctypedef struct rt_rcell:
        uint32_t why, index
        int read_err, queued, done
    ctypedef struct rt_conn:
        int sock, evfd
        int state, stop, waiting, why, err_no
        int closing, exited
        uint64_t pub_gen, seen_gen
        char *addr[4]
        uint64_t len[4]
        char *pubbuf
        uint32_t pubcap
        pthread_mutex_t send_mu
        int64_t last_rx, last_tx, hb_ns, timeout_ns, host_ns
        uint64_t rd_addr[1024]
        uint32_t rd_len[1024]
        uint8_t rd_err[1024]
        uint8_t rd_kind[1024]
        rt_rcell *rd_cell[1024]
        uint64_t rd_posted, rd_done
        pthread_mutex_t rd_mu, rf_mu
        pthread_cond_t rd_cv
        void *xtab
        pthread_mutex_t xp_mu, xw_mu, rq_mu
        pthread_cond_t rq_cv
        uint64_t frames_rx, bytes_rx, wakes_rx, heartbeats_tx
        rt_frame bad
        pthread_mutex_t bl_mu
        char *bl
        size_t bl_len
        uint64_t bl_bytes
        int torn
    int64_t rt_now()
    int rt_state(rt_conn *c)
    void rt_lose(rt_conn *c, int why, int err)
    int rt_send_locked(rt_conn *c, iovec *iov, int cnt)
    int rt_send_empty(rt_conn *c, uint16_t type, int64_t deadline, int may_wait)
    int rt_turn(rt_conn *c, int64_t deadline, int may_wait, int *held)
    int rt_commit(rt_conn *c, iovec *iov, int cnt, int mode, int held, int64_t deadline,
                  int may_wait)
    void *rt_progress(void *arg)
    void *rt_responder(void *arg)
    uint32_t rt_expose(rt_conn *c, uint64_t addr, uint64_t len, uint32_t access)
    void rt_unexpose(rt_conn *c, uint32_t key)
    void rt_close_graceful(rt_conn *c, int64_t linger_ns)
    int rt_wait(rt_conn *c, int timeout_ms)
    void rt_signal(rt_conn *c)
    int rt_arm(rt_conn *c)
    void rt_disarm(rt_conn *c)
    int rt_rchain_send(rt_conn *c, const rt_rdesc *descs, const uint64_t *local, uint32_t n,
                       iovec *iov, rt_rcell *cell, int64_t deadline, int may_wait)
    int rt_rcell_wait(rt_conn *c, rt_rcell *cell, int64_t deadline)
    int rt_rscratch_take(rt_conn *c, uint32_t n, rt_rdesc **descs, uint64_t **local,
                         iovec **iov, int *own)
    void rt_rscratch_give(rt_conn *c, rt_rdesc *descs, uint64_t *local, iovec *iov, int own)
    void rt_rscratch_free(rt_conn *c)
    void rt_refusal_set(const rt_conn *c, uint32_t why, uint32_t key, uint32_t tag, int write,
                        uint64_t addr, uint64_t len)
    uint32_t rt_refusal_get(const rt_conn *c, uint32_t key, uint32_t tag, int write,
                            uint64_t addr, uint64_t len)
    uint64_t rt_atomic_load64 "__atomic_load_n"(uint64_t *p, int order)
    void rt_atomic_store64 "__atomic_store_n"(uint64_t *p, uint64_t v, int order)
    int __ATOMIC_ACQUIRE, __ATOMIC_RELEASE, __ATOMIC_SEQ_CST


cdef enum:
    MAX_LOCAL = 32


cdef class TcpTransport(Transport):
    cdef rt_conn *c
    cdef char *block
    cdef size_t block_size
    cdef pthread_t thread
    cdef pthread_t responder
    cdef bint responder_started
    cdef bint started
    cdef bint mutex_ready
    cdef rt_frame *hdrs
    cdef iovec *iov
    cdef uint32_t cap
    cdef uint64_t reg_lo[MAX_LOCAL]
    cdef uint64_t reg_hi[MAX_LOCAL]
    cdef uint32_t nreg
    cdef uint64_t aread_id          # the asynchronous READ in flight: its wr_id ...
    cdef uint64_t aread_seq         # ... and rd_posted after it (0: none)
    cdef uint64_t rid, peer_rid     # region identities: this endpoint's, the peer's
    cdef bint peer_atomics          # the peer's hello said it serves region atomics

    cdef bint _registered(self, uint64_t addr, uint64_t length) noexcept nogil
    cdef int _reserve(self, uint32_t n) noexcept nogil
    cdef int _post_region(self, rm_wr *wrs, uint32_t n) noexcept nogil
