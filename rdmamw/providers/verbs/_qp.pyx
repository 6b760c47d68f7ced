# cython: freethreading_compatible = False
"""The ``verbs`` provider's queue pair set-up: an RC QP on the process's device, its
registered block and receive buffer, its move to RTR/RTS, the binding of the block's
memory window, the counters and the teardown (VerbsQP), and the first cause of its
failure (VerbsFailure). The per-message data path (post, poll, wait, exposures) is the
subclass's, _transport.VerbsTransport, one extension so no call between extensions is
on it. The device and its CQs are _device's, the MRs _memory's and _block's."""

import cython

from libc.errno cimport errno
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset, strerror
from posix.stdlib cimport posix_memalign

from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ERR_CLOSED,
    RM_ERR_PEER_LOST,
    RM_NREGIONS,
    RM_REGION_CTRL,
    RM_REGION_RING,
    Transport,
    now_ns,
    rm_mem,
    rm_wc,
)
from rdmamw.transport.atomics cimport rm_cpu_relax, rm_spin_lock, rm_spin_unlock
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._lib cimport also_load, require
from rdmamw.providers.verbs._device cimport (
    RECV_BUF,
    VerbsDevice,
    rmv_load64,
    route_fill,
    route_free,
    route_new,
)
from rdmamw.providers.verbs._memory cimport XMR_N, ibv_remote, pin_charge
from rdmamw.providers.verbs._block cimport VerbsBlock
from rdmamw.providers.verbs._backlog cimport bl_free

from rdmamw.providers.verbs._lib import fork_safety
from rdmamw.providers.verbs._device import device
from rdmamw.providers.verbs._memory import budget_error, endpoint_memory

cdef extern from "<sys/socket.h>" nogil:
    int shutdown(int fd, int how)
    int SHUT_RDWR

cdef extern from "<unistd.h>" nogil:
    int close(int fd)

# soft-RoCE (6.1) sends a READ's whole response in one burst; past ~1,000 packets the
# receiving CPU's backlog drops some, and its READ retry can then stall the QP for good
# (docs/design.md "Long READs on soft-RoCE"): at most this much per READ work request
cdef uint32_t READ_CHUNK_SOFT_ROCE = 512 * 1024


cdef int _fill_table(const char *lib, char *err, size_t errlen) noexcept:
    return rm_ibv_load(lib, err, errlen)      # 0 at once when loaded


also_load(_fill_table)


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
        the other CQ, polled later: it replaces the flush. The owner's device refusing
        a region access fails both QPs, and what follows may be seen before the
        refusal's completion is polled (the owner's EOF on the side channel, a receive
        WR our QP in error would not take back, a receive's error): the refusal, the
        cause, replaces those."""
        if (self.kind == 0 and live) or (
                (self.kind == FAIL_SEND_WC or self.kind == FAIL_RECV_WC)
                and self.status == IBV_WC_WR_FLUSH_ERR
                and wc.status != IBV_WC_WR_FLUSH_ERR) or (
                kind == FAIL_SEND_WC and wc.status == IBV_WC_REM_ACCESS_ERR and (
                    self.kind == FAIL_SOCKET or self.kind == FAIL_POST
                    or self.kind == FAIL_OTHER or self.kind == FAIL_RECV_WC)):
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
cdef class VerbsQP(Transport):
    """An RC QP to one peer plus the registered block of this endpoint, up to RTS; its
    fields are declared in _qp.pxd, its data path is VerbsTransport's."""

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
        require()
        fork_safety()
        dev = device(dev_name)
        self.gid, self.lid, self.mtu = dev.port_info(port, gid_index)
        self.port, self.gid_index = port, gid_index
        self.dev, self.mem = dev, endpoint_memory(dev, windows and dev.has_windows)
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
        self.state = QP_CONNECTED
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
        if self.state != QP_CONNECTED or self.inherited():
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
        if self.state != QP_CONNECTED or self.inherited():
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

    @property
    def checks_window_bounds(self) -> bool:
        """Whether the device refuses an access past a memory window's end that falls
        inside the registration under it. Soft-RoCE does not (Linux 6.1): there each
        region gets a registration of exactly its range (docs/remote-memory.md)."""
        return not self.dev.soft_roce

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
        cdef uint64_t doorbells, wakeups, d2, w2
        cdef int _i, tries = 0
        d = Transport.counters(self)
        # a doorbell is counted, then what it was for (a wake-up, a grant of the device
        # thread): read both twice, microseconds apart, until the two reads agree, so a
        # snapshot never holds the one without the other. (Not under the post lock:
        # the device thread's grant only tries that lock, and would be lost.)
        with nogil:
            d2, w2 = rmv_load64(&self.n_doorbells), rmv_load64(&self.n_wakeups)
            while True:
                doorbells, wakeups = d2, w2
                for _i in range(512):
                    rm_cpu_relax()
                d2, w2 = rmv_load64(&self.n_doorbells), rmv_load64(&self.n_wakeups)
                tries += 1
                if (d2 == doorbells and w2 == wakeups) or tries == 100:
                    break
        d["doorbells"], d["wakeups_sent"] = doorbells, wakeups
        d["recv_completions"] = self.n_recv_completions
        n, nbytes = self.mem.usage() if self.mem is not None else (0, 0)
        bn, bbytes = self.block.usage() if self.block is not None else (0, 0)
        if self.recv_mr != NULL:
            n, nbytes = n + 1, nbytes + self.recv_mr.length
        d["mrs"], d["bytes_registered"] = n + bn, nbytes + bbytes
        d["mw_binds"] = self.n_binds    # windows bound (docs/protocol.md "Keys a peer gets")
        # a peer that takes nothing (docs/protocol.md "A peer that takes nothing")
        d["wakeups_held"], d["wrs_queued_late"] = self.n_wakeups_held, self.bl.accepted
        d["wakeups_chained"] = self.n_wakeups_chained
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
        bl_free(&self.bl)

    # ---- what the data path does (VerbsTransport's); the set-up above calls them ----

    cdef void _fail(self, int code, int kind=FAIL_OTHER, int err=0) noexcept nogil:
        """The connection is dead: remember why (the first cause; ``err``: an errno),
        and make sure the peer sees EOF."""
        if self.state == QP_CONNECTED:
            self.failure.call(kind, err)
            self.state = code
            if self.sock >= 0:
                shutdown(self.sock, SHUT_RDWR)

    cdef void _wc_error(self, ibv_wc *wc, int kind) noexcept nogil:
        self.failure.completion(wc, kind, self.state == QP_CONNECTED)
        self._fail(RM_ERR_PEER_LOST, kind)

    cdef inline int _dead(self) noexcept nogil:
        return self.state if self.state < 0 else RM_ERR_CLOSED

    cdef int _post_chain(self, uint32_t count, bint final) noexcept nogil:
        return RM_ERR_CLOSED

    cdef int _poll_send_locked(self) noexcept nogil:
        return 0

    cdef void _offer(self) noexcept nogil:
        pass


