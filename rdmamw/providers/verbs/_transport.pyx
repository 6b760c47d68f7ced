# cython: freethreading_compatible = False
"""The ``verbs`` provider's data path: mini-verbs on an RC queue pair (libibverbs,
dlopen()ed by _lib.load() on first use: the extension does not link it).

One post() is one chained ``ibv_send_wr`` list handed to ``ibv_post_send`` (one
doorbell) unless it is longer than the send queue allows, then it goes in parts.
Payloads under the device's inline limit go inline; only the WRs the engine signals
are signaled, plus an internal one now and then so the send queue never fills with
unsignaled WRs. Completions are polled in batches. Wake-ups are zero-byte SENDs, or
(event mode, asked for by the receiver) the arrival/reclaim word WRITEs themselves
carry an immediate, so a sleeping peer gets a receive completion on its completion
channel. The TCP side channel of the handshake stays open to see the peer die (EOF).

The block the peer may write (CTRL/ARRIVAL/RECLAIM/RING) is registered with remote
write only; buffers of register_local() are local-only. Every WR is bounds-checked
against the peer's regions before any of a chain is posted.

Its set-up (the QP to RTS, the block, the teardown) is its base's, _qp.VerbsQP; the
device, PD, completion channel and CQs it uses are a VerbsDevice's (_device.pyx), the
MRs it registers (local, cached, exposed) a VerbsMemory's (_memory.pyx)."""

import cython

from rdmamw.errors import ChannelClosed

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memset

from rdmamw.transport._base cimport (
    RM_ALL_SLOTS,
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_LATE,
    RM_ERR_OS,
    RM_ERR_PEER_LOST,
    RM_NREGIONS,
    RM_REGION_ARRIVAL,
    RM_REGION_CTRL,
    RM_REGION_RECLAIM,
    RM_REGION_RING,
    RM_WR_EXPOSED,
    RM_WR_PUBLISH,
    RM_WR_READ,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    RM_WR_WRITE_IMM,
    now_ns,
    pthread_self,
    rm_wc,
    rm_wr,
)
from rdmamw.transport.atomics cimport rm_cpu_relax, rm_spin_lock, rm_spin_trylock, rm_spin_unlock
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._lib cimport also_load
from rdmamw.providers.verbs._device cimport WC_BATCH, rmv_load32, rmv_load64, rmv_route
from rdmamw.providers.verbs._block cimport GRANT_OFF
from rdmamw.providers.verbs._sendq cimport _drain_sq, _flush, _post_all, _wake
from rdmamw.providers.verbs._qp cimport (
    FAIL_POLL,
    FAIL_POST,
    FAIL_RECV_WC,
    FAIL_SEND_WC,
    FAIL_SOCKET,
    FAIL_STUCK,
    INTERNAL,
    QP_CONNECTED,
    STUCK_NS,
    VerbsQP,
    bind_wr,
)

cdef extern from *:
    """
    #include <arpa/inet.h>
    #include <netinet/in.h>
    #include <netinet/tcp.h>
    #include <poll.h>
    #include <sys/socket.h>
    #include <time.h>
    #include <unistd.h>
    static inline int rmv_trylock(volatile int *l) {
        return __atomic_exchange_n((int *)l, 1, __ATOMIC_ACQUIRE) == 0;
    }
    /* Did the other end close (FIN or RST)? From the TCP state, which our own
     * shutdown does not hide: TIME_WAIT, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING. */
    static inline int rmv_peer_closed(int fd) {
        struct tcp_info ti;
        socklen_t n = sizeof ti;
        if (fd < 0 || getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &n) != 0) return 1;
        return ti.tcpi_state == TCP_TIME_WAIT || ti.tcpi_state == TCP_CLOSE
            || ti.tcpi_state == TCP_CLOSE_WAIT || ti.tcpi_state == TCP_LAST_ACK
            || ti.tcpi_state == TCP_CLOSING;
    }
    """
    int rmv_trylock(int *l) nogil
    int rmv_peer_closed(int fd) nogil
    uint32_t htonl(uint32_t v) nogil
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout) nogil
    short POLLIN, POLLERR, POLLNVAL
    ssize_t recv(int fd, void *buf, size_t n, int flags) nogil
    int shutdown(int fd, int how) nogil
    int MSG_DONTWAIT, SHUT_RDWR
    ssize_t read(int fd, void *buf, size_t n) nogil
    ssize_t write(int fd, const void *buf, size_t n) nogil


