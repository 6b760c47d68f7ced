# cython: freethreading_compatible = False
"""The ``tcp`` provider's data path: mini-verbs over one TCP connection.

post() turns a chain of work requests into frames {type, region, length, offset} +
payload and hands the whole chain to the kernel with one ``sendmsg`` (scatter-gather
straight from the sources: no copy in user space), so ``synchronous`` and
``direct_source`` hold. The peer's progress thread (C, rdmamw/providers/tcp/rm_tcp.h, no
GIL) receives each payload straight into the target offset of its registered region
after a bounds check; PUBLISH words are stored with release order. READ is a
request/response pair served from the peer's regions only.

Rendezvous: expose() enters a range in this side's exposure table (rm_expose.h); the
peer's XREAD_REQ / XWRITE frames for it are checked against that table here, by the
progress thread (XWRITE) and a responder thread (XREAD_REQ) that answers READs, so a
large answer never keeps this side from receiving.

User regions (docs/remote-memory.md): a chain of region READs/WRITEs (and atomics,
run by the owner's progress thread with the CPU's atomic instructions) is one RCHAIN
frame and one sendmsg, checked by the owner against its own exposure table before
any byte moves and ended by one RDONE (rm_tcp_region.h); the owner's threads serve it,
no application thread of the owner takes part."""

from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memset

from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_ATOMIC,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ACCESS_TAG_SHIFT,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_LATE,
    RM_ERR_OS,
    RM_ERR_PEER_LOST,
    RM_NREGIONS,
    RM_REGION_ARRIVAL,
    RM_REGION_CTRL,
    RM_REGION_RECLAIM,
    RM_ERR_UNSUPPORTED,
    RM_WR_CMP_SWAP,
    RM_WR_EXPOSED,
    RM_WR_FETCH_ADD,
    RM_WR_PUBLISH,
    RM_WR_READ,
    RM_WR_REGION,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    RM_WR_WRITE_IMM,
    Transport,
    rm_mem,
    rm_wc,
    rm_wr,
    pthread_self,
)

cdef extern from "sys/mman.h" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS
    void *MAP_FAILED

cdef extern from "sched.h" nogil:
    int sched_yield()

cdef extern from "unistd.h" nogil:
    int close(int fd)

cdef extern from "Python.h" nogil:
    int PyGILState_Check()      # this thread holds the GIL: a post then never waits


assert RT_LOST == RM_ERR_PEER_LOST and RT_CLOSED == RM_ERR_CLOSED and RT_NREG == RM_NREGIONS
assert RT_LATE == RM_ERR_LATE

FRAME_BYTES = sizeof(rt_frame)
FRAME_TYPES = {"WRITE": RT_WRITE, "PUBLISH": RT_PUBLISH, "WAKE": RT_WAKE,
               "READ_REQ": RT_READ_REQ, "READ_RESP": RT_READ_RESP,
               "HEARTBEAT": RT_HEARTBEAT, "WRITE_IMM": RT_WRITE_IMM,
               "XREAD_REQ": RT_XREAD_REQ, "XWRITE": RT_XWRITE, "READ_ERR": RT_READ_ERR,
               "RCHAIN": RT_RCHAIN, "RDONE": RT_RDONE}
#: bytes of one operation's descriptor in an RCHAIN frame
RDESC_BYTES = sizeof(rt_rdesc)
_WHY = {RT_WHY_NONE: "", RT_WHY_EOF: "peer closed the connection",
        RT_WHY_IO: "socket error", RT_WHY_TIMEOUT: "peer silent past RDMAMW_TCP_PEER_TIMEOUT",
        RT_WHY_FRAME: "malformed frame", RT_WHY_LOCAL: "closed locally",
        RT_WHY_HOST: "peer's host acknowledged nothing past RDMAMW_TCP_HOST_TIMEOUT",
        RT_WHY_STALLED: "peer read nothing while 64 MiB waited to be sent to it"}

