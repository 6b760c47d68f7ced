# cython: freethreading_compatible = False
"""Remote memory on verbs (docs/remote-memory.md, "What each provider does"): the
transport with user regions, VerbsRegions, a VerbsTransport whose post() takes the
region work requests of rdmamw/channel/_remote.pyx besides the engine's.

Exposing a region is a rendezvous exposure with the region's access: with memory
windows (the default) a type-2 window over the buffer's registration-cache MR (the
process's, on the one shared PD: a buffer exposed to N peers is registered once), bound
to this peer's QP with remote read and/or write; without windows an MR of the
endpoint's own PD with that access. The key the peer gets is the window's (or MR's)
rkey XORed with the region's tag, and the initiator XORs them back into the rkey it
posts: the device's key check covers both fields of the reference, so a reference with
a changed key or tag names no window (a forged one is refused by the owner's device).
Revoke deallocates the window (deregisters the MR): the device refuses every access
that begins after it returns.

A chain of region READs/WRITEs is one ibv_post_send (the send queue's chain bound,
``region_chain_max``, is half its depth), unsignaled but for its last WR, whose
completion the poster waits for (RC completes in order: then every WR of the chain has
completed, its READs landed and its WRITEs are placed in the owner's memory). A remote
access error (the owner's device refused: revoked, forged, outside the window, the
wrong access) fails the QP on both sides, as in every RC transport: the chain returns
RM_ERR_BOUNDS and the connection is lost.

Atomics (a region exposed "atomic": the window also has remote atomic access) are
RM_WR_FETCH_ADD / RM_WR_CMP_SWAP work requests on one aligned 64-bit word: the operand
(and the new value) are read from the local buffer when the WR is posted, and the
device writes the word's old value over its first 8 bytes."""

from libc.stdint cimport int64_t, uint32_t, uint64_t

from rdmamw.transport._base cimport (
    RM_ACCESS_TAG_SHIFT,
    RM_ERR_BOUNDS,
    RM_ERR_UNSUPPORTED,
    RM_WR_CMP_SWAP,
    RM_WR_EXPOSED,
    RM_WR_FETCH_ADD,
    RM_WR_READ,
    RM_WR_REGION,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    now_ns,
    rm_mem,
    rm_wr,
)
from rdmamw.transport.atomics cimport rm_cpu_relax, rm_spin_lock, rm_spin_unlock
from rdmamw.providers.verbs._ibverbs cimport (
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD,
    ibv_send_wr,
)
from rdmamw.providers.verbs._device cimport rmv_load64
from rdmamw.providers.verbs._qp cimport FAIL_SEND_WC, INTERNAL, QP_CONNECTED, VerbsQP
from rdmamw.providers.verbs._transport cimport VerbsTransport
from rdmamw.providers.verbs._sendq cimport _post_all

cdef extern from "<unistd.h>" nogil:
    int usleep(unsigned int usec)

cdef enum:
    WC_REM_ACCESS_ERR = 10      # IBV_WC_REM_ACCESS_ERR: the owner's device refused
    SPINS = 2000                # empty polls before the waiter sleeps between polls
    CHECK_NS = 1000000          # the peer's death is looked for this often


