# cython: freethreading_compatible = False
"""The ``tcp`` provider's data path: mini-verbs over one TCP connection.

post() turns a chain of work requests into frames {type, region, length, offset} +
payload and hands the whole chain to the kernel with one ``sendmsg`` (scatter-gather
straight from the sources: no copy in user space), so ``synchronous`` and
``direct_source`` hold. The peer's progress thread (C, rdmamw/include/rm_tcp.h, no
GIL) receives each payload straight into the target offset of its registered region
after a bounds check; PUBLISH words are stored with release order. READ is a
request/response pair served from the peer's regions only.

Rendezvous: expose() enters a range in this side's exposure table (rm_expose.h); the
peer's XREAD_REQ / XWRITE frames for it are checked against that table here, by the
progress thread (XWRITE) and a responder thread (XREAD_REQ) that answers READs, so a
large answer never keeps this side from receiving."""

import os
import socket
import threading

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memset
from posix.stdlib cimport posix_memalign

from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_OS,
    RM_ERR_PEER_LOST,
    RM_NREGIONS,
    RM_REGION_ARRIVAL,
    RM_REGION_CTRL,
    RM_REGION_RECLAIM,
    RM_ERR_UNSUPPORTED,
    RM_WR_EXPOSED,
    RM_WR_PUBLISH,
    RM_WR_READ,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    RM_WR_WRITE_IMM,
    Transport,
    rm_mem,
    rm_wc,
    rm_wr,
)

cdef extern from "rm_expose.h" nogil:
    enum:
        RM_XACC_READ, RM_XACC_WRITE
    ctypedef struct rm_xtab:
        pass

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "sched.h" nogil:
    int sched_yield()

cdef extern from "unistd.h" nogil:
    int close(int fd)

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
        RT_WRITE_IMM, RT_XREAD_REQ, RT_XWRITE, RT_READ_ERR, RT_NTYPES
        RT_NREG, RT_RD_MAX
        RT_UP, RT_LOST, RT_CLOSED
        RT_WHY_NONE, RT_WHY_EOF, RT_WHY_IO, RT_WHY_TIMEOUT, RT_WHY_FRAME, RT_WHY_LOCAL
    ctypedef struct rt_frame:
        uint16_t type
        uint16_t region
        uint32_t length
        uint64_t offset
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
        int64_t last_rx, last_tx, hb_ns, timeout_ns
        uint64_t rd_addr[256]
        uint32_t rd_len[256]
        uint8_t rd_err[256]
        uint64_t rd_posted, rd_done
        void *xtab
        pthread_mutex_t xp_mu, xw_mu, rq_mu
        pthread_cond_t rq_cv
        uint64_t frames_rx, bytes_rx, wakes_rx, heartbeats_tx
        rt_frame bad
    int64_t rt_now()
    int rt_state(rt_conn *c)
    void rt_lose(rt_conn *c, int why, int err)
    int rt_send_locked(rt_conn *c, iovec *iov, int cnt)
    int rt_send_empty(rt_conn *c, uint16_t type)
    void *rt_progress(void *arg)
    void *rt_responder(void *arg)
    uint32_t rt_expose(rt_conn *c, uint64_t addr, uint64_t len, uint32_t access)
    void rt_unexpose(rt_conn *c, uint32_t key)
    void rt_close_graceful(rt_conn *c, int64_t linger_ns)
    int rt_wait(rt_conn *c, int timeout_ms)
    uint64_t rt_atomic_load64 "__atomic_load_n"(uint64_t *p, int order)
    void rt_atomic_store64 "__atomic_store_n"(uint64_t *p, uint64_t v, int order)
    int __ATOMIC_ACQUIRE, __ATOMIC_RELEASE, __ATOMIC_SEQ_CST

assert RT_LOST == RM_ERR_PEER_LOST and RT_CLOSED == RM_ERR_CLOSED and RT_NREG == RM_NREGIONS

