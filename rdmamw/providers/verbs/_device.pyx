# cython: freethreading_compatible = False
"""The ``verbs`` provider's device (declared in _device.pxd): opened once per process,
with its completion channel, shared CQs, the routing of their completions to queue
pairs (VerbsDevice, rmv_route) and the thread that turns the channel's events into
wake-ups. What an endpoint registers is _memory's; its queue pair is _qp's and
_transport's.

This extension never links libibverbs: _lib.load() fills its table of calls from the
library it loaded, before any device is opened."""

import os
import threading

import cython

from libc.errno cimport EINTR, ENOSPC, errno
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport strerror

from rdmamw.transport._base cimport current_pid
from rdmamw.errors import RegistrationError

from rdmamw.transport.atomics cimport rm_spin_lock, rm_spin_trylock, rm_spin_unlock
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._lib cimport also_load

cdef extern from *:
    """
    #include <fcntl.h>
    static inline int rmv_set_nonblock(int fd) {
        int fl = fcntl(fd, F_GETFL);
        return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    }
    """
    int rmv_set_nonblock(int fd) nogil

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    short POLLIN

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    int EFD_NONBLOCK, EFD_CLOEXEC

cdef extern from "<unistd.h>" nogil:
    ssize_t write(int fd, const void *buf, size_t n)
    int close(int fd)

# the vendor id the kernel's soft-RoCE driver (rdma_rxe) reports for its devices
cdef enum:
    RXE_VENDOR_ID = 0xFFFFFF



cdef int _fill_table(const char *lib, char *err, size_t errlen) noexcept:
    return rm_ibv_load(lib, err, errlen)      # 0 at once when loaded


also_load(_fill_table)


cdef rmv_route *route_new(uint32_t inbox_cap) except NULL:
    cdef rmv_route *r = <rmv_route *>calloc(1, sizeof(rmv_route))
    if r == NULL:
        raise MemoryError()
    r.evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
    r.inbox_cap = inbox_cap
    r.inbox = <ibv_wc *>calloc(inbox_cap, sizeof(ibv_wc))
    if r.evfd < 0 or r.inbox == NULL:
        e = errno
        route_free(r)
        raise OSError(e, "cannot make the endpoint's eventfd or completion inbox")
    return r


cdef int route_fill(rmv_route *r, uint64_t buf, uint32_t lkey, uint32_t depth) except -1:
    """Every receive WR points at the one ``buf`` (wake-ups carry no payload); post
    ``depth`` of them."""
    cdef uint32_t i
    r.rsge.addr, r.rsge.length, r.rsge.lkey = buf, RECV_BUF, lkey
    for i in range(RECV_POOL):
        r.rwr[i].wr_id = i
        r.rwr[i].sg_list = &r.rsge
        r.rwr[i].num_sge = 1
        r.rwr[i].next = &r.rwr[i + 1] if i + 1 < RECV_POOL else NULL
    i = 0
    while i < depth:
        if route_post(r, min(RECV_POOL, depth - i)):
            raise OSError(errno, "ibv_post_recv failed")
        i += RECV_POOL
    return 0


cdef int route_post(rmv_route *r, int k) noexcept nogil:
    """Post ``k`` (<= RECV_POOL) of the route's receive WRs; the errno-style result."""
    cdef ibv_recv_wr *bad = NULL
    cdef int rc
    if k <= 0 or rmv_load32(&r.recv_failed):
        return 0        # none, or the QP is in error: its WRs only flush
    r.rwr[k - 1].next = NULL
    rc = ibv_post_recv(r.qp, &r.rwr[0], &bad)
    if k < RECV_POOL:
        r.rwr[k - 1].next = &r.rwr[k]
    return rc


cdef void route_free(rmv_route *r) noexcept:
    if r == NULL:
        return
    if r.evfd >= 0:
        close(r.evfd)
    free(r.inbox)
    free(r)


_DEVICES_LOCK = threading.Lock()


def _new_lock_in_child():
    global _DEVICES_LOCK
    _DEVICES_LOCK = threading.Lock()   # a thread of the parent may have held it at fork


os.register_at_fork(after_in_child=_new_lock_in_child)
_DEVICES = {}       # (pid, device name) -> VerbsDevice: one per process and device


