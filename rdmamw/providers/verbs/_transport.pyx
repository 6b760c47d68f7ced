# cython: freethreading_compatible = False
"""The ``verbs`` provider's data path: mini-verbs on an RC queue pair (libibverbs,
dlopen()ed by load() on first use: the extension does not link it).

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

The transport owns its queue pair, the block, the send and receive queues' accounting
and the side channel; the device, PD, completion channel and CQs it uses are a
VerbsDevice's and the MRs it registers (local, cached, exposed) a VerbsMemory's
(_verbs_dev.pyx); the first cause of its failure is a VerbsFailure's (below)."""

import logging
import os

import cython

from rdmamw import config
from rdmamw.errors import ChannelClosed

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memcpy, memset, strerror

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
    RM_REGION_RING,
    RM_ALL_SLOTS,
    RM_ERR_UNSUPPORTED,
    RM_WR_EXPOSED,
    RM_WR_PUBLISH,
    RM_WR_READ,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    RM_WR_WRITE_IMM,
    Transport,
    now_ns,
    rm_wc,
    rm_mem,
    rm_wr,
)
from rdmamw.transport.atomics cimport (
    rm_cpu_relax,
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_trylock,
    rm_spin_unlock,
)
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._device cimport (
    VerbsBlock,
    VerbsDevice,
    VerbsMemory,
    XMR_N,
    load_table,
    rmv_load32,
    rmv_load64,
    pin_charge,
    pin_refund,
    rmv_route,
    route_fill,
    route_free,
    route_new,
)
from rdmamw.providers.verbs._device import budget_error, device

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
    short POLLIN, POLLHUP, POLLERR, POLLNVAL
    ssize_t recv(int fd, void *buf, size_t n, int flags) nogil
    int shutdown(int fd, int how) nogil
    int close(int fd) nogil
    int MSG_PEEK, MSG_DONTWAIT, SHUT_RDWR
    int posix_memalign(void **memptr, size_t alignment, size_t size) nogil
    ssize_t read(int fd, void *buf, size_t n) nogil

cdef uint64_t INTERNAL = (<uint64_t>1) << 63     # wr_id of WRs the engine never sees
cdef int64_t STUCK_NS = 10000000000               # no completion at all for this long: peer gone
cdef int64_t SOCK_CHECK_NS = 1000000
# soft-RoCE (6.1) sends a READ's whole response in one burst; past ~1,000 packets the
# receiving CPU's backlog drops some, and its READ retry can then stall the QP for good
# (docs/design.md "Long READs on soft-RoCE"): at most this much per READ work request
cdef uint32_t READ_CHUNK_SOFT_ROCE = 512 * 1024
# ... and every this many pieces one is signaled (internally), so a READ longer than
# the send queue holds frees its slots as it goes, not only at the end of each part
cdef uint32_t PIECES_PER_SIGNAL = 16


_WC_OPCODES = {0: "RDMA_WRITE", 1: "RDMA_WRITE", 2: "RDMA_READ", 3: "RDMA_READ",
               128: "RECV", 129: "RECV_RDMA_WITH_IMM"}


@cython.final
cdef class VerbsFailure:
    """The first cause of a connection's failure: a work completion's status, or the
    call that failed. Recorded without the GIL on the data path, told in words by
    detail()."""

    cdef void call(self, int kind, int err) noexcept nogil:
        """A call failed (``err``: an errno, or 0), or FAIL_STUCK / FAIL_SOCKET."""
        if self.kind == 0:
            self.kind = kind
            self.err_errno = err

    cdef void completion(self, ibv_wc *wc, int kind, bint live) noexcept nogil:
        """A work completion failed (FAIL_SEND_WC / FAIL_RECV_WC). A flushed WR only
        says the QP is in error already; the completion that put it there may sit in
        the other CQ, polled later: it replaces the flush."""
        if (self.kind == 0 and live) or (
                (self.kind == FAIL_SEND_WC or self.kind == FAIL_RECV_WC)
                and self.status == IBV_WC_WR_FLUSH_ERR
                and wc.status != IBV_WC_WR_FLUSH_ERR):
            self.kind = kind
            self.status, self.opcode = wc.status, wc.opcode
            self.vendor, self.wr_id = wc.vendor_err, wc.wr_id

    def detail(self):
        """In words; None while nothing failed."""
        k = self.kind
        if k == 0:
            return None
        if k == FAIL_SEND_WC or k == FAIL_RECV_WC:
            op = (_WC_OPCODES.get(self.opcode, f"opcode {self.opcode}")
                  if k == FAIL_SEND_WC else "RECV")
            wid = self.wr_id & ~INTERNAL
            return (f"{'send' if k == FAIL_SEND_WC else 'receive'} completion "
                    f"{ibv_wc_status_str(self.status).decode()} "
                    f"(status {self.status}, vendor_err {self.vendor:#x}) on {op}, "
                    f"wr_id {wid:#x}{' (internal)' if self.wr_id & INTERNAL else ''}")
        if k == FAIL_POST or k == FAIL_POLL:
            call = "ibv_post_send/recv" if k == FAIL_POST else "ibv_poll_cq"
            return f"{call} failed: {strerror(self.err_errno).decode()} (errno {self.err_errno})"
        if k == FAIL_STUCK:
            return f"no send completion for {STUCK_NS // 1000000000} s with the queue full"
        if k == FAIL_SOCKET:
            return "the side channel closed (the peer process is gone or closed)"
        return "failed"