cdef class VerbsRegions(VerbsTransport):
    """A verbs endpoint with user regions (the provider's transport class)."""
    cdef uint64_t rid, peer_rid

    def _set_region_ids(self, uint64_t mine, uint64_t peers):
        """The identities region references carry: this endpoint's (random, never 0)
        and the peer's from its descriptor (0: a peer without regions)."""
        self.rid, self.peer_rid = mine, peers

    def region_ids(self):
        """(this endpoint's identity, the peer's): 0 for a peer without regions."""
        return self.rid, self.peer_rid

    def region_refusal(self, uint32_t key, uint32_t tag, uint64_t addr, uint64_t length,
                       bint write) -> int:
        """Why the owner refused a chain: its device says only that it did (a remote
        access error), not which rule: 4 (the device refused) for any operation. The
        bounds and access a reference states were checked before the post
        (rdmamw/channel/remote.py); what fails here is a revoked or forged one."""
        return 4

    @property
    def region_atomics(self) -> bool:
        """fetch_add / compare_swap on regions exposed "atomic" (RDMA atomics)."""
        return True

    @property
    def region_chain_max(self) -> int:
        """Work requests in one region chain at most (RemoteOps posts more as several):
        what one ibv_post_send of this QP takes."""
        return self.max_chain

    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil:
        cdef uint32_t tag = access >> RM_ACCESS_TAG_SHIFT
        cdef int rc = VerbsQP.expose(self, addr, length,
                                     access & ((1 << RM_ACCESS_TAG_SHIFT) - 1), out)
        if rc == 0 and tag:
            out.rkey ^= tag
        return rc

    cdef int expose_cached(self, uint64_t addr, uint64_t length, uint32_t access,
                           uint32_t lkey, uint32_t rkey, rm_mem *out) noexcept nogil:
        cdef uint32_t tag = access >> RM_ACCESS_TAG_SHIFT
        cdef int rc
        if tag and not self.mem.windows:    # the cache's MR itself: nothing to revoke
            out.handle = out.lkey = out.rkey = 0
            return RM_ERR_UNSUPPORTED
        rc = VerbsQP.expose_cached(self, addr, length,
                                   access & ((1 << RM_ACCESS_TAG_SHIFT) - 1), lkey, rkey,
                                   out)
        if rc == 0 and tag:
            out.rkey ^= tag
        return rc

    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        if n == 0 or not wrs[0].flags & RM_WR_REGION:
            return VerbsTransport.post(self, wrs, n)
        return self._post_region(wrs, n)

    cdef int _post_region(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        """Post a chain of region READs/WRITEs (each EXPOSED | REGION, rkey = the
        reference's key, imm = its tag, lkey = the local buffer's) as one chain with
        only its last WR signaled, and wait for that completion."""
        cdef uint32_t i
        cdef uint64_t target
        cdef int rc
        if self.state != QP_CONNECTED:
            return self._dead()
        for i in range(n):      # all or nothing: region READs, WRITEs and atomics
            if (wrs[i].flags & (RM_WR_EXPOSED | RM_WR_REGION)) != (RM_WR_EXPOSED |
                    RM_WR_REGION) or wrs[i].length == 0 or not _region_op(&wrs[i]):
                return RM_ERR_BOUNDS
        for i in range(n):
            wrs[i].rkey ^= wrs[i].imm       # the window's key (see the module doc)
            wrs[i].imm = 0
            wrs[i].wr_id = INTERNAL         # the engine never sees these completions
            wrs[i].flags = RM_WR_EXPOSED
        wrs[n - 1].flags = RM_WR_EXPOSED | RM_WR_SIGNALED
        rm_spin_lock(&self.lock)
        self.room_deadline = 0          # wait for room in the send queue, never queue
        rc = _post_all(self, wrs, n)
        target = self.sq_posted         # the last WR's position: its completion's
        rm_spin_unlock(&self.lock)
        if rc != 0:
            return rc
        return self._await_chain(target)

    cdef void _fill(self, uint32_t j, rm_wr *wr) noexcept nogil:
        cdef ibv_send_wr *w
        cdef uint64_t *operands
        VerbsTransport._fill(self, j, wr)
        if wr.opcode != RM_WR_FETCH_ADD and wr.opcode != RM_WR_CMP_SWAP:
            return
        w = &self.swr[j]        # the RDMA fields _fill set, as the atomic's
        operands = <uint64_t *>wr.local_addr
        w.opcode = (IBV_WR_ATOMIC_FETCH_AND_ADD if wr.opcode == RM_WR_FETCH_ADD
                    else IBV_WR_ATOMIC_CMP_AND_SWP)
        w.wr.atomic.compare_add = operands[0]
        w.wr.atomic.swap = operands[1] if wr.opcode == RM_WR_CMP_SWAP else 0
        w.wr.atomic.remote_addr = wr.remote_off
        w.wr.atomic.rkey = wr.rkey

    cdef int _await_chain(self, uint64_t target) noexcept nogil:
        """Until the send queue completed past ``target``: 0; RM_ERR_BOUNDS when the
        connection failed on a remote access error (the owner's device refused a
        region access); else the connection's error (the peer's death: its side
        channel, looked at every CHECK_NS)."""
        cdef uint32_t empty = 0
        cdef int64_t next_check = now_ns() + CHECK_NS
        while rmv_load64(&self.sq_done) < target and self.state == QP_CONNECTED:
            rm_spin_lock(&self.lock)
            if self._poll_send_locked() > 0:
                empty = 0
            else:
                empty += 1
            rm_spin_unlock(&self.lock)
            if empty == 0:
                continue
            if now_ns() >= next_check:
                self.peer_state()       # the side channel's EOF fails the connection
                next_check = now_ns() + CHECK_NS
            if empty > SPINS:
                usleep(20)              # a long transfer: let the CPU go between polls
            else:
                rm_cpu_relax()
        if rmv_load64(&self.sq_done) >= target:
            return 0
        if self.failure.kind == FAIL_SEND_WC and self.failure.status == WC_REM_ACCESS_ERR:
            return RM_ERR_BOUNDS
        return self._dead()


cdef inline bint _region_op(rm_wr *wr) noexcept nogil:
    """A region READ or WRITE, or an atomic on one aligned 64-bit word."""
    if wr.opcode == RM_WR_READ or wr.opcode == RM_WR_WRITE:
        return True
    return ((wr.opcode == RM_WR_FETCH_ADD or wr.opcode == RM_WR_CMP_SWAP)
            and wr.length == 8 and not wr.remote_off & 7)