FRAME_BYTES = sizeof(rt_frame)
FRAME_TYPES = {"WRITE": RT_WRITE, "PUBLISH": RT_PUBLISH, "WAKE": RT_WAKE,
               "READ_REQ": RT_READ_REQ, "READ_RESP": RT_READ_RESP,
               "HEARTBEAT": RT_HEARTBEAT, "WRITE_IMM": RT_WRITE_IMM,
               "XREAD_REQ": RT_XREAD_REQ, "XWRITE": RT_XWRITE, "READ_ERR": RT_READ_ERR}
_WHY = {RT_WHY_NONE: "", RT_WHY_EOF: "peer closed the connection",
        RT_WHY_IO: "socket error", RT_WHY_TIMEOUT: "peer silent past the timeout",
        RT_WHY_FRAME: "malformed frame", RT_WHY_LOCAL: "closed locally"}

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

    def __cinit__(self):
        self.c = <rt_conn *>calloc(1, sizeof(rt_conn))
        if self.c == NULL:
            raise MemoryError()
        self.c.sock = -1
        self.c.evfd = -1
        self.c.state = RT_CLOSED
        if pthread_mutex_init(&self.c.send_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.xp_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.xw_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.rq_mu, NULL) != 0 \
                or pthread_cond_init(&self.c.rq_cv, NULL) != 0:
            raise OSError("pthread_mutex_init failed")
        self.mutex_ready = True
        self.c.xtab = calloc(1, sizeof(rm_xtab))
        if self.c.xtab == NULL:
            raise MemoryError()
        self.can_expose = True
        self.direct_source = True       # sendmsg reads the sources before post() returns
        self.synchronous = True
        self.async_read = True          # a rendezvous READ waits in the engine (deadline)
        self.max_inline = 1 << 30

    def _attach(self, int sock, int evfd, size_t block_addr, size_t block_size,
                tuple my_regions, tuple peer_regions, double heartbeat, double peer_timeout):
        """Adopt a connected non-blocking socket, an eventfd and a block from
        ``alloc_block`` (regions are ((offset, length) x RM_NREGIONS)), then start the
        progress thread. Takes ownership of sock, evfd and the block only on success;
        if it raises, they are still the caller's."""
        cdef int i
        cdef uint32_t pubcap = 8
        for regions, size in ((my_regions, block_size), (peer_regions, None)):
            if len(regions) != RM_NREGIONS:
                raise ValueError("need one (offset, length) per region")
            for off, length in regions:
                if off < 0 or length <= 0 or (size is not None and off + length > size):
                    raise ValueError(f"region ({off}, {length}) outside a block of {size}")
        if self.started or self.block != NULL:
            raise ValueError("transport already attached")
        for i in (RM_REGION_CTRL, RM_REGION_ARRIVAL, RM_REGION_RECLAIM):
            pubcap = max(pubcap, <uint32_t>my_regions[i][1])
        self.c.pubbuf = <char *>malloc(pubcap)
        if self.c.pubbuf == NULL:
            raise MemoryError()
        self.c.pubcap = pubcap
        for i in range(RM_NREGIONS):
            self.local[i].addr = <char *>block_addr + <size_t>my_regions[i][0]
            self.local[i].length = my_regions[i][1]
            self.c.addr[i] = self.local[i].addr
            self.c.len[i] = self.local[i].length
            self.peer[i].addr = NULL
            self.peer[i].length = peer_regions[i][1]
        self.c.hb_ns = <int64_t>(heartbeat * 1e9)
        self.c.timeout_ns = <int64_t>(peer_timeout * 1e9)
        self.c.sock, self.c.evfd = sock, evfd
        self.c.last_tx = rt_now()
        self.c.state = RT_UP
        if pthread_create(&self.thread, NULL, rt_progress, self.c) != 0:
            self.c.state = RT_CLOSED
            self.c.sock = self.c.evfd = -1
            for i in range(RM_NREGIONS):
                self.local[i].addr = NULL
                self.local[i].length = 0
                self.c.len[i] = 0
            raise OSError("cannot start the tcp progress thread")
        self.block = <char *>block_addr
        self.block_size = block_size
        self.started = True
        if pthread_create(&self.responder, NULL, rt_responder, self.c) != 0:
            self.can_expose = False     # no rendezvous on this connection, eager still works
        else:
            self.responder_started = True

    def register_local(self, size_t addr, size_t length):
        """Remember a READ target range (WRITE sources need no registration)."""
        if self.nreg == MAX_LOCAL:
            raise ValueError("too many local registrations")
        self.reg_lo[self.nreg] = addr
        self.reg_hi[self.nreg] = addr + length
        self.nreg += 1
        return self.nreg

    cdef bint _registered(self, uint64_t addr, uint64_t length) noexcept nogil:
        cdef uint32_t i
        for i in range(self.nreg):
            if addr >= self.reg_lo[i] and addr + length <= self.reg_hi[i]:
                return True
        return False

    cdef int _reserve(self, uint32_t n) noexcept nogil:
        cdef void *p
        if n <= self.cap:
            return 0
        n = max(n, 2 * self.cap, 16)
        p = realloc(self.hdrs, n * sizeof(rt_frame))
        if p == NULL:
            return RM_ERR_OS
        self.hdrs = <rt_frame *>p
        p = realloc(self.iov, 2 * n * sizeof(iovec))
        if p == NULL:
            return RM_ERR_OS
        self.iov = <iovec *>p
        self.cap = n
        return 0

    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        cdef uint32_t i, k = 0, nreads = 0
        cdef rm_wr *wr
        cdef rt_frame *f
        cdef int st = rt_state(self.c), rc
        cdef uint64_t target, posted
        cdef bint deferred = True       # one exposed SIGNALED READ: poll() says when done
        if st != RT_UP:
            return st
        for i in range(n):      # validate the whole chain first: all or nothing
            wr = &wrs[i]
            if wr.flags & RM_WR_EXPOSED:    # the peer checks its own exposure table
                if wr.rkey > 0xFFFF or wr.flags & RM_WR_PUBLISH or (
                        wr.opcode != RM_WR_READ and wr.opcode != RM_WR_WRITE):
                    return RM_ERR_BOUNDS
                if wr.opcode == RM_WR_READ:
                    nreads += 1
                    deferred = deferred and (wr.flags & RM_WR_SIGNALED) != 0
                continue
            if wr.rkey >= RM_NREGIONS or wr.remote_off > self.peer[wr.rkey].length \
                    or wr.length > self.peer[wr.rkey].length - wr.remote_off:
                return RM_ERR_BOUNDS
            if wr.opcode == RM_WR_READ:
                if wr.flags & RM_WR_PUBLISH or not self._registered(wr.local_addr, wr.length):
                    return RM_ERR_BOUNDS
                nreads += 1
                deferred = False        # region READs (tests) finish inside post()
            elif wr.opcode != RM_WR_WRITE and wr.opcode != RM_WR_WRITE_IMM:
                return RM_ERR_BOUNDS
            if wr.flags & RM_WR_PUBLISH and ((wr.remote_off | wr.length | wr.local_addr) & 7):
                return RM_ERR_BOUNDS
        deferred = deferred and nreads == 1 and self.aread_seq == 0
        if nreads > RT_RD_MAX or self._reserve(n) != 0:
            return RM_ERR_BOUNDS if nreads > RT_RD_MAX else RM_ERR_OS
        pthread_mutex_lock(&self.c.send_mu)
        posted = self.c.rd_posted
        if nreads and posted + nreads - rt_atomic_load64(&self.c.rd_done, __ATOMIC_ACQUIRE) \
                > RT_RD_MAX:
            pthread_mutex_unlock(&self.c.send_mu)
            return RM_ERR_BOUNDS
        for i in range(n):
            wr = &wrs[i]
            f = &self.hdrs[i]
            f.region = <uint16_t>wr.rkey
            f.length = wr.length
            f.offset = wr.remote_off
            self.iov[k].iov_base = f
            self.iov[k].iov_len = sizeof(rt_frame)
            k += 1
            if wr.opcode == RM_WR_READ:
                f.type = RT_XREAD_REQ if wr.flags & RM_WR_EXPOSED else RT_READ_REQ
                self.c.rd_addr[posted % RT_RD_MAX] = wr.local_addr
                self.c.rd_len[posted % RT_RD_MAX] = wr.length
                self.c.rd_err[posted % RT_RD_MAX] = 0
                posted += 1
                continue
            if wr.flags & RM_WR_EXPOSED:
                f.type = RT_XWRITE
                self.bytes_written += wr.length
            elif wr.flags & RM_WR_PUBLISH:
                f.type = RT_PUBLISH
            elif wr.opcode == RM_WR_WRITE_IMM:
                f.type = RT_WRITE_IMM
            else:
                f.type = RT_WRITE
                self.bytes_written += wr.length
            self.iov[k].iov_base = <void *>wr.local_addr
            self.iov[k].iov_len = wr.length
            k += 1
        rt_atomic_store64(&self.c.rd_posted, posted, __ATOMIC_RELEASE)
        if deferred:
            for i in range(n):
                if wrs[i].opcode == RM_WR_READ:
                    self.aread_id = wrs[i].wr_id
            rt_atomic_store64(&self.aread_seq, posted, __ATOMIC_RELEASE)
        rc = rt_send_locked(self.c, self.iov, k)
        pthread_mutex_unlock(&self.c.send_mu)
        if rc != 0:
            return rc
        self.n_doorbells += 1
        self.n_wrs += n
        if nreads and not deferred:     # the READ targets are filled when post() returns
            while rt_atomic_load64(&self.c.rd_done, __ATOMIC_ACQUIRE) < posted:
                st = rt_state(self.c)
                if st != RT_UP:
                    return st
                sched_yield()
            for i in range(nreads):
                if self.c.rd_err[(posted - 1 - i) % RT_RD_MAX]:
                    return RM_ERR_BOUNDS    # the peer had not exposed that range
        for i in range(n):
            if wrs[i].flags & RM_WR_SIGNALED:
                self.n_signaled += 1
                if not (deferred and wrs[i].opcode == RM_WR_READ):
                    self.complete_now(wrs[i].wr_id, wrs[i].opcode)
        return 0

    cdef int poll(self, rm_wc *wcs, uint32_t maxn) noexcept nogil:
        """The soft completions, then the deferred READ once the peer answered it
        (status 10, a remote access error, if it refused)."""
        cdef int k = Transport.poll(self, wcs, maxn)
        cdef uint64_t seq = rt_atomic_load64(&self.aread_seq, __ATOMIC_ACQUIRE)
        if seq and <uint32_t>k < maxn and \
                rt_atomic_load64(&self.c.rd_done, __ATOMIC_ACQUIRE) >= seq:
            wcs[k].wr_id = self.aread_id
            wcs[k].status = 10 if self.c.rd_err[(seq - 1) % RT_RD_MAX] else 0
            wcs[k].opcode = RM_WR_READ
            rt_atomic_store64(&self.aread_seq, 0, __ATOMIC_RELEASE)
            self.n_completions += 1
            k += 1
        return k

    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil:
        cdef uint32_t key
        out.handle = out.lkey = out.rkey = 0
        if access == RM_ACCESS_LOCAL:
            return 0
        if not self.can_expose or rt_state(self.c) != RT_UP:
            return RM_ERR_CLOSED
        if access != RM_ACCESS_REMOTE_READ and access != RM_ACCESS_REMOTE_WRITE:
            return RM_ERR_UNSUPPORTED
        key = rt_expose(self.c, addr, length,
                        RM_XACC_READ if access == RM_ACCESS_REMOTE_READ else RM_XACC_WRITE)
        if key == 0:
            return RM_ERR_AGAIN
        out.handle = out.rkey = key
        return 0

    cdef int unexpose(self, uint32_t handle) noexcept nogil:
        if handle and self.c != NULL:
            rt_unexpose(self.c, handle)
        return 0

    cdef int wake_peer(self) noexcept nogil:
        self.n_wakeups += 1
        return rt_send_empty(self.c, RT_WAKE)

    cdef int wait(self, int timeout_ms) noexcept nogil:
        return rt_wait(self.c, timeout_ms)

    cdef int peer_state(self) noexcept nogil:
        cdef int st = rt_state(self.c)
        return 1 if st == RT_UP else st

    def close(self):
        """Drop the connection gracefully (what was posted still arrives; see
        rt_close_graceful) and stop the progress thread. The block lives until the
        last Message pointing into it is gone (the engine holds this object)."""
        if self.c == NULL:
            return
        if self.inherited():
            # a fork child: the progress threads are the parent's (not in this process)
            # and a close frame on the shared socket would hang up the parent's peer
            self.started = self.responder_started = False
            self.c.state = RT_CLOSED
        if self.started:
            with nogil:
                rt_close_graceful(self.c, 2000000000)
                pthread_join(self.thread, NULL)
                if self.responder_started:
                    pthread_join(self.responder, NULL)
            self.started = False
            self.responder_started = False
        elif self.c.state == RT_UP:
            self.c.state = RT_CLOSED
        if self.c.sock >= 0:
            close(self.c.sock)
            self.c.sock = -1
        if self.c.evfd >= 0:
            close(self.c.evfd)
            self.c.evfd = -1

    def __dealloc__(self):
        if self.c != NULL:
            self.close()
            if self.mutex_ready and not self.inherited():    # a parent's thread may hold one
                pthread_mutex_destroy(&self.c.send_mu)
                pthread_mutex_destroy(&self.c.xp_mu)
                pthread_mutex_destroy(&self.c.xw_mu)
                pthread_mutex_destroy(&self.c.rq_mu)
                pthread_cond_destroy(&self.c.rq_cv)
            free(self.c.xtab)
            free(self.c.pubbuf)
            free(self.c)
            self.c = NULL
        free(self.block)
        free(self.hdrs)
        free(self.iov)

    def _read_remote(self, uint32_t rkey, uint64_t off, uint32_t length) -> bytes:
        """READ ``length`` bytes at ``off`` of the peer's region ``rkey`` (tests and
        debugging; the engine will use READ for rendezvous)."""
        cdef rm_wr wr
        cdef int rc
        cdef char *buf = <char *>malloc(length or 1)
        if buf == NULL:
            raise MemoryError()
        self.register_local(<size_t>buf, length)
        memset(&wr, 0, sizeof(wr))
        wr.local_addr = <uint64_t>buf
        wr.remote_off = off
        wr.length = length
        wr.rkey = rkey
        wr.opcode = RM_WR_READ
        wr.flags = RM_WR_SIGNALED
        try:
            with nogil:
                rc = self.post(&wr, 1)
            if rc == RM_ERR_BOUNDS:
                raise ValueError("READ outside the peer's regions")
            if rc != 0:
                raise ConnectionError(f"READ failed ({rc}): {self.error}")
            return buf[:length]
        finally:
            self.nreg -= 1
            free(buf)

    def error_detail(self):
        """Why the connection went down, for PeerLost's message (None while it is up)."""
        return self.error or None

    @property
    def error(self) -> str:
        """Why the connection went down ('' while it is up)."""
        if self.c == NULL:
            return "closed"
        why = _WHY.get(self.c.why, "")
        if self.c.why == RT_WHY_FRAME:
            b = self.c.bad
            why += f" (type {b.type}, region {b.region}, offset {b.offset}, length {b.length})"
        elif self.c.why == RT_WHY_IO and self.c.err_no:
            why += f" (errno {self.c.err_no})"
        return why

    def counters(self):
        d = Transport.counters(self)
        if self.c != NULL:
            d.update(frames_received=self.c.frames_rx, bytes_received_raw=self.c.bytes_rx,
                     wakeups_received=self.c.wakes_rx, heartbeats_sent=self.c.heartbeats_tx)
        return d