@cython.no_gc_clear     # __dealloc__ needs dev and mem: the QP goes before their CQs and PD
cdef class VerbsTransport(Transport):
    """An RC QP to one peer plus the registered block of this endpoint; its fields are
    declared in _verbs.pxd."""

    def __cinit__(self):
        self.failure = VerbsFailure()
        self.sock = -1
        self.state = RM_ERR_CLOSED
        self.direct_source = False      # the engine copies payloads into registered staging
        self.close_wakes = True         # close() shuts the side socket wait() polls
        self.synchronous = False        # the HCA reads sources after post() returns

    # ---- set-up (Python, once per connection) ----------------------------------

    def _open(self, str dev_name, int port, int gid_index, size_t block_len, tuple regions,
              uint32_t sq_depth, uint32_t rq_depth, uint32_t max_inline, bint event_mode,
              int poll_ms, int timeout_exp, uint64_t stride=0, uint32_t granted=0,
              bint windows=True, int64_t read_chunk=-1):
        """Take the process's device (context, channel, shared CQs: a VerbsDevice),
        make this endpoint's PD, its room on the CQs and its QP (INIT), register the
        block: its header and the first ``granted`` slots (of ``stride`` bytes) of the
        ring, or all of it (0); return the local half of the endpoint descriptor. With
        ``windows`` (where the device has them) every key the peer gets is a memory
        window's, bound to this QP. ``read_chunk``: the longest RDMA READ one work
        request asks for (0: no limit; -1: READ_CHUNK_SOFT_ROCE on soft-RoCE, else no
        limit)."""
        cdef int i
        cdef VerbsDevice dev
        cdef rmv_route *r
        if len(regions) != RM_NREGIONS:
            raise ValueError("need one (offset, length) per region")
        if self.dev is not None:
            raise ValueError("transport is open already")
        _require()
        fork_safety()
        dev = device(dev_name)
        self.gid, self.lid, self.mtu = dev.port_info(port, gid_index)
        self.port, self.gid_index = port, gid_index
        self.dev, self.mem = dev, dev.memory(windows and dev.has_windows)
        # the registration caches' MRs: the process's (one per buffer for all peers)
        # on the shared PD, else this endpoint's
        self.cache_mem = dev.shared_memory if self.mem.windows else self.mem
        ring_off, ring_len = regions[RM_REGION_RING]
        self.block = VerbsBlock(self.mem, block_len, ring_off, ring_len, stride, granted)
        if self.block.on:
            self.local_granted = self.block.granted
        self.timeout_exp = timeout_exp
        if read_chunk < 0:
            read_chunk = READ_CHUNK_SOFT_ROCE if dev.soft_roce else 0
        self.read_chunk = <uint32_t>min(read_chunk, 1 << 31)
        self.sq_depth = max(8, min(sq_depth, <uint32_t>dev.max_qp_wr))
        self.rq_depth = max(8, min(rq_depth, <uint32_t>dev.max_qp_wr))
        r = self.route = route_new(2 * self.sq_depth + 16)
        dev.join(r, self.sq_depth + 16, self.rq_depth + 16)
        self.joined = True
        self.max_chain = self.sq_depth // 2
        self.sig_bound = self.sq_depth // 4
        self.event_mode, self.poll_ms = event_mode, poll_ms
        _open_qp(self, dev, r, max_inline, port)
        for i in range(RM_NREGIONS):
            off, length = regions[i]
            if off < 0 or length <= 0 or off + length > block_len:
                raise ValueError(f"region ({off}, {length}) outside a block of {block_len}")
            self.local[i].addr = self.block.base + <size_t>off
            self.local[i].length = length
        return {"qpn": self.qpn, "gid": self.gid, "lid": self.lid,
                "mtu": self.mtu, "addr": <uint64_t>self.block.base,
                "rkey": self.block.head_rkey, "len": block_len, "inline": self.max_inline,
                "granted": self.block.granted if self.block.on else 0}

    def _connect(self, uint32_t my_psn, uint32_t qpn, uint32_t psn, bytes gid, int lid, int mtu,
                 uint64_t addr, uint32_t rkey, tuple regions, bint peer_imm,
                 uint64_t peer_stride=0, uint32_t peer_granted=0):
        """Point the QP at the peer (RTR, RTS) and take its regions for bounds checks:
        of its ring, only the first ``peer_granted`` slots (of ``peer_stride`` bytes)
        until it grants more (0: all). The caller has validated the descriptor against
        the layout it computed."""
        cdef int i
        cdef rmv_route *r = self.route
        if self.qp == NULL or len(gid) != 16 or len(regions) != RM_NREGIONS:
            raise ValueError("transport not opened or bad descriptor")
        for i in range(RM_NREGIONS):
            off, length = regions[i]
            self.peer_addr[i] = addr + <uint64_t>off
            self.peer[i].addr = NULL      # never dereferenced: remote memory
            self.peer[i].length = length
        self.peer_rkey, self.peer_imm = rkey, peer_imm
        self.block.peer(self.peer[RM_REGION_RING].length, peer_stride, peer_granted, rkey)
        if self.block.peer_granted:
            self.peer_granted = self.block.peer_granted
        if self.block.on:      # the peer's wake-ups ask for grants (_offer_hook)
            r.hook_owner = <void *>self
            r.hook_want = <uint64_t *>self.local[RM_REGION_CTRL].addr    # CTRL_CREDIT_WAIT
            r.hook = <void (*)(void *) noexcept nogil>_offer_hook     # (below)
        _qp_to_rts(self.qp, <ibv_mtu>min(self.mtu, mtu), my_psn, qpn, psn, gid, lid,
                   self.port, self.gid_index, self.timeout_exp)
        if self.block.head_mw != NULL:
            _bind_head(self)

    def _attach_socket(self, int fd):
        """Take the handshake socket (EOF = peer gone); the transport is live now."""
        self.sock = fd
        self.state = 1
        self.can_expose = True      # rendezvous: exposed READ/WRITE on registered MRs
        self.registers_memory = True    # mr_register / mr_deregister

    def register_local(self, size_t addr, size_t length):
        """Register [addr, addr+length) for local access only (WR sources, READ
        targets); the MR lives as long as the transport. Its lkey."""
        if self.mem is None:
            raise ValueError("transport is not open")
        return self.mem.register_local(addr, length)

    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil:
        """Register the range (one MR per exposure: VerbsMemory's table); with windows,
        bind the exposure's window to the QP, ahead of the descriptor that names it."""
        cdef int rc
        if self.state != 1 or self.inherited():
            out.handle = out.lkey = out.rkey = 0
            return RM_ERR_CLOSED
        rc = self.mem.expose(addr, length, access, out)
        if rc == 0 and access != RM_ACCESS_LOCAL and self.mem.windows:
            rc = _bind_exposed(self, out, addr, length, access)
        return rc

    cdef int expose_cached(self, uint64_t addr, uint64_t length, uint32_t access,
                           uint32_t lkey, uint32_t rkey, rm_mem *out) noexcept nogil:
        """A range inside a registration cache's MR: its keys, or with windows a
        window over just the range, bound to the QP (the MR allows no remote access)."""
        cdef int rc
        if access == RM_ACCESS_LOCAL or not self.mem.windows:
            out.handle, out.lkey, out.rkey = 0, lkey, rkey
            return 0
        if self.state != 1 or self.inherited():
            out.handle = out.lkey = out.rkey = 0
            return RM_ERR_CLOSED
        rc = self.mem.expose_cached(self.cache_mem, lkey, out)
        if rc == 0:
            rc = _bind_exposed(self, out, addr, length, access)
        return rc

    cdef int unexpose(self, uint32_t handle) noexcept nogil:
        """Free the exposure; a window's bind must have finished first (a window freed
        under a pending bind fails the QP)."""
        if self.mem is None:
            return 0
        if self.mem.windows and 0 < handle <= XMR_N and not self.inherited():
            _await_bind(self, self.mem.xbind[handle - 1])
        return self.mem.unexpose(handle)

    def mr_register(self, size_t addr, size_t length, bint remote_read=False):
        """Register [addr, addr+length) for the registration cache (rdmamw.memory.regcache):
        with ``remote_read`` the peer may READ it (rendezvous sources), else it is a local
        READ target only. Returns the cache's handle ``(mr, lkey, rkey)``; OSError if
        the device refuses (``ulimit -l``)."""
        if self.mem is None:
            raise OSError(107, "the transport is not open")
        return self.cache_mem.mr_register(addr, length, remote_read)

    def shared_registrations(self):
        """The process's VerbsMemory whose registrations all channels on the shared PD
        use (None: this channel registers for itself)."""
        return self.cache_mem if self.mem is not None and self.mem.windows else None

    def mr_deregister(self, handle):
        """Deregister an MR of mr_register (the cache calls it once nothing uses it)."""
        if self.cache_mem is not None:
            self.cache_mem.mr_deregister(handle)

    def error_detail(self):
        """What failed the connection first, in words (None while it is up or was
        closed cleanly): the work completion's status, or the call that failed."""
        return self.failure.detail()

    def counters(self):
        """The Transport's, plus: receive completions, the MRs and bytes this endpoint
        has registered (its block and receive buffer included), and what the process's
        device holds for all its endpoints (``device_qps``, ``device_cqs``)."""
        d = Transport.counters(self)
        d["recv_completions"] = self.n_recv_completions
        n, nbytes = self.mem.usage() if self.mem is not None else (0, 0)
        bn, bbytes = self.block.usage() if self.block is not None else (0, 0)
        if self.recv_mr != NULL:
            n, nbytes = n + 1, nbytes + self.recv_mr.length
        d["mrs"], d["bytes_registered"] = n + bn, nbytes + bbytes
        d["mw_binds"] = self.n_binds    # windows bound (docs/protocol.md "Keys a peer gets")
        # a ring that grows (docs/protocol.md): slots granted each way, grants made
        d["ring_slots_granted"] = min(self.local_granted, self.ring_slots)
        d["peer_ring_slots_granted"] = min(self.peer_granted, self.peer_slots)
        if self.block is not None:
            d["ring_grants_given"], d["ring_grants_taken"] = self.block.given, self.block.taken
        if self.dev is not None:
            c = self.dev.counters()
            d["device_qps"], d["device_cqs"] = c["qps"], c["send_cqs"] + c["recv_cqs"]
        return d

    # ---- teardown ---------------------------------------------------------------

    def close(self):
        """Let posted WRs finish (bounded), then hang up: the peer sees EOF and a
        thread of ours blocked in wait() wakes. The verbs objects are destroyed only
        when the transport dies, so no other thread can be inside them; the block
        stays allocated while Messages may point into it."""
        if self.inherited():
            self.state = RM_ERR_CLOSED  # a fork child: nothing here is ours to drain
            return
        if self.state == 1:
            with nogil:
                _drain_sq(self, 1000000000)
            self.state = RM_ERR_CLOSED
        if self.sock >= 0:
            shutdown(self.sock, SHUT_RDWR)

    cdef void _destroy(self) noexcept:
        if self.sock >= 0:
            close(self.sock)
            self.sock = -1
        if self.inherited():
            # a fork child shares the parent's uverbs file: destroying a QP, CQ or MR
            # here would destroy the parent's; the kernel frees them with the parent
            return
        if self.joined:
            self.dev.leave(self.route)      # no completion is routed here any more
        if self.block is not None:
            self.block.drop_windows()   # a window bound to the QP holds it
        if self.mem is not None:
            self.mem.drop_windows()
        if self.qp != NULL:
            ibv_destroy_qp(self.qp)
            self.qp = NULL
        if self.joined:
            self.dev.purge(self.route)      # nor stays in the shared CQs (GIL held)
            self.joined = False
        if self.recv_mr != NULL:
            self.mem.dev.dereg_mr(self.recv_mr)
            self.recv_mr = NULL
        if self.block is not None:
            self.block.release()    # its MRs (before the PD goes)
        if self.mem is not None:
            self.mem.release()      # its MRs, then the PD (after the QP and MRs on it)

    def __dealloc__(self):
        self._destroy()
        route_free(self.route)
        self.route = NULL
        free(self.recv_buf)
        free(self.sig_pos)
        free(self.stash)
        free(self.swr)
        free(self.sge)

    # ---- data path (nogil) ------------------------------------------------------

    cdef void _fail(self, int code, int kind=FAIL_OTHER, int err=0) noexcept nogil:
        """The connection is dead: remember why (the first cause; ``err``: an errno),
        and make sure the peer sees EOF."""
        if self.state == 1:
            self.failure.call(kind, err)
            self.state = code
            if self.sock >= 0:
                shutdown(self.sock, SHUT_RDWR)

    cdef void _wc_error(self, ibv_wc *wc, int kind) noexcept nogil:
        self.failure.completion(wc, kind, self.state == 1)
        self._fail(RM_ERR_PEER_LOST, kind)

    cdef inline int _dead(self) noexcept nogil:
        return self.state if self.state < 0 else RM_ERR_CLOSED

    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        cdef uint32_t i, part, off = 0
        cdef int rc = 0
        if self.state != 1:
            return self._dead()
        for i in range(n):      # validate the whole chain first: all or nothing
            if not _wr_in_bounds(self, &wrs[i]):
                return RM_ERR_BOUNDS
        rm_spin_lock(&self.lock)
        i = 0
        while i < n and rc == 0:
            part = 0
            while part < self.max_chain and i < n:
                i += _fill_piece(self, part, &wrs[i], &off)
                part += 1
            rc = self._post_chain(part, i == n)
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
        """Poll until the send queue has room for count WRs; bounded (caller holds lock)."""
        cdef int64_t t, start = 0, next_sock = 0
        while self.sq_depth - (self.sq_posted - self.sq_done) < count:
            if self._poll_send_locked() > 0:
                start = 0       # progress: "stuck" counts from the last completion
            else:
                # our receive WRs are reposted as they are polled: a peer as blocked
                # as we are still gets its wake-up SENDs received (no RNR standstill)
                self._drain_recv()
                t = now_ns()
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
            if self.state != 1:
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
        if r.overflow and self.state == 1:      # a completion was lost: accounting is off
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
        elif r.post_errno and self.state == 1:
            self._fail(RM_ERR_PEER_LOST, FAIL_POST, r.post_errno)
        rm_spin_unlock(&self.rlock)
        return n

    cdef bint _woken(self) noexcept nogil:
        """A receive completion of ours was routed and not yet taken."""
        return rmv_load64(&self.route.recv_ok) != self.recv_seen

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
        if self.state != 1 or not self.block.take(self.local[RM_REGION_CTRL].addr):
            return False
        self.peer_granted = self.block.peer_granted or RM_ALL_SLOTS
        return True

    cdef int wake_peer(self) noexcept nogil:
        cdef ibv_send_wr *w
        cdef int rc
        if self.state != 1:
            return self._dead()
        rm_spin_lock(&self.lock)
        if self.peer_imm and self.last_imm:
            rm_spin_unlock(&self.lock)   # the WRITE_WITH_IMM just posted wakes the peer
            return 0
        w = &self.swr[0]
        memset(w, 0, sizeof(ibv_send_wr))
        w.wr_id = INTERNAL
        w.opcode = IBV_WR_SEND          # zero bytes: only the receive completion matters
        w.send_flags = IBV_SEND_SOLICITED   # an event even where nobody sleeps (grants)
        rc = self._post_chain(1, True)
        rm_spin_unlock(&self.lock)
        if rc == 0:
            self.n_wakeups += 1
        return rc

    cdef int wait(self, int timeout_ms) noexcept nogil:
        cdef pollfd fds[2]
        cdef uint64_t one
        cdef int r
        if self.state != 1:
            return self._dead()
        if self._drain_recv() > 0:
            return 1
        self.dev.sleep(self.route, True)    # routed completions now write our eventfd
        self.dev.arm(self.route.rcq)
        if self._settle() > 0 or self._woken():     # arrived before we slept
            self.dev.sleep(self.route, False)
            self._drain_recv()
            return 1
        if not self.event_mode and timeout_ms > self.poll_ms:
            timeout_ms = self.poll_ms    # a plain WRITE gives no event: look again soon
        fds[0].fd, fds[0].events, fds[0].revents = self.route.evfd, POLLIN, 0
        fds[1].fd, fds[1].events, fds[1].revents = self.sock, POLLIN, 0
        r = poll(fds, 2, timeout_ms)
        self.dev.sleep(self.route, False)
        if r < 0:
            return 0 if errno == EINTR else RM_ERR_OS
        if fds[0].revents & POLLIN:
            read(self.route.evfd, &one, 8)
            self._drain_recv()
            return 1
        if fds[1].revents:
            return self.peer_state()
        return 0

    def poll_interval(self) -> float:
        # a peer's plain WRITE of arrival words raises no event: the wake-up SEND it
        # sends when it sees our sleep flag can race with the flag's WRITE (wait()
        # looks again after poll_ms for the same reason)
        return 0.0 if self.event_mode else self.poll_ms / 1000.0

    def _event_fds(self):
        # the endpoint's eventfd (written when a wake-up SEND or a WRITE_WITH_IMM of
        # the peer is routed to it, once arm_fd marked it sleeping) and the side
        # channel (its death)
        if not self.joined or self.sock < 0:
            raise ChannelClosed("the verbs connection is closed")
        return (self.route.evfd, self.sock)

    cdef void reap_wakeups(self) noexcept nogil:
        if self.state == 1:
            self._drain_recv()

    cdef int arm_fd(self) noexcept nogil:
        cdef uint64_t one
        if self.state != 1:
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
        if self.state != 1:
            return self.state
        if rmv_trylock(&self.lock):       # error completions of unsignaled writes too
            self._poll_send_locked()
            rm_spin_unlock(&self.lock)
        self._drain_recv()
        if self.state == 1 and _sock_dead(self.sock):
            self._fail(RM_ERR_PEER_LOST, FAIL_SOCKET)
        return self.state


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