cdef int64_t SOCK_CHECK_NS = 1000000


cdef int _fill_table(const char *lib, char *err, size_t errlen) noexcept:
    return rm_ibv_load(lib, err, errlen)      # 0 at once when loaded


also_load(_fill_table)


@cython.no_gc_clear     # __dealloc__ needs dev and mem: the QP goes before their CQs and PD
cdef class VerbsTransport(VerbsQP):
    """The data path of an RC QP to one peer (its set-up: VerbsQP)."""

    def close(self):
        """Let posted WRs finish (bounded), then hang up: the peer sees EOF and a
        thread of ours blocked in wait() wakes. The verbs objects are destroyed only
        when the transport dies, so no other thread can be inside them; the block
        stays allocated while Messages may point into it."""
        if self.inherited():
            self.state = RM_ERR_CLOSED  # a fork child: nothing here is ours to drain
            return
        if self.state == QP_CONNECTED:
            with nogil:
                _drain_sq(self, 1000000000)
            self.state = RM_ERR_CLOSED
        if self.sock >= 0:
            shutdown(self.sock, SHUT_RDWR)


    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        cdef uint32_t i
        cdef int rc
        if self.state != QP_CONNECTED:
            return self._dead()
        for i in range(n):      # validate the whole chain first: all or nothing
            if not _wr_in_bounds(self, &wrs[i]):
                return RM_ERR_BOUNDS
        rm_spin_lock(&self.lock)
        # a poster with a deadline (deadline_posts) waits for the send queue until then
        self.room_deadline = self.post_deadline if self.post_owner == pthread_self() else 0
        rc = _post_all(self, wrs, n)
        self.room_deadline = 0
        rm_spin_unlock(&self.lock)
        self._drain_recv()
        return rc

    cdef void _fill(self, uint32_t j, rm_wr *wr) noexcept nogil:
        cdef ibv_send_wr *w = &self.swr[j]
        cdef ibv_sge *s = &self.sge[j]
        s.addr, s.length, s.lkey = wr.local_addr, wr.length, wr.lkey
        w.wr_id = wr.wr_id
        w.next = &self.swr[j + 1]
        w.sg_list = s
        w.num_sge = 1 if wr.length else 0
        w.opcode = IBV_WR_RDMA_WRITE
        w.imm_data = 0
        if wr.opcode == RM_WR_WRITE_IMM:
            w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM
            w.imm_data = htonl(wr.imm)
        elif self.peer_imm and wr.flags & RM_WR_PUBLISH and (
                wr.rkey == RM_REGION_ARRIVAL or wr.rkey == RM_REGION_RECLAIM):
            w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM    # event mode: the word write wakes
            w.imm_data = htonl(wr.rkey)
        w.send_flags = IBV_SEND_SIGNALED if wr.flags & RM_WR_SIGNALED else 0
        if wr.flags & RM_WR_EXPOSED:        # rendezvous: the peer's MR and address
            w.wr.rdma.remote_addr = wr.remote_off
            w.wr.rdma.rkey = wr.rkey
            if wr.opcode == RM_WR_READ:
                w.opcode = IBV_WR_RDMA_READ
                return
            self.bytes_written += wr.length
            return
        if 0 < wr.length <= self.max_inline:
            w.send_flags |= IBV_SEND_INLINE
        w.wr.rdma.remote_addr = self.peer_addr[wr.rkey] + wr.remote_off
        w.wr.rdma.rkey = self.peer_rkey
        if wr.rkey == RM_REGION_RING:
            w.wr.rdma.rkey = self.block.rkey_of(wr.remote_off)
        self.bytes_written += wr.length

    cdef int _post_chain(self, uint32_t count, bint final) noexcept nogil:
        """Post swr[0..count) with one ibv_post_send (caller holds lock)."""
        cdef ibv_send_wr *bad = NULL
        cdef ibv_send_wr *last = &self.swr[count - 1]
        cdef uint32_t j, u = self.unsig
        cdef int rc
        last.next = NULL
        for j in range(count):
            u = 0 if self.swr[j].send_flags & IBV_SEND_SIGNALED else u + 1
        # a non-final part, or too many unsignaled WRs in a row: signal internally so
        # the send queue's slots can be accounted for and reused
        if u and (not final or u > self.sig_bound):
            last.send_flags |= IBV_SEND_SIGNALED
            last.wr_id |= INTERNAL
        rc = self._room(count)
        if rc != 0:
            return rc
        for j in range(count):
            if self.swr[j].send_flags & IBV_SEND_SIGNALED:
                self.sig_pos[self.sig_tail % self.sq_depth] = self.sq_posted + j + 1
                self.sig_tail += 1
                self.n_signaled += 1
                self.unsig = 0
            else:
                self.unsig += 1
        self.last_imm = last.opcode == IBV_WR_RDMA_WRITE_WITH_IMM
        rc = ibv_post_send(self.qp, self.swr, &bad)
        self.n_doorbells += 1
        if rc != 0:
            self._fail(RM_ERR_PEER_LOST, FAIL_POST, rc)     # rc is an errno value
            return RM_ERR_OS
        self.sq_posted += count
        self.n_wrs += count
        return 0

    cdef int _room(self, uint32_t count) noexcept nogil:
        """Poll until the send queue has room for count WRs (caller holds lock), by
        room_deadline (then RM_ERR_LATE); a queue that completes nothing for STUCK_NS
        is a lost peer."""
        cdef int64_t t, start = 0, next_sock = 0
        while self.sq_depth - (self.sq_posted - self.sq_done) < count:
            if self._poll_send_locked() > 0:
                start = 0       # progress: "stuck" counts from the last completion
            else:
                # our receive WRs are reposted as they are polled: a peer as blocked
                # as we are still gets its wake-up SENDs received (no RNR standstill)
                self._drain_recv()
                t = now_ns()
                if self.room_deadline and t >= self.room_deadline:
                    return RM_ERR_LATE
                if start == 0:
                    start = t
                    next_sock = t + SOCK_CHECK_NS
                elif t >= next_sock:
                    if _sock_dead(self.sock):
                        self._fail(RM_ERR_PEER_LOST, FAIL_SOCKET)
                    elif t - start > STUCK_NS:
                        self._fail(RM_ERR_PEER_LOST, FAIL_STUCK)
                    next_sock = t + SOCK_CHECK_NS
                rm_cpu_relax()
            if self.state != QP_CONNECTED:
                return self._dead()
        return 0

    cdef int _poll_send_locked(self) noexcept nogil:
        """Route the shared send CQ's completions (another thread polling it does it
        for us), then take a batch of ours from the route's inbox."""
        cdef int k = 0, i
        cdef ibv_wc *wc
        cdef rmv_route *r = self.route
        if not self.joined:
            return 0
        self.dev.poll_send(r.scq, False)
        rm_spin_lock(&r.ilock)
        while k < WC_BATCH and r.inbox_len:
            self.wcb[k] = r.inbox[r.inbox_head]
            r.inbox_head = (r.inbox_head + 1) % r.inbox_cap
            r.inbox_len -= 1
            k += 1
        rm_spin_unlock(&r.ilock)
        if r.overflow and self.state == QP_CONNECTED:   # a completion was lost: accounting off
            self._fail(RM_ERR_PEER_LOST, FAIL_POLL, 0)
        self.n_completions += k
        for i in range(k):
            wc = &self.wcb[i]
            if wc.status != IBV_WC_SUCCESS:
                self._wc_error(wc, FAIL_SEND_WC)
                if not self.error_reported:     # (a rendezvous READ's id: its error)
                    self.error_reported = True
                    self._stash(0 if wc.wr_id & INTERNAL else wc.wr_id, wc.status, wc.opcode)
                continue
            if self.sig_head < self.sig_tail:
                self.sq_done = self.sig_pos[self.sig_head % self.sq_depth]
                self.sig_head += 1
            if not (wc.wr_id & INTERNAL):
                self._stash(wc.wr_id, 0, wc.opcode)
        return k

    cdef inline void _stash(self, uint64_t wr_id, int status, int opcode) noexcept nogil:
        cdef uint32_t s
        if self.stash_len == self.stash_cap:    # keep the newest (batch ids are monotonic)
            self.stash_head = (self.stash_head + 1) % self.stash_cap
            self.stash_len -= 1
        s = (self.stash_head + self.stash_len) % self.stash_cap
        self.stash[s].wr_id = wr_id
        self.stash[s].status = status
        self.stash[s].opcode = opcode
        self.stash_len += 1

    cdef int poll(self, rm_wc *wcs, uint32_t maxn) noexcept nogil:
        cdef uint32_t k = 0
        if self.stash == NULL:
            return 0
        rm_spin_lock(&self.lock)
        if self.stash_len < maxn:
            self._poll_send_locked()
            if self.bl.len:
                _flush(self)
        while k < maxn and self.stash_len:
            wcs[k] = self.stash[self.stash_head]
            self.stash_head = (self.stash_head + 1) % self.stash_cap
            self.stash_len -= 1
            k += 1
        rm_spin_unlock(&self.lock)
        return k

    cdef int _drain_recv(self) noexcept nogil:
        """Route the shared receive CQ's completions (wake-ups, immediates: their WRs
        are reposted by whoever polls them), then take the count of ours. How many."""
        cdef rmv_route *r = self.route
        cdef uint64_t got
        cdef int n
        if not self.joined or not rmv_trylock(&self.rlock):
            return 0
        self.dev.poll_recv(r.rcq, False)
        got = rmv_load64(&r.recv_ok)
        n = <int>(got - self.recv_seen)
        self.recv_seen = got
        self.n_recv_completions += n
        if rmv_load32(&r.recv_failed):
            self._wc_error(&r.recv_err, FAIL_RECV_WC)
        elif r.post_errno and self.state == QP_CONNECTED:
            self._fail(RM_ERR_PEER_LOST, FAIL_POST, r.post_errno)
        rm_spin_unlock(&self.rlock)
        return n

    cdef bint _woken(self) noexcept nogil:
        """A receive completion of ours was routed since wait() last returned (not since
        the last drain: one between the caller's last look and its wait, peer_state()'s
        or a post's, takes the immediate whose bytes that look missed)."""
        return rmv_load64(&self.route.recv_ok) != self.wake_seen

    cdef int _looked(self, int r) noexcept nogil:
        """wait()'s return: what was routed up to now, the caller's next look sees."""
        self.wake_seen = rmv_load64(&self.route.recv_ok)
        return r

    cdef int _settle(self) noexcept nogil:
        """After arming: route what reached the receive CQ before the request (it
        raises no event), waiting for a thread polling it already; how many of ours
        were taken (a wake-up that came before we slept: another thread may have routed
        it between the caller's drain and the sleep flag, without writing our eventfd)."""
        while self.dev.poll_recv(self.route.rcq, True) == WC_BATCH:
            pass
        return self._drain_recv()

    # ---- a ring that grows (docs/protocol.md "Rings that grow") ----------------------

    cdef int set_rings(self, uint32_t nslots, uint64_t stride, uint32_t peer_nslots,
                       uint64_t peer_stride) except -1:
        if self.block.on and nslots != self.block.slots or \
                self.block.peer_granted and peer_nslots != self.block.peer_slots:
            raise ValueError("the engine's rings differ from the ones registered")
        self.ring_slots, self.peer_slots = nslots, peer_nslots
        return 0

    cdef bint take_grant(self) noexcept nogil:
        if self.state != QP_CONNECTED or not self.block.take(self.local[RM_REGION_CTRL].addr):
            return False
        self.peer_granted = self.block.peer_granted or RM_ALL_SLOTS
        return True

    cdef int wake_self(self) noexcept nogil:
        cdef uint64_t one = 1
        if self.route != NULL and self.route.evfd >= 0:
            write(self.route.evfd, &one, 8)
        return 0

    cdef int wake_peer(self) noexcept nogil:
        cdef int rc = 0
        if self.state != QP_CONNECTED:
            return self._dead()
        rm_spin_lock(&self.lock)
        if self.peer_imm and self.last_imm:
            pass            # the WRITE_WITH_IMM just posted wakes the peer
        elif self.bl.len and (_flush(self) != 0 or self.bl.len):
            self.bl.wake = True     # after what is queued (_flush)
        elif self.sq_depth - (self.sq_posted - self.sq_done) > self.max_chain or (
                self._poll_send_locked() >= 0 and
                self.sq_depth - (self.sq_posted - self.sq_done) > self.max_chain):
            rc = _wake(self)
        else:
            # more than half the send queue is not taken: the peer is stopped (each
            # wake-up SEND takes one of its receive WRs; with none left the QP waits
            # for it, RNR) or the NIC is behind. What is queued reaches it first and
            # wakes it; more would fill the queue (a sender short of granted slots
            # asks every 20 ms), and a full queue holds every post up
            self.n_wakeups_held += 1
        rm_spin_unlock(&self.lock)
        return rc

    cdef int put_wake(self, rm_wr *wr) noexcept nogil:
        """A control word's WRITE, then the wake-up SEND, as one chain (one doorbell)
        where nothing is queued and the send queue has room; else as post() and
        wake_peer() make them."""
        cdef int rc
        if self.state != QP_CONNECTED:
            return self._dead()
        if not _wr_in_bounds(self, wr):
            return RM_ERR_BOUNDS
        rm_spin_lock(&self.lock)
        if self.bl.len == 0 and self.sq_depth - (self.sq_posted - self.sq_done) > self.max_chain:
            self._fill(0, wr)
            memset(&self.swr[1], 0, sizeof(ibv_send_wr))
            self.swr[1].wr_id = INTERNAL
            self.swr[1].opcode = IBV_WR_SEND        # as _wake(): solicited, zero bytes
            self.swr[1].send_flags = IBV_SEND_SOLICITED
            rc = self._post_chain(2, True)
            if rc == 0:
                self.n_wakeups += 1
                self.n_wakeups_chained += 1
            rm_spin_unlock(&self.lock)
            self._drain_recv()
            return rc
        rm_spin_unlock(&self.lock)
        rc = self.post(wr, 1)
        self.wake_peer()
        return rc

    cdef int wait(self, int timeout_ms) noexcept nogil:
        cdef pollfd fds[2]
        cdef uint64_t one
        cdef int r
        if self.state != QP_CONNECTED:
            return self._dead()
        self._drain_recv()
        if self._woken():       # since the last return: the caller may not have seen it
            return self._looked(1)
        self.dev.sleep(self.route, True)    # routed completions now write our eventfd
        self.dev.arm(self.route.rcq)
        self._settle()
        if self._woken():       # arrived before we slept
            self.dev.sleep(self.route, False)
            return self._looked(1)
        if not self.event_mode and timeout_ms > self.poll_ms:
            timeout_ms = self.poll_ms    # a plain WRITE gives no event: look again soon
        fds[0].fd, fds[0].events, fds[0].revents = self.route.evfd, POLLIN, 0
        fds[1].fd, fds[1].events, fds[1].revents = self.sock, POLLIN, 0
        r = poll(fds, 2, timeout_ms)
        self.dev.sleep(self.route, False)
        if r < 0:
            return self._looked(0 if errno == EINTR else RM_ERR_OS)
        if fds[0].revents & POLLIN:
            read(self.route.evfd, &one, 8)
            self._drain_recv()
        return self._looked(1 if fds[0].revents & POLLIN else
                            self.peer_state() if fds[1].revents else 0)

    def poll_interval(self) -> float:
        # a plain WRITE of arrival words raises no event, and the peer's wake-up SEND on
        # seeing our sleep flag can race with the flag's WRITE (wait() looks again too)
        return 0.0 if self.event_mode else self.poll_ms / 1000.0

    def _event_fds(self):
        # the endpoint's eventfd (written when a wake-up SEND or a WRITE_WITH_IMM of
        # the peer is routed to it, once arm_fd marked it sleeping) and the side
        # channel (its death)
        if not self.joined or self.sock < 0:
            raise ChannelClosed("the verbs connection is closed")
        return (self.route.evfd, self.sock)

    cdef void reap_wakeups(self) noexcept nogil:
        if self.state == QP_CONNECTED:
            self._drain_recv()

    cdef int arm_fd(self) noexcept nogil:
        cdef uint64_t one
        if self.state != QP_CONNECTED:
            return self._dead()
        read(self.route.evfd, &one, 8)      # non-blocking: what woke the loop is taken
        self.dev.sleep(self.route, True)
        self.dev.arm(self.route.rcq)
        self._settle()              # what arrived between the drain and the request
        return 0

    cdef void disarm_fd(self) noexcept nogil:
        if self.joined:
            self.dev.sleep(self.route, False)

    cdef bint peer_exited(self) noexcept nogil:
        # the QP's state says nothing of the process, and our own shutdown (on a failed
        # completion) makes our socket read EOF: ask TCP whether the peer closed
        return rmv_peer_closed(self.sock)

    cdef int peer_state(self) noexcept nogil:
        if self.state != QP_CONNECTED:
            return self.state
        if rmv_trylock(&self.lock):       # error completions of unsignaled writes too
            self._poll_send_locked()
            if self.bl.len:                 # (a waiter's turn sends what is queued)
                _flush(self)
            rm_spin_unlock(&self.lock)
        self._drain_recv()
        if self.state == QP_CONNECTED and _sock_dead(self.sock):
            self._fail(RM_ERR_PEER_LOST, FAIL_SOCKET)
        return self.state

    cdef void _offer(self) noexcept nogil:
        """The hook of an endpoint whose ring grows (_qp._offer_hook calls it). The
        peer waits for credit: grant it what its credit flag asks for, else the next
        part of my ring (VerbsBlock registers it)
        by writing the part's grant word into its control page, then wake it. Runs on the
        thread that routed the peer's wake-up (the device thread while the application is
        away) under the receive CQ's lock, so it only tries the other locks: a peer still
        short asks again (engine/_waits.pyx)."""
        cdef bint posted = False
        cdef int k
        if self.state != QP_CONNECTED:
            return
        # the peer's credit flag: 1, or the slots it needs (read once: only here)
        k = self.block.offer(rmv_load64(<uint64_t *>self.local[RM_REGION_CTRL].addr))
        if k < 0:
            return
        cdef ibv_mw *mw = self.block.mws[k]
        cdef ibv_mr *mr = self.block.mrs[k]
        cdef uint32_t n = 3 if mw != NULL else 2
        if rm_spin_trylock(&self.lock):
            if self.sq_depth - (self.sq_posted - self.sq_done) < n:
                self._poll_send_locked()
            if self.state == QP_CONNECTED and self.sq_depth - (self.sq_posted - self.sq_done) >= n:
                if mw != NULL:      # the part's window, bound before the word names it
                    bind_wr(&self.swr[0], mw, mr, <uint64_t>mr.addr, mr.length,
                             IBV_ACCESS_REMOTE_WRITE, <uint32_t>self.block.words[k])
                    self.swr[0].send_flags = 0
                    self.swr[0].next = &self.swr[1]
                    self.n_binds += 1
                _grant_wrs(&self.swr[n - 2], self.sge, &self.block.words[k],
                           self.block.words_mr.lkey,
                           self.peer_addr[RM_REGION_CTRL] + GRANT_OFF + 8 * k, self.peer_rkey,
                           self.max_inline >= 8)
                posted = self._post_chain(n, True) == 0
                if posted:
                    self.n_wakeups += 1
            rm_spin_unlock(&self.lock)
        self.block.done(posted)
        if posted:
            self.local_granted = self.block.granted