def alloc_block(size_t size) -> int:
    """A zeroed, page-aligned block for an endpoint's regions; pass it to _attach,
    which then owns it."""
    cdef void *p = NULL
    if posix_memalign(&p, 4096, size) != 0:
        raise MemoryError()
    memset(p, 0, size)
    return <size_t>p


def free_block(size_t addr) -> None:
    """Free a block that was never handed to a transport."""
    free(<void *>addr)


# ---- decoder harness (fuzzing only) ----------------------------------------------

def apply_stream(bytes data, size_t region_bytes=4096, bint answer_reads=True) -> tuple:
    """Feed ``data`` as the byte stream of a connection to a progress thread whose
    four regions are ``region_bytes`` each, surrounded by guard bytes; return
    (frames applied, why it stopped, guards intact). For the fuzz tests: whatever
    the bytes, nothing outside the regions may change and nothing may crash.

    ``answer_reads=False`` is the fast mode of bench/fuzz_tcp.py: no helper threads
    (``data`` must fit the socket buffer), and the first READ_REQ that passes the
    bounds check ends the stream (its answer cannot be sent)."""
    cdef size_t guard = 4096
    cdef size_t total = 2 * guard + RT_NREG * region_bytes
    cdef char *mem = <char *>malloc(total)
    cdef rt_conn *c = <rt_conn *>calloc(1, sizeof(rt_conn))
    cdef int i
    cdef bint intact = True
    if mem == NULL or c == NULL:
        free(mem)
        free(c)
        raise MemoryError()
    memset(mem, 0xA5, total)
    a, b = socket.socketpair()
    evfd = os.eventfd(0, os.EFD_NONBLOCK)
    threads = []
    try:
        a.setblocking(False)
        pthread_mutex_init(&c.send_mu, NULL)
        for i in range(RT_NREG):
            c.addr[i] = mem + guard + i * region_bytes
            c.len[i] = region_bytes
            memset(c.addr[i], 0, region_bytes)
        c.pubbuf = <char *>malloc(region_bytes)
        c.pubcap = <uint32_t>region_bytes
        c.sock = a.fileno()
        c.evfd = evfd
        c.state = RT_UP
        c.timeout_ns = 2000000000
        if answer_reads:    # READ_REQ frames are answered: drain so nothing blocks
            threads = [threading.Thread(target=_drain, args=(b,), daemon=True),
                       threading.Thread(target=_feed, args=(b, data), daemon=True)]
            for t in threads:
                t.start()
        else:
            b.sendall(data)
            b.shutdown(socket.SHUT_WR)
            b.shutdown(socket.SHUT_RD)
        with nogil:
            rt_progress(c)
        for i in range(<int>guard):
            if <unsigned char>mem[i] != 0xA5 or <unsigned char>mem[total - 1 - i] != 0xA5:
                intact = False
                break
        return c.frames_rx, _WHY.get(c.why, c.why), intact
    finally:
        a.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join()
        a.close()
        b.close()
        os.close(evfd)
        pthread_mutex_destroy(&c.send_mu)
        free(c.pubbuf)
        free(c)
        free(mem)


def _drain(sock) -> None:
    while sock.recv(65536):
        pass


def _feed(sock, data: bytes) -> None:
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass        # the decoder dropped the connection early: that is allowed