cdef uint32_t _fill_piece(VerbsTransport tp, uint32_t j, rm_wr *wr, uint32_t *off) noexcept nogil:
    """Fill send WR j from ``wr``, or from its next piece of at most tp.read_chunk bytes
    at ``*off`` if it is a longer READ (the last piece keeps its signal, every
    PIECES_PER_SIGNAL-th gets an internal one); 1 when ``wr`` is done, 0 while pieces
    of it remain."""
    cdef rm_wr piece
    if wr.opcode != RM_WR_READ or tp.read_chunk == 0 or wr.length <= tp.read_chunk:
        tp._fill(j, wr)
        return 1
    piece = wr[0]
    piece.local_addr += off[0]
    piece.remote_off += off[0]
    piece.length = min(tp.read_chunk, wr.length - off[0])
    off[0] += piece.length
    tp._fill(j, &piece)
    if off[0] < wr.length:
        if (off[0] // tp.read_chunk) % PIECES_PER_SIGNAL:
            tp.swr[j].send_flags &= ~IBV_SEND_SIGNALED
        else:
            tp.swr[j].send_flags |= IBV_SEND_SIGNALED
            tp.swr[j].wr_id |= INTERNAL
        return 0
    off[0] = 0
    return 1


cdef void _drain_sq(VerbsTransport tp, int64_t budget_ns) noexcept nogil:
    """Let the posted WRs finish (close), at most ``budget_ns``."""
    cdef int64_t end = now_ns() + budget_ns
    cdef ibv_send_wr *w
    rm_spin_lock(&tp.lock)
    if tp.unsig and tp.state == 1:
        w = &tp.swr[0]     # a signaled zero-byte WRITE flushes the unsignaled tail
        memset(w, 0, sizeof(ibv_send_wr))
        w.wr_id = INTERNAL
        w.opcode = IBV_WR_RDMA_WRITE
        w.send_flags = IBV_SEND_SIGNALED
        w.wr.rdma.remote_addr = tp.peer_addr[RM_REGION_CTRL]
        w.wr.rdma.rkey = tp.peer_rkey
        tp._post_chain(1, True)
    while tp.state == 1 and tp.sq_done < tp.sq_posted and now_ns() < end:
        if tp._poll_send_locked() == 0:
            rm_cpu_relax()
    rm_spin_unlock(&tp.lock)


cdef int _open_qp(VerbsTransport tp, VerbsDevice dev, rmv_route *r, uint32_t max_inline,
                  int port) except -1:
    """The endpoint's part of _open from its receive buffer on: the QP (INIT) on the
    route's CQs, the block's window, the send-side arrays, the receive WRs posted, the
    route added to the device's table."""
    cdef void *mem = NULL
    cdef int err
    if pin_charge(RECV_BUF):
        raise budget_error(RECV_BUF, "a channel's receive buffer")
    tp.mem.charged += RECV_BUF
    if posix_memalign(&mem, 64, RECV_BUF) != 0:
        raise MemoryError()
    tp.recv_buf = <char *>mem
    tp.recv_mr = tp.mem.dev.reg_mr(tp.mem.pd, mem, RECV_BUF, IBV_ACCESS_LOCAL_WRITE)
    if tp.recv_mr == NULL:
        err = errno
        raise tp.mem.dev.mr_failed(err, "a channel's receive buffer", RECV_BUF)
    tp.qp = _create_qp(tp.mem.pd, dev.scqs[r.scq], dev.rcqs[r.rcq], tp.sq_depth,
                       tp.rq_depth, &max_inline, port)
    tp.max_inline = max_inline
    tp.block.open_window()
    tp.qpn = r.qpn = tp.qp.qp_num
    r.qp = tp.qp
    tp.sig_pos = <uint64_t *>calloc(tp.sq_depth, 8)
    tp.stash_cap = tp.sq_depth + 16
    tp.stash = <rm_wc *>calloc(tp.stash_cap, sizeof(rm_wc))
    tp.swr = <ibv_send_wr *>calloc(tp.max_chain, sizeof(ibv_send_wr))
    tp.sge = <ibv_sge *>calloc(tp.max_chain, sizeof(ibv_sge))
    if tp.sig_pos == NULL or tp.stash == NULL or tp.swr == NULL or tp.sge == NULL:
        raise MemoryError()
    route_fill(r, <uint64_t>tp.recv_buf, tp.recv_mr.lkey, tp.rq_depth)
    dev.add(r)
    return 0


cdef ibv_qp *_create_qp(ibv_pd *pd, ibv_cq *scq, ibv_cq *rcq, uint32_t sq_depth,
                       uint32_t rq_depth, uint32_t *max_inline, int port) except NULL:
    """An RC queue pair on the shared CQs, in INIT (remote READ and WRITE allowed: the
    MRs say where), with as much inline data as the device allows of ``max_inline``
    (set to what it gave)."""
    cdef ibv_qp_init_attr ia
    cdef ibv_qp_attr at
    cdef ibv_qp *qp
    while True:
        memset(&ia, 0, sizeof(ia))
        ia.send_cq, ia.recv_cq = scq, rcq
        ia.qp_type, ia.sq_sig_all = IBV_QPT_RC, 0
        ia.cap.max_send_wr, ia.cap.max_recv_wr = sq_depth, rq_depth
        ia.cap.max_send_sge, ia.cap.max_recv_sge = 1, 1
        ia.cap.max_inline_data = max_inline[0]
        qp = ibv_create_qp(pd, &ia)
        if qp != NULL or max_inline[0] == 0:
            break
        max_inline[0] //= 2         # the device allows less inline data: ask for less
    if qp == NULL:
        raise OSError(errno, f"ibv_create_qp failed ({strerror(errno).decode()})")
    max_inline[0] = ia.cap.max_inline_data
    memset(&at, 0, sizeof(at))
    at.qp_state, at.port_num, at.pkey_index = IBV_QPS_INIT, port, 0
    at.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
    if ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT
                     | IBV_QP_ACCESS_FLAGS):
        e = errno
        ibv_destroy_qp(qp)
        raise OSError(e, "QP to INIT failed")
    return qp


