# cython: freethreading_compatible = False
"""The ``verbs`` provider's device resources (declared in _verbs_dev.pxd): the device
each process opens once, with its completion channel, shared CQs and the routing of
their completions to queue pairs (VerbsDevice, rmv_route), and the protection domain
of one endpoint with what it registers there (VerbsMemory: local MRs, the registration
caches' MRs, the exposure table of rendezvous). The queue pair and its data path are
_verbs.VerbsTransport's.

Like _verbs, this extension never links libibverbs: _verbs.load() fills its table of
calls (load_table) from the library it loaded, before any device is opened."""

import os
import threading

import cython

from libc.errno cimport EINTR, ENOSPC, errno
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memset, strerror

from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_OS,
    RM_ERR_UNSUPPORTED,
    current_pid,
    rm_mem,
)
from rdmamw.errors import RegistrationError

from rdmamw.transport.atomics cimport (
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_trylock,
    rm_spin_unlock,
)
from rdmamw.providers.verbs._ibverbs cimport *

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

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap

cdef extern from "<unistd.h>" nogil:
    ssize_t write(int fd, const void *buf, size_t n)
    int close(int fd)

# the vendor id the kernel's soft-RoCE driver (rdma_rxe) reports for its devices
cdef enum:
    RXE_VENDOR_ID = 0xFFFFFF


cdef int load_table(const char *lib, char *err, size_t errlen) noexcept:
    return rm_ibv_load(lib, err, errlen)      # 0 at once when loaded


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


cdef uint64_t _pinned = 0          # bytes charged now, by every endpoint of the process
cdef uint64_t _budget = 0          # set by set_pinned_budget before the first device


cdef int pin_charge(uint64_t n) noexcept nogil:
    cdef uint64_t cur = rmv_load64(&_pinned)
    while True:
        if n > _budget or cur > _budget - n:
            return -1
        if rmv_cas64(&_pinned, &cur, cur + n):
            return 0


cdef void pin_refund(uint64_t n) noexcept nogil:
    rmv_add64(&_pinned, -n)


def set_pinned_budget(uint64_t n) -> None:
    """The process's budget of registered bytes (verbs_device.pinned_budget())."""
    global _budget
    _budget = n


def pinned() -> tuple:
    """(bytes registered by the process's endpoints now, the budget)."""
    return rmv_load64(&_pinned), _budget


def budget_error(uint64_t want, str what):
    """The error for a registration the budget has no room for."""
    used, budget = rmv_load64(&_pinned), _budget
    return RegistrationError(
        f"{what} needs {want} bytes of registered (pinned) memory, but this process has "
        f"{used} of its {budget} registered already: the budget RDMAMW_VERBS_PINNED_BYTES "
        f"(default: from `ulimit -l` and the memory size) is full. Close idle channels, "
        f"use smaller rings (slots, slot_size), or raise the budget")


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
            raise OSError(2, "libibverbs is not loaded here (rdmamw.providers.verbs._transport.load())")
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

    def memory(self, bint windows):
        """The VerbsMemory of a new endpoint: with windows on the process's one PD
        (made on first use, with ``shared_memory``: the registration caches' owner),
        else on a PD of its own."""
        if not windows:
            return VerbsMemory(self, False)
        with _DEVICES_LOCK:
            if self.pd == NULL:
                self.pd = ibv_alloc_pd(self.ctx)
                if self.pd == NULL:
                    raise OSError(errno, f"ibv_alloc_pd failed ({strerror(errno).decode()})")
                self.n_pds += 1
                self.shared_memory = VerbsMemory(self, True)
        return VerbsMemory(self, True)

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


