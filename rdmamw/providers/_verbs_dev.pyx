# cython: freethreading_compatible = False
"""The ``verbs`` provider's device resources (declared in _verbs_dev.pxd): the opened
device port with its protection domain, completion channel and CQs (VerbsDevice), and
the memory one transport registers on that PD (VerbsMemory: local MRs, the
registration caches' MRs, the exposure table of rendezvous). The queue pair and its
data path are _verbs.VerbsTransport's, which holds one of each.

Like _verbs, this extension never links libibverbs: _verbs.load() fills its table of
calls (load_table) from the library it loaded, before any device is opened."""

import cython

from libc.errno cimport errno
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport strerror

from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ERR_AGAIN,
    RM_ERR_OS,
    RM_ERR_UNSUPPORTED,
    current_pid,
    rm_mem,
)
from rdmamw.transport.atomics cimport rm_spin_lock, rm_spin_trylock, rm_spin_unlock
from rdmamw.providers._ibverbs cimport *

cdef extern from *:
    """
    #include <fcntl.h>
    static inline int rmv_set_nonblock(int fd) {
        int fl = fcntl(fd, F_GETFL);
        return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    }
    """
    int rmv_set_nonblock(int fd) nogil

cdef enum:
    ACK_EVERY = 16          # CQ events taken before ibv_ack_cq_events


cdef int load_table(const char *lib, char *err, size_t errlen) noexcept:
    return rm_ibv_load(lib, err, errlen)      # 0 at once when loaded


@cython.final
@cython.no_gc           # no cycle through it (a bytes attribute)
cdef class VerbsDevice:
    """An opened device port: context, PD, completion channel, a send CQ and a
    receive CQ (whose events the channel carries)."""

    def __cinit__(self):
        self.pid_now = current_pid()
        self.owner_pid = self.pid_now[0]
        self.fd = -1

    def __init__(self, str dev_name, int port, int gid_index, uint32_t sq_depth,
                 uint32_t rq_depth):
        """Open ``dev_name``, check the port is active and read its GID, then allocate
        the PD, the channel and CQs for queues of these depths (cut to the device's
        limit, at least 8: ``sq_depth``, ``rq_depth``). OSError saying what failed."""
        cdef int num = 0, i
        cdef ibv_device **lst
        cdef ibv_device_attr dattr
        cdef ibv_port_attr pattr
        cdef ibv_gid gid
        if self.ctx != NULL:
            raise ValueError("the device is open already")
        if not rm_ibv_loaded():     # its calls would be NULL pointers
            raise OSError(2, "libibverbs is not loaded here (rdmamw.providers._verbs.load())")
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
        if ibv_query_device(self.ctx, &dattr) or ibv_query_port(self.ctx, port, &pattr):
            raise OSError(errno, f"cannot query {dev_name} port {port}")
        if pattr.state != IBV_PORT_ACTIVE:
            raise OSError(100, f"{dev_name} port {port} is not active (state {pattr.state})")
        if ibv_query_gid(self.ctx, port, gid_index, &gid):
            raise OSError(errno, f"cannot read GID {gid_index} of {dev_name} port {port}")
        self.port, self.gid_index, self.gid = port, gid_index, bytes(gid.raw[:16])
        self.lid, self.mtu = pattr.lid, pattr.active_mtu
        self.sq_depth = max(8, min(sq_depth, <uint32_t>dattr.max_qp_wr))
        self.rq_depth = max(8, min(rq_depth, <uint32_t>dattr.max_qp_wr))
        self.pd = ibv_alloc_pd(self.ctx)
        if self.pd == NULL:
            raise OSError(errno, "ibv_alloc_pd failed")
        self.chan = ibv_create_comp_channel(self.ctx)
        if self.chan == NULL or rmv_set_nonblock(self.chan.fd) < 0:
            raise OSError(errno, "ibv_create_comp_channel failed")
        self.fd = self.chan.fd
        self.scq = ibv_create_cq(self.ctx, self.sq_depth + 16, NULL, NULL, 0)
        self.rcq = ibv_create_cq(self.ctx, self.rq_depth + 16, NULL, self.chan, 0)
        if self.scq == NULL or self.rcq == NULL:
            raise OSError(errno, "ibv_create_cq failed")

    cdef void take_events(self) noexcept nogil:
        """Take the receive CQ's events off the channel (a thread already at it does
        the work); acknowledge them in batches."""
        cdef ibv_cq *cq
        cdef void *ctx
        if not rm_spin_trylock(&self.elock):
            return
        while ibv_get_cq_event(self.chan, &cq, &ctx) == 0:     # non-blocking fd
            self.unacked_events += 1
        if self.unacked_events >= ACK_EVERY:
            ibv_ack_cq_events(self.rcq, self.unacked_events)
            self.unacked_events = 0
        rm_spin_unlock(&self.elock)

    cdef void arm(self) noexcept nogil:
        """Ask for an event on the channel at the receive CQ's next completion."""
        ibv_req_notify_cq(self.rcq, 0)

    cdef void close(self) noexcept:
        """Destroy the CQs, the channel and the PD and close the device (their users,
        the QP and the MRs, are gone); nothing in a fork child, where they are the
        parent's."""
        if self.inherited():
            return
        if self.rcq != NULL:
            if self.unacked_events:
                ibv_ack_cq_events(self.rcq, self.unacked_events)
                self.unacked_events = 0
            ibv_destroy_cq(self.rcq)
            self.rcq = NULL
        if self.scq != NULL:
            ibv_destroy_cq(self.scq)
            self.scq = NULL
        if self.chan != NULL:
            ibv_destroy_comp_channel(self.chan)
            self.chan = NULL
            self.fd = -1
        if self.pd != NULL:
            ibv_dealloc_pd(self.pd)
            self.pd = NULL
        if self.ctx != NULL:
            ibv_close_device(self.ctx)
            self.ctx = NULL

    def __dealloc__(self):
        self.close()