# ---- memory windows: the keys a peer gets (docs/protocol.md "Keys a peer gets") ------

cdef int _bind_head(VerbsTransport tp) except -1:
    """Bind the block's window to the QP (now ready to send) and wait for it: the peer
    writes the block only after the handshake's last step, which follows."""
    cdef VerbsBlock b = tp.block
    cdef ibv_send_wr *bad = NULL
    cdef int rc
    cdef int64_t end = now_ns() + 2 * STUCK_NS
    _bind_wr(&tp.swr[0], b.head_mw, b.head_mr, <uint64_t>b.head_mr.addr,
             b.head_mr.length, IBV_ACCESS_REMOTE_WRITE, b.head_rkey)
    rm_spin_lock(&tp.lock)
    rc = ibv_post_send(tp.qp, tp.swr, &bad)
    if rc == 0:
        tp.sig_pos[tp.sig_tail % tp.sq_depth] = tp.sq_posted + 1
        tp.sig_tail += 1
        tp.sq_posted += 1
        tp.n_binds += 1         # counted as what it is (mw_binds), not as data
        with nogil:
            while tp.sq_done < tp.sq_posted and not tp.error_reported and now_ns() < end:
                if tp._poll_send_locked() == 0:
                    rm_cpu_relax()
    rm_spin_unlock(&tp.lock)
    if rc != 0:
        raise OSError(rc, f"posting the bind of the block's memory window failed "
                          f"({strerror(rc).decode()})")
    if tp.sq_done < tp.sq_posted:
        raise OSError(5, "binding the block's memory window failed: "
                         + (str(tp.failure.detail()) if tp.error_reported
                            else "no completion within 20 s"))
    return 0