@cython.final
@cython.no_gc_clear     # __dealloc__ deregisters through dev (before the PD goes)
cdef class VerbsMemory:
    """One endpoint's protection domain and the MRs registered on it: local ones, the
    registration caches', and one per exposed range (the NIC then refuses any remote
    access outside it or without the right). With ``windows`` no MR here allows remote
    access at all: the peer's keys are those of type-2 memory windows bound to the
    endpoint's QP (docs/protocol.md "Keys a peer gets"). All live until deregistered or
    until the transport dies."""

    def __cinit__(self, VerbsDevice dev not None, bint windows=False):
        if dev.ctx == NULL:
            raise ValueError("the device is not open")
        if windows and not dev.has_windows:
            raise ValueError(f"{dev.name} has no type-2 memory windows")
        self.dev, self.windows = dev, windows
        if windows:
            if dev.pd == NULL:
                raise ValueError("the device's PD is made by VerbsDevice.memory()")
            self.pd = dev.pd        # the process's: the windows keep peers apart
            return
        self.pd = ibv_alloc_pd(dev.ctx)
        if self.pd == NULL:
            raise OSError(errno, f"ibv_alloc_pd failed ({strerror(errno).decode()})")
        self.own_pd = True
        rmv_add32(&dev.n_pds, 1)

    cdef int remote_flags(self, int access) noexcept nogil:
        """The MR flags for a range the peer gets ``access`` (IBV_ACCESS_REMOTE_*) to:
        with windows the window carries the right and the MR only lets it bind."""
        if self.windows:
            return IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND
        return IBV_ACCESS_LOCAL_WRITE | access

    def register_local(self, size_t addr, size_t length):
        """Register [addr, addr+length) for local access only (WR sources, READ
        targets); the MR lives as long as the transport. Its lkey."""
        cdef ibv_mr *mr
        cdef void *p
        cdef int err
        if pin_charge(length):
            raise budget_error(length, "a channel's staging ring or control words")
        mr = self.dev.reg_mr(self.pd, <void *>addr, length, IBV_ACCESS_LOCAL_WRITE)
        if mr == NULL:
            err = errno
            pin_refund(length)
            raise self.dev.mr_failed(err, "a channel's staging ring or control words", length)
        p = realloc(self.lmrs, (self.n_lmrs + 1) * sizeof(ibv_mr *))
        if p == NULL:
            self.dev.dereg_mr(mr)
            pin_refund(length)
            raise MemoryError()
        self.charged += length
        self.lmrs = <ibv_mr **>p
        self.lmrs[self.n_lmrs] = mr
        self.n_lmrs += 1
        return mr.lkey

    def mr_register(self, size_t addr, size_t length, bint remote_read):
        """An MR for a registration cache: ``(mr, lkey, rkey)`` (with windows the rkey
        opens nothing: expose_cached() binds a window per message)."""
        cdef ibv_mr *mr
        cdef void *p
        cdef int flags = self.remote_flags(IBV_ACCESS_REMOTE_READ) if remote_read \
            else IBV_ACCESS_LOCAL_WRITE
        if pin_charge(length):
            raise budget_error(length, "registering a buffer for a large message")
        cdef int err = 0
        with nogil:
            mr = self.dev.reg_mr(self.pd, <void *>addr, length, flags)
            if mr == NULL:
                err = errno
        if mr == NULL:
            pin_refund(length)
            raise self.dev.mr_failed(err, "registering a buffer for a large message", length)
        rm_spin_lock(&self.xlock)
        if self.n_cmrs == self.cap_cmrs:
            p = realloc(self.cmrs, (2 * self.cap_cmrs + 8) * sizeof(ibv_mr *))
            if p != NULL:
                self.cmrs, self.cap_cmrs = <ibv_mr **>p, 2 * self.cap_cmrs + 8
        if self.n_cmrs < self.cap_cmrs:
            self.cmrs[self.n_cmrs] = mr
            self.n_cmrs += 1
            p = <void *>mr
        else:
            p = NULL
        rm_spin_unlock(&self.xlock)
        if p == NULL:
            self.dev.dereg_mr(mr)
            pin_refund(length)
            raise MemoryError()
        self.charged += length
        return (<size_t>mr, mr.lkey, mr.rkey)

    cdef ibv_mr *_uncache(self, size_t p) noexcept nogil:
        """Take the cached MR ``p`` out of the table (NULL: not there)."""
        cdef uint32_t i
        cdef ibv_mr *mr = NULL
        rm_spin_lock(&self.xlock)
        for i in range(self.n_cmrs):
            if <size_t>self.cmrs[i] == p:
                mr = self.cmrs[i]
                self.n_cmrs -= 1
                self.cmrs[i] = self.cmrs[self.n_cmrs]
                break
        rm_spin_unlock(&self.xlock)
        return mr

    def mr_deregister(self, handle):
        """Deregister an MR of mr_register (nothing in a fork child: it is the
        parent's, same uverbs file)."""
        cdef size_t p = handle[0]
        cdef ibv_mr *mr
        if self.dev.inherited():
            return
        mr = self._uncache(p)
        if mr != NULL:
            self.charged -= mr.length
            pin_refund(mr.length)
            with nogil:
                self.dev.dereg_mr(mr)

    def usage(self):
        """(MRs, bytes) registered here now: local, cached and exposed (an exposure of
        a cached MR is a window, not another MR)."""
        cdef uint32_t i
        cdef size_t n = self.n_lmrs, nbytes = 0
        for i in range(self.n_lmrs):
            nbytes += self.lmrs[i].length
        rm_spin_lock(&self.xlock)
        n += self.n_cmrs
        for i in range(self.n_cmrs):
            nbytes += self.cmrs[i].length
        for i in range(XMR_N):
            if self.xmrs[i] != NULL and self.xmrs[i] != XMR_BUSY and not self.xborrowed[i]:
                n += 1
                nbytes += self.xmrs[i].length
        rm_spin_unlock(&self.xlock)
        return n, nbytes

    cdef int _claim(self) noexcept nogil:
        """A free slot of the exposure table, marked busy; -1 if none."""
        cdef uint32_t i, k
        rm_spin_lock(&self.xlock)
        for k in range(XMR_N):
            i = (self.xmr_hint + k) % XMR_N
            if self.xmrs[i] == NULL:
                self.xmrs[i] = XMR_BUSY
                self.xmr_hint = (i + 1) % XMR_N
                rm_spin_unlock(&self.xlock)
                return i
        rm_spin_unlock(&self.xlock)
        return -1

    cdef int _fill(self, uint32_t i, ibv_mr *mr, bint remote, rm_mem *out) noexcept nogil:
        """Fill slot i with ``mr`` and, with windows and ``remote``, a new window over
        it (the transport binds it to its QP with the key put in out.rkey)."""
        cdef ibv_mw *mw = NULL
        if self.windows and remote:
            mw = self.dev.alloc_mw(self.pd)
            if mw == NULL:
                return RM_ERR_OS
        rm_spin_lock(&self.xlock)
        self.xmrs[i], self.xmws[i], self.xbind[i] = mr, mw, 0
        rm_spin_unlock(&self.xlock)
        out.handle = i + 1
        out.lkey = mr.lkey
        out.rkey = ibv_inc_rkey(mw.rkey) if mw != NULL else mr.rkey
        return 0

    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil:
        """Register the range with the access asked for, in a free slot of the table
        (with windows: a window to bind too, xmws[handle - 1])."""
        cdef int flags = IBV_ACCESS_LOCAL_WRITE
        cdef int i, rc
        cdef ibv_mr *mr
        out.handle = out.lkey = out.rkey = 0
        if access == RM_ACCESS_REMOTE_READ:
            flags = self.remote_flags(IBV_ACCESS_REMOTE_READ)
        elif access == RM_ACCESS_REMOTE_WRITE:
            flags = self.remote_flags(IBV_ACCESS_REMOTE_WRITE)
        elif access != RM_ACCESS_LOCAL:
            return RM_ERR_UNSUPPORTED
        i = self._claim()
        if i < 0:
            return RM_ERR_AGAIN
        mr = self.dev.reg_mr(self.pd, <void *>addr, length, flags)
        rc = RM_ERR_OS if mr == NULL else self._fill(i, mr, access != RM_ACCESS_LOCAL, out)
        if rc != 0:
            if mr != NULL:
                self.dev.dereg_mr(mr)
            rm_spin_lock(&self.xlock)
            self.xmrs[i] = NULL         # frees the slot again
            rm_spin_unlock(&self.xlock)
        return rc

    cdef int expose_cached(self, VerbsMemory owner, uint32_t lkey, rm_mem *out) noexcept nogil:
        """With windows: a slot of the table holding ``owner``'s cached MR of ``lkey``
        (kept when unexposed: its lease keeps it registered) and a new window over it,
        for a READ by the peer."""
        cdef uint32_t k
        cdef ibv_mr *mr = NULL
        cdef int i, rc
        i = self._claim()
        if i < 0:
            return RM_ERR_AGAIN
        rm_spin_lock(&owner.xlock)
        for k in range(owner.n_cmrs):
            if owner.cmrs[k].lkey == lkey:
                mr = owner.cmrs[k]
                break
        rm_spin_unlock(&owner.xlock)
        rm_spin_lock(&self.xlock)
        self.xborrowed[i] = mr != NULL
        rm_spin_unlock(&self.xlock)
        rc = RM_ERR_BOUNDS if mr == NULL else self._fill(i, mr, True, out)
        if rc != 0:
            rm_spin_lock(&self.xlock)
            self.xmrs[i], self.xborrowed[i] = NULL, False
            rm_spin_unlock(&self.xlock)
        return rc

    cdef int unexpose(self, uint32_t handle) noexcept nogil:
        """Free the exposure's window (its key opens nothing from here on), then its
        MR unless a cache owns it. The transport saw the window's bind finish."""
        cdef ibv_mr *mr = NULL
        cdef ibv_mw *mw = NULL
        cdef bint borrowed = False
        if self.dev.inherited():
            return 0        # a fork child: the MR is the parent's (same uverbs file)
        if 0 < handle <= XMR_N:
            rm_spin_lock(&self.xlock)
            mr = self.xmrs[handle - 1]
            if mr == XMR_BUSY:
                mr = NULL               # not a handle anyone was given yet
            else:
                mw, borrowed = self.xmws[handle - 1], self.xborrowed[handle - 1]
                self.xmrs[handle - 1], self.xmws[handle - 1] = NULL, NULL
                self.xborrowed[handle - 1] = False
            rm_spin_unlock(&self.xlock)
        if mw != NULL:
            self.dev.dealloc_mw(mw)
        if mr != NULL and not borrowed:
            self.dev.dereg_mr(mr)
        return 0

    cdef void drop_windows(self) noexcept:
        """Free the exposures' windows: before the QP they are bound to is destroyed
        (a bound window holds the QP: soft-RoCE's destroy waits for it)."""
        cdef uint32_t i
        if self.dev is None or self.dev.inherited():
            return
        rm_spin_lock(&self.xlock)
        for i in range(XMR_N):
            if self.xmws[i] != NULL:
                self.dev.dealloc_mw(self.xmws[i])
                self.xmws[i] = NULL
        rm_spin_unlock(&self.xlock)

    cdef void release(self) noexcept:
        """Free every window, deregister every MR, then free the PD (its queue pair
        and the transport's own MRs on it are gone); nothing in a fork child."""
        cdef uint32_t i
        pin_refund(self.charged)    # a fork child holds copies, not the parent's pins
        self.charged = 0
        if self.dev is None or self.dev.inherited():
            return
        self.drop_windows()
        for i in range(XMR_N):
            if self.xmrs[i] != NULL and self.xmrs[i] != XMR_BUSY and not self.xborrowed[i]:
                self.dev.dereg_mr(self.xmrs[i])
            self.xmrs[i], self.xborrowed[i] = NULL, False
        for i in range(self.n_lmrs):
            self.dev.dereg_mr(self.lmrs[i])
        self.n_lmrs = 0
        for i in range(self.n_cmrs):
            self.dev.dereg_mr(self.cmrs[i])
        self.n_cmrs = 0
        if self.pd != NULL and self.own_pd:
            ibv_dealloc_pd(self.pd)
            rmv_add32(&self.dev.n_pds, -1)
        self.pd = NULL

    def __dealloc__(self):
        self.release()
        free(self.lmrs)
        free(self.cmrs)


