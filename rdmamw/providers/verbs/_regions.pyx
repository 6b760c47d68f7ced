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
that begins after it returns; then, as a WRITE it had accepted is checked at its first
packet only, it READs the peer's region chain words (its last chain posted, its last
completed: CTRL_RPOSTED, CTRL_RDONE, kept by each endpoint for its own chains) until
the chains posted before have completed (_fence).

A chain of region READs/WRITEs is one ibv_post_send (the send queue's chain bound,
``region_chain_max``, is half its depth), unsignaled but for its last WR, whose
completion the poster waits for (RC completes in order: then every WR of the chain has
completed, its READs landed and its WRITEs are placed in the owner's memory). A remote
access error (the owner's device refused: revoked, forged, outside the window, the
wrong access) fails the QP on both sides, as in every RC transport: the chain returns
RM_ERR_BOUNDS and the connection is lost. A chain that does not complete (its
deadline passed, the connection failed or was closed) halts the QP (the error state:
the device stops) and waits for the chain's flush before its caller gets the error,
so no READ target is written after the call returned.

Atomics (a region exposed "atomic": the window also has remote atomic access) are
RM_WR_FETCH_ADD / RM_WR_CMP_SWAP work requests on one aligned 64-bit word: the operand
(and the new value) are read from the local buffer when the WR is posted, and the
device writes the word's old value over its first 8 bytes.

A chain runs in its order: the WRs its order needs fenced carry IBV_SEND_FENCE
(_fence.pxd says which and why)."""

from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memset

from rdmamw.transport._base cimport (
    RM_ACCESS_TAG_SHIFT,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_LATE,
    RM_ERR_PEER_LOST,
    RM_ERR_UNSUPPORTED,
    RM_REGION_CTRL,
    RM_WR_CMP_SWAP,
    RM_WR_EXPOSED,
    RM_WR_FENCE,
    RM_WR_FETCH_ADD,
    RM_WR_READ,
    RM_WR_REGION,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    now_ns,
    pthread_self,
    rm_mem,
    rm_wr,
)
from rdmamw.transport.atomics cimport (
    rm_cpu_relax,
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_trylock,
    rm_spin_unlock,
    rm_store_release64,
)
from rdmamw.providers.verbs._ibverbs cimport (
    IBV_QP_STATE,
    IBV_QPS_ERR,
    IBV_SEND_FENCE,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_SUCCESS,
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD,
    ibv_modify_qp,
    ibv_qp_attr,
    ibv_send_wr,
    rm_ibv_load,
)
from rdmamw.providers.verbs._fence cimport chain_fences
from rdmamw.providers.verbs._lib cimport also_load
from rdmamw.providers.verbs._device cimport rmv_load64
from rdmamw.providers.verbs._memory cimport XMR_N
from rdmamw.providers.verbs._qp cimport (
    FAIL_OTHER,
    FAIL_SEND_WC,
    INTERNAL,
    QP_CONNECTED,
    STUCK_NS,
    VerbsQP,
)
from rdmamw.providers.verbs._transport cimport VerbsTransport
from rdmamw.providers.verbs._sendq cimport _post_all

cdef extern from "<unistd.h>" nogil:
    int usleep(unsigned int usec)


cdef int _fill_table(const char *lib, char *err, size_t errlen) noexcept:
    return rm_ibv_load(lib, err, errlen)      # this module's copy of the table (_halt)


also_load(_fill_table)

cdef enum:
    SPINS = 2000                # empty polls before the waiter sleeps between polls
    CHECK_NS = 1000000          # the peer's death is looked for this often
    FLUSH_NS = 1000000000       # a halted QP flushes a chain within this (else: given up)
    REFUSAL_NS = 500000000      # a chain's refusal may come this long after the owner's EOF
    # control-page words (index x 8 bytes; docs/protocol.md, "Region chain words"):
    CTRL_RPOSTED = 232          # the last region chain this endpoint posted (its number)
    CTRL_RDONE = 233            # the last one that completed (chains complete in order)
    CTRL_RFENCE = 240           # where the owner's revoke READs the peer's two words to

cdef uint64_t SEQ_MASK = ~INTERNAL  # a chain's last WR: wr_id INTERNAL | its number


cdef class VerbsRegions(VerbsTransport):
    """A verbs endpoint with user regions (the provider's transport class)."""
    cdef uint64_t rid, peer_rid
    cdef uint64_t rseq              # region chains posted (lock)
    cdef uint64_t rflushed          # the highest chain number that ended in error
    cdef int fence_lock             # one revoke's READs at a time
    cdef bint halted                # the QP was moved to the error state
    cdef bint rhandle[XMR_N]        # exposure handles that are regions (revoke fences)

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
            self._mark_region(out.handle)
        return rc

    cdef inline void _mark_region(self, uint32_t handle) noexcept nogil:
        if 0 < handle <= XMR_N:
            self.rhandle[handle - 1] = True

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
            self._mark_region(out.handle)
        return rc

    cdef int unexpose(self, uint32_t handle) noexcept nogil:
        """Free the exposure; a region's revoke then waits until no request the peer
        posted before can still land (_fence): RM_ERR_AGAIN if its chains did not end
        within STUCK_NS (a stopped peer)."""
        cdef bint region = 0 < handle <= XMR_N and self.rhandle[handle - 1]
        cdef int rc
        if region:
            self.rhandle[handle - 1] = False
        rc = VerbsQP.unexpose(self, handle)
        if rc != 0 or not region or self.peer_rid == 0 or self.inherited():
            return rc
        return self._fence()

    cdef int _fence(self) noexcept nogil:
        """After the window is gone (its key refused from now on): READ the peer's
        region chain words (CTRL_RPOSTED, CTRL_RDONE) until the chains it had posted
        when the first READ arrived have all ended. A chain the device accepted before
        the window went was posted before, and the peer stores its number before the
        doorbell, so the first READ sees it. 0; RM_ERR_AGAIN past STUCK_NS. A
        connection that fails meanwhile: the QP is halted (its device executes no
        request of the peer any more) and 0."""
        cdef int64_t end = now_ns() + STUCK_NS
        cdef uint64_t *got = <uint64_t *>(self.local[RM_REGION_CTRL].addr + 8 * CTRL_RFENCE)
        cdef uint64_t want = 0
        cdef bint first = True
        cdef rm_wr wr
        cdef int rc
        while not rm_spin_trylock(&self.fence_lock):
            if now_ns() >= end:
                return RM_ERR_AGAIN
            usleep(50)
        while True:
            if self.state != QP_CONNECTED:
                self._halt()
                rc = 0
                break
            memset(&wr, 0, sizeof(wr))
            wr.wr_id = INTERNAL
            wr.local_addr = <uint64_t>got
            wr.lkey = self.block.head_mr.lkey
            wr.remote_off = self.peer_addr[RM_REGION_CTRL] + 8 * CTRL_RPOSTED
            wr.rkey = self.peer_rkey
            wr.length = 16
            wr.opcode = RM_WR_READ
            wr.flags = RM_WR_EXPOSED | RM_WR_SIGNALED
            got[0] = got[1] = 0
            if self._post_wait(&wr, 1, 0, end) != 0:   # the connection failed (halted)
                self._halt()
                rc = 0
                break
            if first:
                want, first = rm_load_acquire64(&got[0]), False
            if rm_load_acquire64(&got[1]) >= want:
                rc = 0
                break
            if now_ns() >= end:
                rc = RM_ERR_AGAIN
                break
            usleep(100)
        rm_spin_unlock(&self.fence_lock)
        return rc

    cdef void _halt(self) noexcept nogil:
        """Move the QP to the error state: its device posts nothing more of ours and
        executes no request of the peer's; the connection is lost (a timed-out chain,
        a connection found dead by a revoke)."""
        cdef ibv_qp_attr at
        if not self.halted and self.qp != NULL and not self.inherited():
            memset(&at, 0, sizeof(at))
            at.qp_state = IBV_QPS_ERR
            ibv_modify_qp(self.qp, &at, IBV_QP_STATE)
            self.halted = True
        self._fail(RM_ERR_PEER_LOST, FAIL_OTHER)

    cdef int _poll_send_locked(self) noexcept nogil:
        """VerbsTransport's, noting the highest region chain that ended in error (its
        last WR's completion carries the chain's number)."""
        cdef int k = VerbsTransport._poll_send_locked(self), i
        cdef uint64_t seq
        for i in range(k):
            if self.wcb[i].status != IBV_WC_SUCCESS:
                seq = self.wcb[i].wr_id & SEQ_MASK
                if self.wcb[i].wr_id & INTERNAL and seq > self.rflushed:
                    self.rflushed = seq
        return k

    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        if n == 0 or not wrs[0].flags & RM_WR_REGION:
            return VerbsTransport.post(self, wrs, n)
        return self._post_region(wrs, n)

    cdef int _post_region(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        """Post a chain of region READs/WRITEs/atomics (each EXPOSED | REGION, rkey =
        the reference's key, imm = its tag, lkey = the local buffer's) as one chain
        with only its last WR signaled, fenced where its order needs it, and wait for
        that completion."""
        cdef uint32_t i
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
        chain_fences(wrs, n)                # the chain's order (the module doc)
        wrs[n - 1].flags |= RM_WR_SIGNALED
        return self._post_wait(wrs, n, 1, self.post_deadline
                               if self.post_owner == pthread_self() else 0)

    cdef int _post_wait(self, rm_wr *wrs, uint32_t n, bint chain,
                        int64_t deadline) noexcept nogil:
        """Post ``wrs`` (a region chain when ``chain``: numbered, its number stored in
        CTRL_RPOSTED before the doorbell and in CTRL_RDONE once it completed) and wait
        for its last WR: _await_chain's code."""
        cdef uint64_t target, seq = 0
        cdef uint64_t *ctrl = <uint64_t *>self.local[RM_REGION_CTRL].addr
        cdef int rc
        rm_spin_lock(&self.lock)
        self.room_deadline = 0          # wait for room in the send queue, never queue
        if chain:
            self.rseq += 1
            seq = self.rseq
            wrs[n - 1].wr_id = INTERNAL | seq
            rm_store_release64(&ctrl[CTRL_RPOSTED], seq)
        rc = _post_all(self, wrs, n)
        target = self.sq_posted         # the last WR's position: its completion's
        rm_spin_unlock(&self.lock)
        if rc != 0:                     # the chain may be in part posted: stop it
            self._halt()
            seq = 0
        else:
            rc = self._await_chain(target, seq, deadline)
        if rc == 0 and seq:
            rm_spin_lock(&self.lock)
            if rm_load_acquire64(&ctrl[CTRL_RDONE]) < seq:
                rm_store_release64(&ctrl[CTRL_RDONE], seq)
            rm_spin_unlock(&self.lock)
        return rc

    cdef void _fill(self, uint32_t j, rm_wr *wr) noexcept nogil:
        cdef ibv_send_wr *w
        cdef uint64_t *operands
        VerbsTransport._fill(self, j, wr)
        w = &self.swr[j]        # the RDMA fields _fill set, as the atomic's
        if wr.flags & RM_WR_FENCE:
            w.send_flags |= IBV_SEND_FENCE
        if wr.opcode != RM_WR_FETCH_ADD and wr.opcode != RM_WR_CMP_SWAP:
            return
        operands = <uint64_t *>wr.local_addr
        w.opcode = (IBV_WR_ATOMIC_FETCH_AND_ADD if wr.opcode == RM_WR_FETCH_ADD
                    else IBV_WR_ATOMIC_CMP_AND_SWP)
        w.wr.atomic.compare_add = operands[0]
        w.wr.atomic.swap = operands[1] if wr.opcode == RM_WR_CMP_SWAP else 0
        w.wr.atomic.remote_addr = wr.remote_off
        w.wr.atomic.rkey = wr.rkey

    cdef int _await_chain(self, uint64_t target, uint64_t seq,
                          int64_t deadline) noexcept nogil:
        """Until the send queue completed past ``target``: 0. Else the chain did not
        complete: the connection failed (the peer's death: its side channel, looked at
        every CHECK_NS; a remote access error: the owner's device refused a region
        access, RM_ERR_BOUNDS) or ``deadline`` passed (RM_ERR_LATE). Then the QP is
        halted and the chain's flush (chain ``seq``'s last WR completing in error)
        awaited for FLUSH_NS before returning, so the device writes no READ target
        after the caller got its error. A connection that failed otherwise than by a
        completion (the owner's EOF: its device refusing our access fails its QP, and
        its close may reach us before the refusal's NAK) first awaits the chain's own
        end for REFUSAL_NS, unhalted: a refusal is told as one, not as a loss."""
        cdef uint32_t empty = 0
        cdef int64_t next_check = now_ns() + CHECK_NS
        cdef bint late = False
        while rmv_load64(&self.sq_done) < target and self.state == QP_CONNECTED:
            rm_spin_lock(&self.lock)
            if self._poll_send_locked() > 0:
                empty = 0
            else:
                empty += 1
            rm_spin_unlock(&self.lock)
            if deadline and now_ns() >= deadline:   # (a chunked READ completes pieces
                late = True                         # all along: looked at every turn)
                break
            if empty == 0:
                continue
            if now_ns() >= next_check:
                self.peer_state()       # the side channel's EOF fails the connection
                next_check = now_ns() + CHECK_NS
            if empty > SPINS:
                usleep(20)              # a long transfer: let the CPU go between polls
            else:
                rm_cpu_relax()
        if rmv_load64(&self.sq_done) >= target and not late:
            return 0
        if not late and seq and self.failure.kind != FAIL_SEND_WC:
            self._await_flush(target, seq, REFUSAL_NS)
            if rmv_load64(&self.sq_done) >= target:
                return 0
        self._halt()
        if seq:                         # (a fence READ's target is our own block)
            self._await_flush(target, seq, FLUSH_NS)
        if late:
            return RM_ERR_LATE
        if self.failure.kind == FAIL_SEND_WC and self.failure.status == IBV_WC_REM_ACCESS_ERR:
            return RM_ERR_BOUNDS
        return self._dead()

    cdef void _await_flush(self, uint64_t target, uint64_t seq, int64_t ns) noexcept nogil:
        """Until the chain ended: its last WR completed (``target``), or completed in
        error (chain ``seq``), or the QP is gone; ``ns`` at most."""
        cdef int64_t end = now_ns() + ns
        while (rmv_load64(&self.sq_done) < target and self.rflushed < seq
               and self.joined and now_ns() < end):
            rm_spin_lock(&self.lock)
            if self._poll_send_locked() == 0:
                rm_spin_unlock(&self.lock)
                usleep(20)
            else:
                rm_spin_unlock(&self.lock)


cdef inline bint _region_op(rm_wr *wr) noexcept nogil:
    """A region READ or WRITE, or an atomic on one aligned 64-bit word."""
    if wr.opcode == RM_WR_READ or wr.opcode == RM_WR_WRITE:
        return True
    return ((wr.opcode == RM_WR_FETCH_ADD or wr.opcode == RM_WR_CMP_SWAP)
            and wr.length == 8 and not wr.remote_off & 7)