cdef int _bind_exposed(VerbsTransport tp, rm_mem *out, uint64_t addr, uint64_t length,
                       uint32_t access) noexcept nogil:
    """Post the bind of exposure ``out``'s window (signaled: unexpose waits for it before
    the window is freed); undo the exposure if it cannot be posted."""
    cdef uint32_t i = out.handle - 1
    cdef int rc
    rm_spin_lock(&tp.lock)
    _bind_wr(&tp.swr[0], tp.mem.xmws[i], tp.mem.xmrs[i], addr, length,
             IBV_ACCESS_REMOTE_READ if access == RM_ACCESS_REMOTE_READ
             else IBV_ACCESS_REMOTE_WRITE, out.rkey)
    rc = tp._post_chain(1, True)
    if rc == 0:
        tp.mem.xbind[i] = tp.sq_posted
        tp.n_binds += 1
    rm_spin_unlock(&tp.lock)
    if rc != 0:
        tp.mem.unexpose(out.handle)
        out.handle = out.lkey = out.rkey = 0
    return rc


cdef void _await_bind(VerbsTransport tp, uint64_t pos) noexcept nogil:
    """Until the send queue has completed past ``pos`` (a bind), or the connection is
    dead; a QP that completes nothing for STUCK_NS is given up as a lost peer."""
    cdef int64_t end
    if tp.sq_done >= pos:
        return
    end = now_ns() + STUCK_NS
    rm_spin_lock(&tp.lock)
    while tp.sq_done < pos and tp.state == 1:
        if tp._poll_send_locked() == 0:
            if now_ns() > end:
                tp._fail(RM_ERR_PEER_LOST, FAIL_STUCK)
            rm_cpu_relax()
    rm_spin_unlock(&tp.lock)


