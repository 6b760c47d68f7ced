# cython: freethreading_compatible = False
"""The ``verbs`` provider's registrations (declared in _memory.pxd): the protection
domain of one endpoint with what it registers there (VerbsMemory: local MRs, the
registration caches' MRs, the exposure table of rendezvous), and the process's
pinned-memory budget that every registration is charged to (the block's too:
_block.pyx). The windows are bound on the QP by _qp and _transport."""

import os
import threading

import cython

from libc.errno cimport errno
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport strerror

from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_ATOMIC,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_OS,
    RM_ERR_UNSUPPORTED,
    rm_mem,
)
from rdmamw.errors import RegistrationError

from rdmamw.transport.atomics cimport rm_spin_lock, rm_spin_unlock
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._lib cimport also_load
from rdmamw.providers.verbs._device cimport (
    XMR_BUSY,
    VerbsDevice,
    rmv_add32,
    rmv_add64,
    rmv_cas64,
    rmv_load64,
)



cdef int _fill_table(const char *lib, char *err, size_t errlen) noexcept:
    return rm_ibv_load(lib, err, errlen)      # 0 at once when loaded


also_load(_fill_table)


cdef uint64_t _pinned = 0          # bytes charged now, by every endpoint of the process
cdef uint64_t _budget = 0          # set by set_pinned_budget before the first device


cdef int ibv_remote(uint32_t access) noexcept nogil:
    """IBV_ACCESS_REMOTE_* of RM_ACCESS_REMOTE_* bits."""
    return ((IBV_ACCESS_REMOTE_READ if access & RM_ACCESS_REMOTE_READ else 0)
            | (IBV_ACCESS_REMOTE_WRITE if access & RM_ACCESS_REMOTE_WRITE else 0)
            | (IBV_ACCESS_REMOTE_ATOMIC if access & RM_ACCESS_REMOTE_ATOMIC else 0))


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
    """The process's budget of registered bytes (probe.pinned_budget())."""
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


_PD_LOCK = threading.Lock()     # two handshakes at once must not make two shared PDs


def _new_lock_in_child():
    global _PD_LOCK
    _PD_LOCK = threading.Lock()     # a thread of the parent may have held it at fork


os.register_at_fork(after_in_child=_new_lock_in_child)


def endpoint_memory(VerbsDevice dev not None, bint windows):
    """The VerbsMemory of a new endpoint: with windows on the process's one PD
    (made on first use, with ``shared_memory``: the registration caches' owner),
    else on a PD of its own."""
    if not windows:
        return VerbsMemory(dev, False)
    with _PD_LOCK:
        if dev.pd == NULL:
            dev.pd = ibv_alloc_pd(dev.ctx)
            if dev.pd == NULL:
                raise OSError(errno, f"ibv_alloc_pd failed ({strerror(errno).decode()})")
            dev.n_pds += 1
            dev.shared_memory = VerbsMemory(dev, True)
    return VerbsMemory(dev, True)




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
                raise ValueError("the device's PD is made by endpoint_memory()")
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
        if access & ~(RM_ACCESS_REMOTE_READ | RM_ACCESS_REMOTE_WRITE
                      | RM_ACCESS_REMOTE_ATOMIC):
            return RM_ERR_UNSUPPORTED
        if access != RM_ACCESS_LOCAL:       # read, write, or both (a user region)
            flags = self.remote_flags(ibv_remote(access))
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