cdef class TcpTransport(Transport):
    """The tcp endpoint; its fields are declared in _transport.pxd."""

    def __cinit__(self):
        self.c = <rt_conn *>calloc(1, sizeof(rt_conn))
        if self.c == NULL:
            raise MemoryError()
        self.c.sock = -1
        self.c.evfd = -1
        self.c.state = RT_CLOSED
        self.close_wakes = True         # close() takes the connection down: evfd fires
        if pthread_mutex_init(&self.c.send_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.xp_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.xw_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.rq_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.bl_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.rd_mu, NULL) != 0 \
                or pthread_mutex_init(&self.c.rf_mu, NULL) != 0 \
                or pthread_cond_init(&self.c.rd_cv, NULL) != 0 \
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
                tuple my_regions, tuple peer_regions, double heartbeat, double peer_timeout,
                double host_timeout=0.0):
        """Adopt a connected non-blocking socket, an eventfd and a block from
        ``alloc_block`` (regions are ((offset, length) x RM_NREGIONS)), then start the
        progress thread. Takes ownership of sock, evfd and the block only on success;
        if it raises, they are still the caller's. ``peer_timeout``: s without a byte
        from the peer process; ``host_timeout``: s without a byte from it nor an
        acknowledgement from its host (0: not checked)."""
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
        self.c.host_ns = <int64_t>(host_timeout * 1e9)
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
        cdef int st = rt_state(self.c), rc, mode, held
        cdef uint64_t posted
        cdef bint deferred = True       # one exposed SIGNALED READ: poll() says when done
        # never wait holding the GIL (the engine posts small batches with it: every
        # thread would stop), nor past the deadline of the thread that set one
        cdef int may_wait = not PyGILState_Check()
        cdef int64_t deadline = self.post_deadline if self.post_owner == pthread_self() else 0
        if st != RT_UP:
            return st
        for i in range(n):
            if wrs[i].flags & RM_WR_REGION:
                return self._post_region(wrs, n)
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
        mode = rt_turn(self.c, deadline, may_wait, &held)     # bl_mu held from here
        if mode < 0:
            return mode
        posted = self.c.rd_posted
        if nreads and posted + nreads - rt_atomic_load64(&self.c.rd_done, __ATOMIC_ACQUIRE) \
                > RT_RD_MAX:
            pthread_mutex_unlock(&self.c.bl_mu)
            if held:
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
                self.c.rd_kind[posted % RT_RD_MAX] = RT_RK_READ
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
        rc = rt_commit(self.c, self.iov, k, mode, held, deadline, may_wait)
        if rc != 0 and rc != RT_LATE:
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
        return rc       # RT_LATE: accepted (queued), but past the deadline

    cdef int _post_region(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        """A chain of region READs/WRITEs/atomics (every WR RM_WR_EXPOSED |
        RM_WR_REGION, imm the region's tag; an atomic's local_addr its 16 bytes of
        operands, the first 8 replaced by the word's old value) as one RCHAIN frame on
        one sendmsg; waits for its RDONE (rm_tcp_region.h) until this thread's post
        deadline. RM_ERR_BOUNDS when the owner refused an operation (region_refusal()
        then says which and why), RM_ERR_LATE when the deadline passed first,
        RM_ERR_UNSUPPORTED for an atomic to a peer that does not serve them, or the
        connection's state."""
        cdef rt_rcell cell
        cdef rt_rdesc *descs
        cdef uint64_t *local
        cdef iovec *iov
        cdef rm_wr *wr
        cdef uint32_t i, why
        cdef uint64_t wbytes = 0
        cdef int rc, done_rc, own
        cdef int64_t deadline = self.post_deadline if self.post_owner == pthread_self() else 0
        memset(&cell, 0, sizeof(cell))
        if n == 0 or n > RT_RCH_MAX or self.peer_rid == 0:
            return RM_ERR_BOUNDS
        for i in range(n):
            wr = &wrs[i]
            if wr.flags & (RM_WR_EXPOSED | RM_WR_REGION | RM_WR_PUBLISH) \
                    != (RM_WR_EXPOSED | RM_WR_REGION) or wr.rkey > 0xFFFF or wr.imm == 0 \
                    or wr.length > RT_PIECE:
                return RM_ERR_BOUNDS
            if wr.opcode == RM_WR_FETCH_ADD or wr.opcode == RM_WR_CMP_SWAP:
                if not self.peer_atomics:
                    return RM_ERR_UNSUPPORTED   # an owner that does not serve them
                if wr.length != 8 or wr.remote_off & 7:
                    return RM_ERR_BOUNDS
            elif wr.opcode != RM_WR_READ and wr.opcode != RM_WR_WRITE:
                return RM_ERR_BOUNDS
        if rt_rscratch_take(self.c, n, &descs, &local, &iov, &own) != 0:
            return RM_ERR_OS
        for i in range(n):
            wr = &wrs[i]
            descs[i].op = (RT_OP_READ if wr.opcode == RM_WR_READ
                           else RT_OP_WRITE if wr.opcode == RM_WR_WRITE
                           else RT_OP_FADD if wr.opcode == RM_WR_FETCH_ADD else RT_OP_CSWAP)
            descs[i].key = <uint16_t>wr.rkey
            descs[i].tag = wr.imm
            descs[i].addr = wr.remote_off
            descs[i].length = wr.length
            descs[i].reserved = 0
            local[i] = wr.local_addr
            wbytes += wr.length if wr.opcode == RM_WR_WRITE else 0
        rc = rt_rchain_send(self.c, descs, local, n, iov, &cell, deadline,
                            not PyGILState_Check())
        rt_rscratch_give(self.c, descs, local, iov, own)    # sent, or copied into the backlog
        if not cell.queued:     # nothing went on the stream
            return rc
        if rc == 0 or rc == RT_LATE:
            self.n_doorbells += 1
            self.n_wrs += n
        # then the progress thread is done with cell and the READ targets (RT_LATE: the
        # deadline passed, the chain is abandoned: a late answer is dropped)
        done_rc = rt_rcell_wait(self.c, &cell, deadline)
        if done_rc != 0 or (rc != 0 and rc != RT_LATE):
            return done_rc if done_rc != 0 else rc
        if cell.why or cell.read_err:
            why = cell.why if cell.why else RM_RWHY_GONE
            i = cell.index if cell.why and cell.index < n else 0
            rt_refusal_set(self.c, why, wrs[i].rkey, wrs[i].imm, wrs[i].opcode != RM_WR_READ,
                           wrs[i].remote_off, wrs[i].length)
            return RM_ERR_BOUNDS
        self.bytes_written += wbytes
        for i in range(n):
            if wrs[i].flags & RM_WR_SIGNALED:
                self.n_signaled += 1
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
        """A rendezvous range (READ or WRITE), or a user region: access bits above
        RM_ACCESS_TAG_SHIFT are its tag (its entry carries it: rm_expose.h)."""
        cdef uint32_t key, acc = 0, tag = access >> RM_ACCESS_TAG_SHIFT
        out.handle = out.lkey = out.rkey = 0
        if access == RM_ACCESS_LOCAL:
            return 0
        if not self.can_expose or rt_state(self.c) != RT_UP or self.inherited():
            return RM_ERR_CLOSED
        if tag:
            if access & RM_ACCESS_REMOTE_READ:
                acc |= RM_XACC_READ
            if access & RM_ACCESS_REMOTE_WRITE:
                acc |= RM_XACC_WRITE
            if access & RM_ACCESS_REMOTE_ATOMIC:
                acc |= RM_XACC_ATOMIC
            if acc == 0 or tag >> (32 - RM_XTAG_SHIFT) or access & 0xFF & ~<uint32_t>(
                    RM_ACCESS_REMOTE_READ | RM_ACCESS_REMOTE_WRITE
                    | RM_ACCESS_REMOTE_ATOMIC):
                return RM_ERR_UNSUPPORTED
            key = rt_expose(self.c, addr, length, acc | (tag << RM_XTAG_SHIFT))
            if key == 0:
                return RM_ERR_AGAIN
            out.handle = out.rkey = key
            return 0
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

    cdef int wake_self(self) noexcept nogil:
        if self.c != NULL:
            rt_signal(self.c)
        return 0

    cdef int wake_peer(self) noexcept nogil:
        self.n_wakeups += 1
        cdef int64_t deadline = self.post_deadline if self.post_owner == pthread_self() else 0
        return rt_send_empty(self.c, RT_WAKE, deadline, not PyGILState_Check())

    cdef int wait(self, int timeout_ms) noexcept nogil:
        return rt_wait(self.c, timeout_ms)

    def _event_fds(self):
        # the progress thread signals it on a wake-up frame, a PUBLISH while a waiter
        # is announced, and the connection going down
        return (self.c.evfd,)

    cdef int arm_fd(self) noexcept nogil:
        return rt_arm(self.c)

    cdef void disarm_fd(self) noexcept nogil:
        rt_disarm(self.c)

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
                pthread_mutex_destroy(&self.c.bl_mu)
                pthread_mutex_destroy(&self.c.rd_mu)
                pthread_mutex_destroy(&self.c.rf_mu)
                pthread_cond_destroy(&self.c.rd_cv)
                pthread_cond_destroy(&self.c.rq_cv)
            rt_rscratch_free(self.c)
            free(self.c.xtab)
            free(self.c.pubbuf)
            free(self.c.bl)
            free(self.c)
            self.c = NULL
        if self.block != NULL:
            munmap(self.block, self.block_size)
        free(self.hdrs)
        free(self.iov)

    def _set_region_ids(self, uint64_t mine, uint64_t peers, bint atomics=False):
        """The identities region references carry: this endpoint's (random, never 0)
        and the peer's from its hello (0: a peer without regions); ``atomics``: the
        peer's hello said it serves region atomics (RT_OP_FADD / RT_OP_CSWAP)."""
        self.rid, self.peer_rid = mine, peers
        self.peer_atomics = atomics and peers != 0

    @property
    def region_atomics(self) -> bool:
        """fetch_add / compare_swap on regions exposed "atomic": this side's progress
        thread serves the peer's (an atomic to a peer whose hello did not say it serves
        them is refused by post(), RM_ERR_UNSUPPORTED)."""
        return self.responder_started

    def region_ids(self):
        """(this endpoint's identity, the peer's): 0 for a peer without regions."""
        return self.rid, self.peer_rid

    def region_refusal(self, uint32_t key, uint32_t tag, uint64_t addr, uint64_t length,
                       bint write) -> int:
        """Why the owner refused this thread's last region chain, for the operation
        [addr, addr+length) under key and tag (RM_RWHY_*: 0 not that one, 1 not exposed
        under that key and tag, 2 outside it, 3 access)."""
        if self.c == NULL:
            return 0
        return rt_refusal_get(self.c, key, tag, write, addr, length)

    @property
    def region_chain_max(self) -> int:
        """Work requests in one region chain at most (RemoteOps posts more as several)."""
        return RT_RCH_MAX

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
    """A zeroed, page-aligned block for an endpoint's regions, committed page by page
    as the peer's frames land (an idle channel's ring costs no resident memory); pass
    it to _attach, which then owns it."""
    cdef void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                        -1, 0)
    if p == MAP_FAILED:
        raise MemoryError()
    return <size_t>p


def free_block(size_t addr, size_t size) -> None:
    """Free a block that was never handed to a transport."""
    munmap(<void *>addr, size)