cdef void _bind_wr(ibv_send_wr *w, ibv_mw *mw, ibv_mr *mr, uint64_t addr, uint64_t length,
                   unsigned int access, uint32_t rkey) noexcept nogil:
    """w: the signaled BIND_MW of type-2 window ``mw`` over [addr, addr+length) of
    ``mr`` with ``access``, giving it key ``rkey`` (ibv_inc_rkey of its last)."""
    memset(w, 0, sizeof(ibv_send_wr))
    w.wr_id, w.opcode, w.send_flags = INTERNAL, IBV_WR_BIND_MW, IBV_SEND_SIGNALED
    w.bind_mw.mw, w.bind_mw.rkey = mw, rkey
    w.bind_mw.bind_info.mr, w.bind_mw.bind_info.addr = mr, addr
    w.bind_mw.bind_info.length, w.bind_mw.bind_info.mw_access_flags = length, access


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


cdef int _qp_to_rts(ibv_qp *qp, ibv_mtu mtu, uint32_t my_psn, uint32_t qpn, uint32_t psn,
                    bytes gid, int lid, int port, int gid_index, int timeout_exp) except -1:
    """RESET/INIT -> RTR (pointed at the peer's QP) -> RTS; OSError naming the step."""
    cdef ibv_qp_attr at
    memset(&at, 0, sizeof(at))
    at.qp_state = IBV_QPS_RTR
    at.path_mtu = mtu
    at.dest_qp_num, at.rq_psn = qpn, psn
    at.max_dest_rd_atomic, at.min_rnr_timer = 1, 12
    at.ah_attr.is_global, at.ah_attr.port_num, at.ah_attr.dlid = 1, port, lid
    memcpy(at.ah_attr.grh.dgid.raw, <char *>gid, 16)
    at.ah_attr.grh.sgid_index, at.ah_attr.grh.hop_limit = gid_index, 64
    if ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU
                     | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC
                     | IBV_QP_MIN_RNR_TIMER):
        raise OSError(errno, f"QP to RTR failed ({strerror(errno).decode()})")
    memset(&at, 0, sizeof(at))
    at.qp_state, at.sq_psn, at.max_rd_atomic = IBV_QPS_RTS, my_psn, 1
    # retry_cnt 6: rxe reads 7 as "retry forever", and a dead peer must surface
    at.timeout, at.retry_cnt, at.rnr_retry = timeout_exp, 6, 7
    if ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT
                     | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC):
        raise OSError(errno, f"QP to RTS failed ({strerror(errno).decode()})")
    return 0


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