def device(str name, uint32_t cq_cap=16384) -> VerbsDevice:
    """This process's VerbsDevice for ``name``, opened on first use and kept for the
    process's life (a fork child opens its own: the parent's stays untouched)."""
    key = (os.getpid(), name)
    with _DEVICES_LOCK:             # two handshakes at once must not open it twice
        d = _DEVICES.get(key)
        if d is None:
            d = VerbsDevice(name, cq_cap)
            _DEVICES[key] = d
    return d


def devices() -> list:
    """The devices this process opened (for stats and tests)."""
    pid = os.getpid()
    return [d for (p, _), d in _DEVICES.items() if p == pid]


cdef inline uint32_t _slot(uint32_t qpn, uint32_t cap) noexcept nogil:
    return (qpn * 2654435761u) & (cap - 1)


@cython.final
@cython.no_gc           # no cycle through it (its thread refers to it, it never to that)
cdef class VerbsDevice:
    """An opened device, shared by every endpoint of the process on it: the context,
    one completion channel, and send and receive CQs that each serve many queue pairs
    (their completions routed by QP number). A thread sleeps on the channel and wakes
    the endpoint a receive completion is for when that endpoint sleeps."""

    def __cinit__(self):
        self.pid_now = current_pid()
        self.owner_pid = self.pid_now[0]
        self.fd = -1
        self.stopfd = -1

    def __init__(self, str dev_name, uint32_t cq_cap=16384):
        """Open ``dev_name``, read its limits, make the channel and the routing table,
        start the thread. OSError saying what failed."""
        cdef int num = 0, i
        cdef ibv_device **lst
        cdef ibv_device_attr dattr
        if self.ctx != NULL:
            raise ValueError("the device is open already")
        if not rm_ibv_loaded():     # its calls would be NULL pointers
            raise OSError(2, "libibverbs is not loaded here (rdmamw.providers.verbs._lib.load())")
        lst = ibv_get_device_list(&num)
        if lst == NULL:
            raise OSError(errno, f"ibv_get_device_list: {strerror(errno).decode()}")
        try:
            for i in range(num):
                if ibv_get_device_name(lst[i]).decode() == dev_name:
                    self.ctx = ibv_open_device(lst[i])
                    break
        finally:
            ibv_free_device_list(lst)
        if self.ctx == NULL:
            raise OSError(errno or 19, f"cannot open RDMA device {dev_name!r}")
        if ibv_query_device(self.ctx, &dattr):
            raise OSError(errno, f"cannot query {dev_name}")
        self.name = dev_name
        self.max_qp, self.max_qp_wr, self.max_cq = dattr.max_qp, dattr.max_qp_wr, dattr.max_cq
        self.max_cqe, self.max_mr, self.max_pd = dattr.max_cqe, dattr.max_mr, dattr.max_pd
        self.has_windows = bool(dattr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B)
        self.soft_roce = dattr.vendor_id == RXE_VENDOR_ID
        self.cq_cap = max(64, min(cq_cap, <uint32_t>max(dattr.max_cqe, 64)))
        self.chan = ibv_create_comp_channel(self.ctx)
        if self.chan == NULL or rmv_set_nonblock(self.chan.fd) < 0:
            raise OSError(errno, "ibv_create_comp_channel failed")
        self.fd = self.chan.fd
        self.tcap = 64
        self.table = <rmv_route **>calloc(self.tcap, sizeof(rmv_route *))
        self.stopfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if self.table == NULL or self.stopfd < 0:
            raise OSError(errno, "cannot make the routing table or the thread's eventfd")
        self.thread = threading.Thread(target=self._run, name=f"rdmamw-verbs-{dev_name}",
                                       daemon=True)
        self.thread.start()

    def port_info(self, int port, int gid_index):
        """(gid, lid, active MTU enum) of an active ``port``; OSError if it is not."""
        cdef ibv_port_attr pattr
        cdef ibv_gid gid
        if ibv_query_port(self.ctx, port, &pattr):
            raise OSError(errno, f"cannot query {self.name} port {port}")
        if pattr.state != IBV_PORT_ACTIVE:
            raise OSError(100, f"{self.name} port {port} is not active (state {pattr.state})")
        if ibv_query_gid(self.ctx, port, gid_index, &gid):
            raise OSError(errno, f"cannot read GID {gid_index} of {self.name} port {port}")
        return bytes(gid.raw[:16]), pattr.lid, pattr.active_mtu

    # ---- membership: a queue pair's share of the CQs ------------------------------

    cdef int join(self, rmv_route *r, uint32_t sq_need, uint32_t rq_need) except -1:
        """Reserve room for ``sq_need`` send and ``rq_need`` receive completions on a
        shared CQ of each kind (made when none has room); r.scq / r.rcq say which."""
        if self.n_qps >= <uint32_t>self.max_qp:
            raise OSError(28, f"{self.name} holds at most {self.max_qp} queue pairs "
                              f"(its max_qp); this process has {self.n_qps}: fewer "
                              f"channels per process, or more processes")
        r.scq = self._room(self.scqs, self.s_used, self.s_size, &self.n_scqs, sq_need,
                           False)
        self.s_used[r.scq] += sq_need
        try:
            r.rcq = self._room(self.rcqs, self.r_used, self.r_size, &self.n_rcqs, rq_need,
                               True)
        except BaseException:
            self.s_used[r.scq] -= sq_need
            raise
        self.r_used[r.rcq] += rq_need
        r.sq_need, r.rq_need = sq_need, rq_need
        self.n_qps += 1
        return 0

    cdef uint32_t _room(self, ibv_cq **cqs, uint32_t *used, uint32_t *size, uint32_t *n,
                        uint32_t need, bint events) except? 0xFFFFFFFF:
        cdef uint32_t i, cap
        cdef ibv_cq *cq
        for i in range(n[0]):
            if size[i] - used[i] >= need:
                return i
        if n[0] == MAX_CQS or n[0] * 2 >= <uint32_t>self.max_cq:
            raise OSError(28, f"{self.name}: {n[0]} shared CQs are full (max_cq "
                              f"{self.max_cq}); lower RDMAMW_VERBS_SQ_DEPTH / "
                              f"RDMAMW_VERBS_RQ_DEPTH or open fewer channels")
        cap = max(need, self.cq_cap)
        if cap > <uint32_t>self.max_cqe:
            raise OSError(22, f"a queue pair needs {need} completions, more than "
                              f"{self.name}'s max_cqe {self.max_cqe}: lower "
                              f"RDMAMW_VERBS_SQ_DEPTH / RDMAMW_VERBS_RQ_DEPTH")
        cq = ibv_create_cq(self.ctx, cap, <void *><size_t>(n[0] + 1),
                           self.chan if events else NULL, 0)
        if cq == NULL:
            raise OSError(errno, f"ibv_create_cq of {cap} entries failed "
                                 f"({strerror(errno).decode()})")
        if events:
            ibv_req_notify_cq(cq, 1)        # the device thread sees solicited SENDs
        i = n[0]
        cqs[i], used[i], size[i] = cq, 0, cap
        n[0] = i + 1
        return i

    cdef int add(self, rmv_route *r) except -1:
        """Route the completions of r.qpn to ``r`` from now on."""
        cdef uint32_t i, cap
        cdef rmv_route **t
        cdef rmv_route **old
        rm_spin_lock(&self.tlock)
        if 2 * (self.n_qps + 1) > self.tcap:     # keep it at most half full
            cap = self.tcap * 2
            while 2 * (self.n_qps + 1) > cap:
                cap *= 2
            t = <rmv_route **>calloc(cap, sizeof(rmv_route *))
            if t == NULL:
                rm_spin_unlock(&self.tlock)
                raise MemoryError()
            for i in range(self.tcap):
                if self.table[i] != NULL:
                    self._put(t, cap, self.table[i])
            old, self.table, self.tcap = self.table, t, cap
            free(old)
        self._put(self.table, self.tcap, r)
        rm_spin_unlock(&self.tlock)
        return 0

    cdef void _put(self, rmv_route **t, uint32_t cap, rmv_route *r) noexcept nogil:
        cdef uint32_t i = _slot(r.qpn, cap)
        while t[i] != NULL:
            i = (i + 1) & (cap - 1)
        t[i] = r

    cdef rmv_route *_find(self, uint32_t qpn) noexcept nogil:
        """The route of ``qpn`` or NULL; caller holds tlock."""
        cdef uint32_t i = _slot(qpn, self.tcap)
        while self.table[i] != NULL:
            if self.table[i].qpn == qpn:
                return self.table[i]
            i = (i + 1) & (self.tcap - 1)
        return NULL

    cdef void leave(self, rmv_route *r) noexcept:
        """Stop routing to ``r`` (under its CQs' locks: no poller holds it after) and
        give back its room. Before its QP is destroyed."""
        cdef uint32_t i, j, cap
        cdef rmv_route *x
        if r.sq_need == 0:
            return          # never joined, or gone already
        rm_spin_lock(&self.s_lock[r.scq])
        rm_spin_lock(&self.r_lock[r.rcq])
        rm_spin_lock(&self.tlock)
        i = _slot(r.qpn, self.tcap)
        cap = self.tcap
        while self.table[i] != NULL and self.table[i] != r:
            i = (i + 1) & (cap - 1)
        if self.table[i] == r:          # delete, then re-place the run after it
            self.table[i] = NULL
            j = (i + 1) & (cap - 1)
            while self.table[j] != NULL:
                x = self.table[j]
                self.table[j] = NULL
                self._put(self.table, cap, x)
                j = (j + 1) & (cap - 1)
        rm_spin_unlock(&self.tlock)
        if rmv_flip32(&r.sleeping, 1, 0):
            rmv_add32(&self.sleepers, -1)
        rm_spin_unlock(&self.r_lock[r.rcq])
        rm_spin_unlock(&self.s_lock[r.scq])
        self.s_used[r.scq] -= r.sq_need
        self.r_used[r.rcq] -= r.rq_need
        r.sq_need = r.rq_need = 0
        self.n_qps -= 1

    cdef void purge(self, rmv_route *r) noexcept:
        """After its QP is destroyed (no completion of it comes any more): take what
        of it is still in its CQs out (dropped, since it is no longer routed), so a
        queue pair made later with the same number never gets them. The caller holds
        the GIL from the destruction to here, as every QP creation does."""
        while self.poll_send(r.scq, True) == WC_BATCH:
            pass
        while self.poll_recv(r.rcq, True) == WC_BATCH:
            pass

    # ---- the data path: polling and routing (nogil) -------------------------------

    cdef int _take(self, int *lock, ibv_cq *cq, ibv_wc *wcs, bint wait) noexcept nogil:
        """Take a CQ's lock and poll a batch from it: the number polled (negative if
        polling failed), the lock held. NOT_TAKEN (lock not held) when another thread
        polls that CQ and ``wait`` is false: it routes the completions for us."""
        if wait:
            rm_spin_lock(lock)
        elif not rm_spin_trylock(lock):
            return NOT_TAKEN
        return ibv_poll_cq(cq, WC_BATCH, wcs)

    cdef void _routes(self, ibv_wc *wcs, int k, rmv_route **out) noexcept nogil:
        """The route of each of ``k`` completions (NULL, counted as dropped, for a QP
        that has left). The caller holds the CQ's lock, which keeps these routes alive
        after the table's lock is released (leave() takes the CQ locks)."""
        cdef int j
        rm_spin_lock(&self.tlock)
        for j in range(k):
            out[j] = self._find(wcs[j].qp_num)
            if out[j] == NULL:
                self.n_dropped += 1
        rm_spin_unlock(&self.tlock)
        rmv_add64(&self.n_routed, k)

    cdef int poll_send(self, uint32_t i, bint wait) noexcept nogil:
        """Poll send CQ ``i`` once (a batch) and move each completion to its route's
        inbox. The number polled: 0 also when another thread polls it already (``wait``
        false), negative if polling failed."""
        cdef ibv_wc wcs[WC_BATCH]
        cdef rmv_route *routes[WC_BATCH]
        cdef rmv_route *r
        cdef int j, k = self._take(&self.s_lock[i], self.scqs[i], wcs, wait)
        if k == NOT_TAKEN:
            return 0
        if k > 0:
            self._routes(wcs, k, routes)
            for j in range(k):
                r = routes[j]
                if r == NULL:
                    continue
                rm_spin_lock(&r.ilock)
                if r.inbox_len == r.inbox_cap:
                    r.overflow = 1
                else:
                    r.inbox[(r.inbox_head + r.inbox_len) % r.inbox_cap] = wcs[j]
                    r.inbox_len += 1
                rm_spin_unlock(&r.ilock)
        rm_spin_unlock(&self.s_lock[i])
        return k

    cdef int poll_recv(self, uint32_t i, bint wait) noexcept nogil:
        """Poll receive CQ ``i`` once (a batch): count each completion on its route,
        repost its receive WRs, and wake the routes that sleep. The number polled, as
        poll_send's."""
        cdef ibv_wc wcs[WC_BATCH]
        cdef rmv_route *routes[WC_BATCH]
        cdef rmv_route *touched[WC_BATCH]
        cdef uint32_t again[WC_BATCH]
        cdef int j, n = 0, m, rc
        cdef uint32_t ok
        cdef rmv_route *r
        cdef uint64_t one = 1
        cdef int k = self._take(&self.r_lock[i], self.rcqs[i], wcs, wait)
        if k == NOT_TAKEN:
            return 0
        if k > 0:
            self._routes(wcs, k, routes)
            for j in range(k):
                r = routes[j]
                if r == NULL:
                    continue
                ok = wcs[j].status == IBV_WC_SUCCESS
                if not ok and not rmv_load32(&r.recv_failed):
                    r.recv_err = wcs[j]         # a sleeper is woken to see it
                    rmv_store32(&r.recv_failed, 1)
                for m in range(n):
                    if touched[m] == r:
                        again[m] += ok
                        break
                else:
                    touched[n], again[n] = r, ok
                    n += 1
            for m in range(n):
                r = touched[m]
                rc = route_post(r, again[m])
                if rc != 0 and r.post_errno == 0:
                    r.post_errno = rc
                rmv_add64(&r.recv_ok, again[m])
                if rmv_load32(&r.sleeping) and r.evfd >= 0:
                    write(r.evfd, &one, 8)
                if r.hook != NULL and again[m] and rmv_load64(r.hook_want):
                    r.hook(r.hook_owner)
        rm_spin_unlock(&self.r_lock[i])
        return k

    cdef void arm(self, uint32_t i, bint solicited=False) noexcept nogil:
        """Ask for an event on the channel at receive CQ ``i``'s next completion (or
        next solicited one: the wake-up SENDs, which also ask for ring grants)."""
        rm_spin_lock(&self.r_lock[i])
        # (sleepers read under the lock: a sleeper counts itself before it arms, so
        # the last arm of the two is never solicited-only while it sleeps)
        ibv_req_notify_cq(self.rcqs[i], solicited and rmv_load32(&self.sleepers) == 0)
        rm_spin_unlock(&self.r_lock[i])

    cdef void sleep(self, rmv_route *r, bint up) noexcept nogil:
        """Mark ``r`` sleeping (its receive completions write its eventfd) or awake.
        The flag flips by compare-and-swap, so ``sleepers`` moves once per flip: a
        load-then-store let two callers (a wait and the route's removal, or two
        waits) both take one flag down, and a count one too low arms the CQs for
        solicited completions only while a route sleeps (its receiver is never woken:
        a verbs `rdmamw perf -t lat` in the CI's device run hung after earlier tests)."""
        if up:
            if rmv_flip32(&r.sleeping, 0, 1):
                rmv_add32(&self.sleepers, 1)
        elif rmv_flip32(&r.sleeping, 1, 0):
            rmv_add32(&self.sleepers, -1)

    def _run(self):
        with nogil:
            self.dispatch()

    cdef void dispatch(self) noexcept nogil:
        """The thread: wait for the channel's events, route the completions of the CQ
        each names (waking the sleepers they are for) and arm it again while anybody
        sleeps."""
        cdef pollfd fds[2]
        cdef ibv_cq *cq
        cdef void *ctx
        cdef uint32_t i
        fds[0].fd, fds[0].events = self.fd, POLLIN
        fds[1].fd, fds[1].events = self.stopfd, POLLIN
        while True:
            fds[0].revents = fds[1].revents = 0
            if poll(fds, 2, -1) < 0:
                if errno == EINTR:
                    continue
                return
            if fds[1].revents or self.inherited():
                return
            while ibv_get_cq_event(self.chan, &cq, &ctx) == 0:
                ibv_ack_cq_events(cq, 1)
                self.n_events += 1
                i = <uint32_t><size_t>ctx - 1
                if i >= self.n_rcqs:
                    continue
                while self.poll_recv(i, True) == WC_BATCH:
                    pass
                # always armed: for every completion while anybody sleeps, else only
                # for the solicited ones (a wake-up SEND: a sender asks for a grant)
                self.arm(i, True)
                while self.poll_recv(i, True) == WC_BATCH:
                    pass

    # ---- memory registrations: counted once per process, bounded by max_mr ----------

    cdef ibv_mr *reg_mr(self, ibv_pd *pd, void *addr, size_t length, int flags) noexcept nogil:
        """ibv_reg_mr, counted against the device's max_mr: past it NULL with errno
        ENOSPC (mr_failed() says which limit), before the driver is asked."""
        cdef ibv_mr *mr
        if rmv_add32(&self.n_mrs, 1) > self.max_mr:
            rmv_add32(&self.n_mrs, -1)
            rmv_set_errno(ENOSPC)
            return NULL
        mr = ibv_reg_mr(pd, addr, length, flags)
        if mr == NULL:
            rmv_add32(&self.n_mrs, -1)
        return mr

    cdef void dereg_mr(self, ibv_mr *mr) noexcept nogil:
        ibv_dereg_mr(mr)
        rmv_add32(&self.n_mrs, -1)

    cdef ibv_mw *alloc_mw(self, ibv_pd *pd) noexcept nogil:
        """A type-2 memory window on ``pd`` (counted); NULL with errno."""
        cdef ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2)
        if mw != NULL:
            rmv_add32(&self.n_mws, 1)
        return mw

    cdef void dealloc_mw(self, ibv_mw *mw) noexcept nogil:
        """Free a window: it is invalid from here on (no peer can use its key), and
        the MR under it may be deregistered."""
        ibv_dealloc_mw(mw)
        rmv_add32(&self.n_mws, -1)

    def mr_failed(self, int err, str what, size_t length):
        """The error for a reg_mr that returned NULL with errno ``err``: past max_mr a
        RegistrationError (as past the pinned budget), else the driver's OSError."""
        if err == ENOSPC and rmv_load32(&self.n_mrs) >= self.max_mr:
            return RegistrationError(
                f"{what}: {self.name} holds at most {self.max_mr} memory registrations "
                f"(its max_mr) and this process has {rmv_load32(&self.n_mrs)}: fewer "
                f"channels per process, or a smaller RDMAMW_REGCACHE_BYTES")
        return OSError(err, f"ibv_reg_mr of {length} bytes for {what} failed "
                            f"({strerror(err).decode()}; is `ulimit -l` too low?)")

    def counters(self):
        """What the device holds for this process: queue pairs, shared CQs, memory
        registrations, events."""
        return {"qps": self.n_qps, "send_cqs": self.n_scqs, "recv_cqs": self.n_rcqs,
                "pds": rmv_load32(&self.n_pds), "mrs": rmv_load32(&self.n_mrs),
                "mws": rmv_load32(&self.n_mws),
                "sleepers": rmv_load32(&self.sleepers),
                "cq_events": self.n_events, "routed": self.n_routed,
                "dropped": self.n_dropped}

    def stop(self):
        """End the thread (tests): the device stays open."""
        cdef uint64_t one = 1
        if self.stopfd >= 0 and not self.inherited():
            write(self.stopfd, &one, 8)
            if self.thread is not None:
                self.thread.join(5)

    def __dealloc__(self):
        # devices live as long as the process (the registry holds them); this runs
        # only when __init__ failed part-way, or at interpreter exit
        cdef uint32_t i
        if self.inherited():
            return
        for i in range(self.n_scqs):
            ibv_destroy_cq(self.scqs[i])
        for i in range(self.n_rcqs):
            ibv_destroy_cq(self.rcqs[i])
        self.n_scqs = self.n_rcqs = 0
        if self.chan != NULL:
            ibv_destroy_comp_channel(self.chan)
            self.chan = NULL
        if self.pd != NULL:
            self.shared_memory = None
            ibv_dealloc_pd(self.pd)
            self.pd = NULL
        if self.ctx != NULL:
            ibv_close_device(self.ctx)
            self.ctx = NULL
        free(self.table)
        self.table = NULL
        if self.stopfd >= 0:
            close(self.stopfd)
            self.stopfd = -1