cdef bint _wr_in_bounds(VerbsTransport tp, rm_wr *wr) noexcept nogil:
    """Whether a WR the engine posts stays inside what the peer registered for us."""
    cdef uint64_t lim
    if wr.flags & RM_WR_EXPOSED:    # the NIC checks it against the peer's MR
        return not wr.flags & RM_WR_PUBLISH and (wr.opcode == RM_WR_READ
                                                 or wr.opcode == RM_WR_WRITE)
    if wr.rkey >= RM_NREGIONS:
        return False
    # of the peer's ring, only the slots it granted
    lim = tp.block.limit if wr.rkey == RM_REGION_RING else tp.peer[wr.rkey].length
    if wr.remote_off > lim or wr.length > lim - wr.remote_off:
        return False
    # READ needs a remotely readable source: the block grants remote write only
    if wr.opcode != RM_WR_WRITE and wr.opcode != RM_WR_WRITE_IMM:
        return False
    return not (wr.flags & RM_WR_PUBLISH and ((wr.remote_off | wr.length) & 7))


cdef void _grant_wrs(ibv_send_wr *w, ibv_sge *sge, uint64_t *word, uint32_t lkey,
                     uint64_t remote_addr, uint32_t rkey, bint inline) noexcept nogil:
    """w[0..2): the WRITE of one grant word to ``remote_addr``, then the wake-up SEND
    (solicited: the peer's device thread sees it even where nobody sleeps)."""
    memset(w, 0, 2 * sizeof(ibv_send_wr))
    sge.addr, sge.length, sge.lkey = <uint64_t>word, 8, lkey
    w.wr_id, w.opcode, w.sg_list, w.num_sge = INTERNAL, IBV_WR_RDMA_WRITE, sge, 1
    w.send_flags = IBV_SEND_INLINE if inline else 0
    w.wr.rdma.remote_addr, w.wr.rdma.rkey = remote_addr, rkey
    w.next = &w[1]
    w[1].wr_id, w[1].opcode, w[1].send_flags = INTERNAL, IBV_WR_SEND, IBV_SEND_SOLICITED

cdef bint _sock_dead(int sock) noexcept nogil:
    """Has the side channel ``sock`` seen the peer's EOF or an error? Nothing is sent
    on it after the handshake: bytes a peer sends anyway are read and dropped, so they
    cannot keep it readable (every later wait would return at once and spin)."""
    cdef pollfd fd
    cdef char junk[256]
    cdef ssize_t r
    if sock < 0:
        return True
    fd.fd, fd.events, fd.revents = sock, POLLIN, 0
    if poll(&fd, 1, 0) <= 0:
        return False
    if fd.revents & (POLLERR | POLLNVAL):
        return True
    r = recv(sock, junk, sizeof(junk), MSG_DONTWAIT)
    return r == 0 or (r < 0 and errno != EAGAIN and errno != EINTR)