def load() -> str:
    """dlopen libibverbs (RDMAMW_VERBS_LIBRARY, default libibverbs.so.1, read on the
    first call) and resolve every function this module and _verbs_dev call, once;
    return the path of the library loaded. OSError naming the library or the missing
    symbols."""
    cdef char err[1024]
    cdef int rc = 0
    lib = config.get("RDMAMW_VERBS_LIBRARY")
    if not rm_ibv_loaded():
        rc = rm_ibv_load(lib.encode(), err, sizeof(err))
    if rc == 0:     # the device's extension keeps its own table: the same library
        rc = load_table(rm_ibv_path, err, sizeof(err))
    if rc == -1:
        raise OSError(2, f"cannot load {lib} ({err.decode(errors='replace')}); install "
                         f"rdma-core (libibverbs1) or point RDMAMW_VERBS_LIBRARY at it")
    if rc != 0:
        raise OSError(2, f"{rm_ibv_path.decode(errors='replace')} lacks "
                         f"{err.decode(errors='replace')} (not libibverbs, or older than "
                         f"rdma-core's libibverbs 1.1)")
    return rm_ibv_path.decode(errors="replace")


cdef _require():
    if not rm_ibv_loaded():
        load()


cdef int _fork_init_rc = -1


def fork_safety() -> str:
    """rdma-core's fork rule, applied once before the first device is opened:
    "unneeded" when the kernel copies DMA-pinned pages at fork (5.13+; rdma-core asks it
    over netlink): then ``ibv_fork_init()`` is *not* called, because rdma-core 44
    (Debian 12) still marks every registered range MADV_DONTFORK when it is, and a
    registration of heap memory takes whole pages of the Python heap out of every
    child (children crash at once; test_fork.py in the VM). On older kernels it is
    called: "enabled" (registered pages are not mapped in a child), or "disabled" if
    memory was registered before (EINVAL). RDMAV_FORK_SAFE / IBV_FORK_SAFE make
    libibverbs call it anyway: a warning says so."""
    global _fork_init_rc
    _require()
    cdef int status = <int>ibv_is_fork_initialized()
    if _fork_init_rc < 0:
        _fork_init_rc = 0
        if status != IBV_FORK_UNNEEDED:
            _fork_init_rc = ibv_fork_init()
            status = <int>ibv_is_fork_initialized()
        elif os.environ.get("RDMAV_FORK_SAFE") or os.environ.get("IBV_FORK_SAFE"):
            logging.getLogger("rdmamw.verbs").warning(
                "RDMAV_FORK_SAFE/IBV_FORK_SAFE is set although this kernel copies "
                "pinned pages at fork: registered pages of the Python heap will be "
                "missing in fork children (unset it)")
    return ("disabled", "enabled", "unneeded")[min(max(status, 0), 2)]