cdef int _open_qp(VerbsQP tp, VerbsDevice dev, rmv_route *r, uint32_t max_inline,
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
    tp.bl.cap = tp.sq_depth
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
    """An RC queue pair on the shared CQs, in INIT (remote READ, WRITE and atomics: the
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
    at.qp_access_flags = (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ
                          | IBV_ACCESS_REMOTE_ATOMIC)
    if ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT
                     | IBV_QP_ACCESS_FLAGS):
        e = errno
        ibv_destroy_qp(qp)
        raise OSError(e, "QP to INIT failed")
    return qp


# ---- memory windows: the keys a peer gets (docs/protocol.md "Keys a peer gets") ------

cdef int _bind_head(VerbsQP tp) except -1:
    """Bind the block's window to the QP (now ready to send) and wait for it: the peer
    writes the block only after the handshake's last step, which follows."""
    cdef VerbsBlock b = tp.block
    cdef ibv_send_wr *bad = NULL
    cdef int rc
    cdef int64_t end = now_ns() + 2 * STUCK_NS
    bind_wr(&tp.swr[0], b.head_mw, b.head_mr, <uint64_t>b.head_mr.addr,
             b.head_mr.length, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
             b.head_rkey)
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


# ---- memory windows: the keys a peer gets (docs/protocol.md "Keys a peer gets") ------
cdef int _bind_exposed(VerbsQP tp, rm_mem *out, uint64_t addr, uint64_t length,
                       uint32_t access) noexcept nogil:
    """Post the bind of exposure ``out``'s window (signaled: unexpose waits for it before
    the window is freed); undo the exposure if it cannot be posted."""
    cdef uint32_t i = out.handle - 1
    cdef int rc
    rm_spin_lock(&tp.lock)
    bind_wr(&tp.swr[0], tp.mem.xmws[i], tp.mem.xmrs[i], addr, length,
             ibv_remote(access), out.rkey)
    rc = tp._post_chain(1, True)
    if rc == 0:
        tp.mem.xbind[i] = tp.sq_posted
        tp.n_binds += 1
    rm_spin_unlock(&tp.lock)
    if rc != 0:
        tp.mem.unexpose(out.handle)
        out.handle = out.lkey = out.rkey = 0
    return rc


cdef void _await_bind(VerbsQP tp, uint64_t pos) noexcept nogil:
    """Until the send queue has completed past ``pos`` (a bind), or the connection is
    dead; a QP that completes nothing for STUCK_NS is given up as a lost peer."""
    cdef int64_t end
    if tp.sq_done >= pos:
        return
    end = now_ns() + STUCK_NS
    rm_spin_lock(&tp.lock)
    while tp.sq_done < pos and tp.state == QP_CONNECTED:
        if tp._poll_send_locked() == 0:
            if now_ns() > end:
                tp._fail(RM_ERR_PEER_LOST, FAIL_STUCK)
            rm_cpu_relax()
    rm_spin_unlock(&tp.lock)

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


cdef void _offer_hook(VerbsQP tp) noexcept nogil:
    """rmv_route.hook of an endpoint whose ring grows (its owner: the transport): the
    peer waits for credit (VerbsTransport._offer grants it)."""
    tp._offer()