@cython.final
@cython.no_gc_clear     # release() deregisters through mem (before the PD goes)
cdef class VerbsBlock:
    """One endpoint's block (control words, bitmaps, the ring the peer writes) and its
    registrations, and a ring that grows both ways (docs/protocol.md "Rings that
    grow"): the parts of my ring registered and granted to the peer, and the parts of
    the peer's ring it granted me. The transport posts the grant words and wakes the
    peer; this unit owns what the words say and the registrations behind them."""

    def __cinit__(self, VerbsMemory mem not None, uint64_t length, uint64_t off,
                  uint64_t ring_len, uint64_t stride, uint32_t granted):
        cdef void *p = NULL
        cdef uint64_t head = length
        cdef int err
        self.mem, self.length = mem, length
        # zero pages on demand: the part of a ring never granted costs no memory
        p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if p == MAP_FAILED:
            raise MemoryError()
        self.base = <char *>p
        if stride and granted and ring_len % stride == 0 and granted < ring_len // stride:
            self.on = True      # the header and the first slots now, the rest on demand
            self.slots, self.stride, self.off = ring_len // stride, stride, off
            self.granted = granted
            head = off + <uint64_t>granted * stride
        if pin_charge(head):
            raise budget_error(head, "a channel's receive ring")
        self.charged = head
        # the peer writes the block, nothing else: no remote read, no atomics
        self.head_mr = mem.dev.reg_mr(mem.pd, p, head,
                                      mem.remote_flags(IBV_ACCESS_REMOTE_WRITE))
        if self.head_mr == NULL:
            err = errno
            raise mem.dev.mr_failed(err, "a channel's receive block", head)
        self.head_rkey = self.head_mr.rkey
        if not self.on:
            return
        p = NULL
        if posix_memalign(&p, 64, MAX_PARTS * 8) != 0:
            raise MemoryError()
        memset(p, 0, MAX_PARTS * 8)
        self.words = <uint64_t *>p
        self.words_mr = mem.dev.reg_mr(mem.pd, p, MAX_PARTS * 8, IBV_ACCESS_LOCAL_WRITE)
        if self.words_mr == NULL:
            err = errno
            raise mem.dev.mr_failed(err, "a channel's grant words", MAX_PARTS * 8)

    def open_window(self):
        """With windows: the block's window (the transport binds it once its QP can
        send), made after the QP: a process's objects are destroyed newest first when
        it dies, and a window bound to a QP must go before it (soft-RoCE waits)."""
        if self.mem.windows and self.head_mw == NULL:
            self.head_mw = self.mem.dev.alloc_mw(self.mem.pd)
            if self.head_mw == NULL:
                raise OSError(errno, "ibv_alloc_mw for a channel's receive block failed")
            self.head_rkey = ibv_inc_rkey(self.head_mw.rkey)

    def peer(self, uint64_t ring_len, uint64_t stride, uint32_t granted, uint32_t rkey):
        """The peer's ring: ``granted`` slots of ``stride`` bytes usable now (0: all)."""
        self.limit = ring_len
        if stride and granted and ring_len % stride == 0 and granted < ring_len // stride:
            self.peer_stride, self.peer_slots = stride, ring_len // stride
            self.peer_granted = granted
            self.limit = <uint64_t>granted * stride
        self.part_end[0], self.part_rkey[0], self.n_parts = self.limit, rkey, 1

    cdef int offer(self) noexcept nogil:
        """Register the next part of my ring (twice what is granted), unless one is
        waiting to be sent; -1 if there is nothing to send or another thread is at
        it, else the index k of the grant word to post (words[k]), with the lock
        held until done()."""
        cdef uint32_t have = self.granted, new, k
        cdef uint64_t ln
        cdef ibv_mr *mr = NULL
        cdef ibv_mw *mw = NULL
        if not self.on or self.stopped or not rm_spin_trylock(&self.lock):
            return -1
        if self.pending == 0:
            if have >= self.slots:
                rm_spin_unlock(&self.lock)
                return -1
            new = min(self.slots, max(2 * have, have + 1))
            ln = <uint64_t>(new - have) * self.stride
            if self.n_mrs < MAX_PARTS and pin_charge(ln) == 0:
                mr = self.mem.dev.reg_mr(self.mem.pd,
                                         self.base + self.off + <uint64_t>have * self.stride,
                                         ln, self.mem.remote_flags(IBV_ACCESS_REMOTE_WRITE))
                if mr != NULL and self.mem.windows:
                    mw = self.mem.dev.alloc_mw(self.mem.pd)
                    if mw == NULL:
                        self.mem.dev.dereg_mr(mr)
                        mr = NULL
                if mr == NULL:
                    pin_refund(ln)
                else:
                    self.charged += ln
            if mr == NULL:              # past the budget: the ring stays as it is
                self.stopped = True
                rm_spin_unlock(&self.lock)
                return -1
            k = self.n_mrs
            self.mrs[k], self.mws[k] = mr, mw
            self.n_mrs = k + 1
            # the key of the window (bound with the grant word's WRITE), else the MR's
            self.words[k] = (<uint64_t>new << 32) | (
                ibv_inc_rkey(mw.rkey) if mw != NULL else mr.rkey)
            self.pending = new
        return self.n_mrs - 1

    cdef void done(self, bint posted) noexcept nogil:
        """After offer(): the word was posted (the peer may use the part) or not yet."""
        if posted:
            self.granted, self.pending = self.pending, 0
            self.given += 1
        rm_spin_unlock(&self.lock)

    cdef bint take(self, const char *ctrl) noexcept nogil:
        """Take the peer's new grant words from my control page ``ctrl`` (each read
        once, then checked: more slots than granted, no more than its ring). A bad
        one ends the taking: the peer only keeps itself short."""
        cdef uint64_t word
        cdef uint32_t slots
        cdef bint got = False
        if self.peer_granted == 0 or self.peer_bad:
            return False
        while self.n_parts < MAX_PARTS:
            word = rm_load_acquire64(<uint64_t *>(ctrl + GRANT_OFF) + (self.n_parts - 1))
            if word == 0:
                break
            slots = <uint32_t>(word >> 32)
            if slots <= self.peer_granted or slots > self.peer_slots:
                self.peer_bad = True
                break
            self.limit = <uint64_t>slots * self.peer_stride
            self.part_end[self.n_parts], self.part_rkey[self.n_parts] = self.limit, <uint32_t>word
            self.n_parts += 1
            self.taken += 1
            got = True
            if slots == self.peer_slots:
                self.peer_granted = 0       # all of it
                break
            self.peer_granted = slots
        return got

    def usage(self):
        """(MRs, bytes) registered here: the block's parts, the grant words."""
        cdef uint32_t i
        cdef size_t n = 0, nbytes = 0
        for i in range(self.n_mrs):
            n, nbytes = n + 1, nbytes + self.mrs[i].length
        for mr in (<size_t>self.head_mr, <size_t>self.words_mr):
            if mr:
                n, nbytes = n + 1, nbytes + (<ibv_mr *>mr).length
        return n, nbytes

    cdef void drop_windows(self) noexcept:
        """Free the windows: before the QP they are bound to is destroyed."""
        cdef uint32_t i
        if self.mem is None or self.mem.dev.inherited():
            return
        for i in range(self.n_mrs):
            if self.mws[i] != NULL:
                self.mem.dev.dealloc_mw(self.mws[i])
                self.mws[i] = NULL
        if self.head_mw != NULL:
            self.mem.dev.dealloc_mw(self.head_mw)
            self.head_mw = NULL

    cdef void release(self) noexcept:
        """Give the pins back and deregister (nothing in a fork child: the parent's)."""
        cdef uint32_t i
        pin_refund(self.charged)
        self.charged = 0
        if self.mem is None or self.mem.dev.inherited():
            self.n_mrs = 0
            self.words_mr = self.head_mr = NULL
            self.head_mw = NULL
            return
        self.drop_windows()             # first: an MR under a window stays
        for i in range(self.n_mrs):
            self.mem.dev.dereg_mr(self.mrs[i])
        self.n_mrs = 0
        if self.words_mr != NULL:
            self.mem.dev.dereg_mr(self.words_mr)
            self.words_mr = NULL
        if self.head_mr != NULL:
            self.mem.dev.dereg_mr(self.head_mr)
            self.head_mr = NULL

    def __dealloc__(self):
        self.release()
        free(self.words)
        if self.base != NULL:       # after the transport: Messages may point into it
            munmap(self.base, self.length)