def probe(int max_gids=32):
    """Devices, ports and non-zero GIDs as libibverbs reports them (no pyverbs)."""
    cdef int num = 0, i, p, g
    cdef ibv_device **lst
    _require()
    lst = ibv_get_device_list(&num)
    cdef ibv_context *ctx
    cdef ibv_device_attr dattr
    cdef ibv_port_attr pattr
    cdef ibv_gid gid
    if lst == NULL:
        raise OSError(errno, f"ibv_get_device_list: {strerror(errno).decode()}")
    out = []
    try:
        for i in range(num):
            name = ibv_get_device_name(lst[i]).decode()
            ctx = ibv_open_device(lst[i])
            if ctx == NULL:
                out.append({"name": name, "error": f"cannot open: {strerror(errno).decode()}"})
                continue
            ports = []
            if ibv_query_device(ctx, &dattr) == 0:
                for p in range(1, dattr.phys_port_cnt + 1):
                    if ibv_query_port(ctx, p, &pattr):
                        continue
                    gids = []
                    for g in range(min(pattr.gid_tbl_len, max_gids)):
                        if ibv_query_gid(ctx, p, g, &gid) == 0 and any(gid.raw[:16]):
                            gids.append((g, bytes(gid.raw[:16])))
                    ports.append({"port": p, "active": pattr.state == IBV_PORT_ACTIVE,
                                  "state": pattr.state, "lid": pattr.lid,
                                  "mtu": pattr.active_mtu, "link_layer": pattr.link_layer,
                                  "gids": gids})
            out.append({"name": name, "ports": ports, "max_qp_wr": dattr.max_qp_wr})
            ibv_close_device(ctx)
    finally:
        ibv_free_device_list(lst)
    return out


cdef void _offer_hook(VerbsTransport tp) noexcept nogil:
    """rmv_route.hook of an endpoint whose ring grows (its owner: the transport). The
    peer waits for credit: grant it the next part of my ring (VerbsBlock registers it)
    by writing the part's grant word into its control page, then wake it. Runs on the
    thread that routed the peer's wake-up (the device thread while the application is
    away) under the receive CQ's lock, so it only tries the other locks: a peer still
    short asks again (engine/_waits.pyx)."""
    cdef bint posted = False
    cdef int k
    if tp.state != 1:
        return
    k = tp.block.offer()
    if k < 0:
        return
    cdef ibv_mw *mw = tp.block.mws[k]
    cdef ibv_mr *mr = tp.block.mrs[k]
    cdef uint32_t n = 3 if mw != NULL else 2
    if rm_spin_trylock(&tp.lock):
        if tp.sq_depth - (tp.sq_posted - tp.sq_done) < n:
            tp._poll_send_locked()
        if tp.state == 1 and tp.sq_depth - (tp.sq_posted - tp.sq_done) >= n:
            if mw != NULL:      # the part's window, bound before the word names it
                _bind_wr(&tp.swr[0], mw, mr, <uint64_t>mr.addr, mr.length,
                         IBV_ACCESS_REMOTE_WRITE, <uint32_t>tp.block.words[k])
                tp.swr[0].send_flags = 0
                tp.swr[0].next = &tp.swr[1]
                tp.n_binds += 1
            _grant_wrs(&tp.swr[n - 2], tp.sge, &tp.block.words[k], tp.block.words_mr.lkey,
                       tp.peer_addr[RM_REGION_CTRL] + GRANT_OFF + 8 * k, tp.peer_rkey,
                       tp.max_inline >= 8)
            posted = tp._post_chain(n, True) == 0
            if posted:
                tp.n_wakeups += 1
        rm_spin_unlock(&tp.lock)
    tp.block.done(posted)
    if posted:
        tp.local_granted = tp.block.granted