@cython.final
@cython.no_gc_clear     # __dealloc__ deregisters through dev (before the PD goes)
cdef class VerbsMemory:
    """The MRs one transport registers on its device's PD: local ones, the
    registration caches', and one per exposed range (the NIC then refuses any remote
    access outside it or without the right). All live until deregistered or until
    the transport dies."""

    def __cinit__(self, VerbsDevice dev not None):
        if dev.pd == NULL:
            raise ValueError("the device is not open")
        self.dev = dev
        self.cached_mrs = {}

    def register_local(self, size_t addr, size_t length):
        """Register [addr, addr+length) for local access only (WR sources, READ
        targets); the MR lives as long as the transport. Its lkey."""
        cdef ibv_mr *mr
        cdef void *p
        mr = ibv_reg_mr(self.dev.pd, <void *>addr, length, IBV_ACCESS_LOCAL_WRITE)
        if mr == NULL:
            raise OSError(errno, f"ibv_reg_mr of {length} bytes failed")
        p = realloc(self.lmrs, (self.n_lmrs + 1) * sizeof(ibv_mr *))
        if p == NULL:
            ibv_dereg_mr(mr)
            raise MemoryError()
        self.lmrs = <ibv_mr **>p
        self.lmrs[self.n_lmrs] = mr
        self.n_lmrs += 1
        return mr.lkey

    def mr_register(self, size_t addr, size_t length, bint remote_read):
        """An MR for a registration cache: ``(mr, lkey, rkey)``."""
        cdef ibv_mr *mr
        cdef int flags = IBV_ACCESS_LOCAL_WRITE | (IBV_ACCESS_REMOTE_READ if remote_read else 0)
        with nogil:
            mr = ibv_reg_mr(self.dev.pd, <void *>addr, length, flags)
        if mr == NULL:
            raise OSError(errno, f"ibv_reg_mr of {length} bytes failed: {strerror(errno).decode()}")
        self.cached_mrs[<size_t>mr] = None
        return (<size_t>mr, mr.lkey, mr.rkey)

    def mr_deregister(self, handle):
        """Deregister an MR of mr_register (nothing in a fork child: it is the
        parent's, same uverbs file)."""
        cdef size_t p = handle[0]
        if self.dev.inherited():
            return
        if self.cached_mrs.pop(p, 0) is None:
            with nogil:
                ibv_dereg_mr(<ibv_mr *>p)

    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil:
        """Register the range with the access asked for, in a free slot of the table."""
        cdef int flags = IBV_ACCESS_LOCAL_WRITE
        cdef uint32_t i, k
        cdef ibv_mr *mr
        out.handle = out.lkey = out.rkey = 0
        if access == RM_ACCESS_REMOTE_READ:
            flags |= IBV_ACCESS_REMOTE_READ
        elif access == RM_ACCESS_REMOTE_WRITE:
            flags |= IBV_ACCESS_REMOTE_WRITE
        elif access != RM_ACCESS_LOCAL:
            return RM_ERR_UNSUPPORTED
        rm_spin_lock(&self.xlock)
        for k in range(XMR_N):
            i = (self.xmr_hint + k) % XMR_N
            if self.xmrs[i] == NULL:
                self.xmrs[i] = XMR_BUSY
                self.xmr_hint = (i + 1) % XMR_N
                break
        else:
            rm_spin_unlock(&self.xlock)
            return RM_ERR_AGAIN
        rm_spin_unlock(&self.xlock)
        mr = ibv_reg_mr(self.dev.pd, <void *>addr, length, flags)
        rm_spin_lock(&self.xlock)
        self.xmrs[i] = mr           # NULL (failed) frees the slot again
        rm_spin_unlock(&self.xlock)
        if mr == NULL:
            return RM_ERR_OS
        out.handle = i + 1
        out.lkey = mr.lkey
        out.rkey = mr.rkey
        return 0

    cdef int unexpose(self, uint32_t handle) noexcept nogil:
        cdef ibv_mr *mr = NULL
        if self.dev.inherited():
            return 0        # a fork child: the MR is the parent's (same uverbs file)
        if 0 < handle <= XMR_N:
            rm_spin_lock(&self.xlock)
            mr = self.xmrs[handle - 1]
            if mr == XMR_BUSY:
                mr = NULL               # not a handle anyone was given yet
            else:
                self.xmrs[handle - 1] = NULL
            rm_spin_unlock(&self.xlock)
        if mr != NULL:
            ibv_dereg_mr(mr)
        return 0

    cdef void release(self) noexcept:
        """Deregister every MR (before the PD goes); nothing in a fork child."""
        cdef uint32_t i
        if self.dev is None or self.dev.inherited():
            return
        for i in range(self.n_lmrs):
            ibv_dereg_mr(self.lmrs[i])
        self.n_lmrs = 0
        if self.cached_mrs:
            for p in self.cached_mrs:
                ibv_dereg_mr(<ibv_mr *><size_t>p)
            self.cached_mrs.clear()
        for i in range(XMR_N):
            if self.xmrs[i] != NULL and self.xmrs[i] != XMR_BUSY:
                ibv_dereg_mr(self.xmrs[i])
            self.xmrs[i] = NULL

    def __dealloc__(self):
        self.release()
        free(self.lmrs)
