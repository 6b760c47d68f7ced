# cython: freethreading_compatible = False
"""Eager send: planned slots become ONE chained list of work requests (one doorbell):
the slot writes, then the arrival-bitmap words that changed, last; only the last
request is signaled (docs/protocol.md)."""

cimport cython
from libc.stdint cimport uint8_t, uint16_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy

import logging

from rdmamw.engine._frames cimport (
    CTRL_RX_SLEEP,
    DESC_BYTES,
    HDR_BYTES,
    REC_HDR,
    SLOT_HEADER,
    SLOT_PACKED,
    SLOT_SINGLE,
    WAIT_ENTRY,
    WAIT_SLOTS,
    pad8,
    rm_slot_hdr,
)
from rdmamw.transport._base cimport (
    RM_ERR_LATE,
    RM_REGION_ARRIVAL,
    RM_REGION_RING,
    RM_WR_INLINE,
    RM_WR_PUBLISH,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    now_ns,
)
from rdmamw.transport.atomics cimport (
    rm_copy,
    rm_cpu_relax,
    rm_fence_seq_cst,
    rm_load_acquire64,
)

from rdmamw.transport import layout

log = logging.getLogger("rdmamw.engine")

cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

cdef uint64_t SNAP_DEPTH = 16           # arrival-word snapshots in flight (async transports)


@cython.final
cdef class EagerSender:
    """The sending half of the slot ring: the peer's ring, mirrored in staging."""

    def __cinit__(self, Link link, SendBatch batch, RndvSender rs, uint32_t peer_nslots,
                  uint32_t peer_slot_size, reclaim):
        cdef void *mem = NULL
        self.link, self.batch, self.rs = link, batch, rs
        self.peer_nslots, self.peer_slot_size = peer_nslots, peer_slot_size
        self.peer_stride = layout.slot_stride(peer_slot_size)
        # a ring that grows: the peer has granted part of its ring so far
        self.sbm = SendBitmaps(peer_nslots, reclaim, min(peer_nslots, link.peer_granted()))
        if posix_memalign(&mem, 4096, <size_t>peer_nslots * self.peer_stride) != 0:
            raise MemoryError()
        self.staging = <char *>mem
        self.alloc_tmp = <uint32_t *>malloc(4 * peer_nslots)
        if self.alloc_tmp == NULL:
            raise MemoryError()
        # everything a work request may read from must be known to the transport: the
        # staging copy of the slots granted (untouched pages past them cost nothing)
        self.stage(self.sbm.usable)
        self.lkey_arrival = link.register_local(<size_t>self.sbm.arrival, self.sbm.nwords * 8)
        if not link.synchronous():
            self.snap = <uint64_t *>calloc(SNAP_DEPTH * self.sbm.nwords, 8)
            if self.snap == NULL:
                raise MemoryError()
            self.lkey_snap = link.register_local(<size_t>self.snap,
                                                 SNAP_DEPTH * self.sbm.nwords * 8)
        self.grow(64)

    def __dealloc__(self):
        free(self.staging); free(self.alloc_tmp); free(self.wrs); free(self.snap)

    cdef int _grow(self, uint32_t n) except -1:
        """grow(): the chain reallocated."""
        cdef uint32_t c = 2 * n + 4
        cdef void *p
        c = max(c, 2 * self.wr_cap)     # amortised: a growing batch size reallocates rarely
        p = realloc(self.wrs, c * sizeof(rm_wr))
        if p == NULL:
            raise MemoryError()
        self.wrs = <rm_wr *>p
        self.wr_cap = c
        return 0

    cdef uint32_t post_planned(self, uint32_t k, uint32_t nplan, int *rc) noexcept nogil:
        """Post planned slots from k on while free slots (and rendezvous entries)
        last; return the new k. When it stops short, ``blocked_on`` says on what."""
        cdef uint32_t got, want
        rc[0] = 0
        self.blocked_on = WAIT_SLOTS
        while k < nplan:
            want = 1 if self.batch.ack else nplan - k
            if self.rs.prep_i < self.batch.plan_start[k + want]:
                want = self.rs.prepare(k, want, rc)
                if rc[0] != 0:
                    break
                if want == 0:
                    self.blocked_on = WAIT_ENTRY
                    break
            got = self.alloc(want)
            if got < want and self.sbm.usable < self.peer_nslots:
                self.ask_for(k, got, nplan)
            if got == 0:
                break
            rc[0] = self.post_slots(k, got)
            if rm_trace_on(self.link.trace):    # (here, not in post_slots: k and got are
                self.doorbell(k, got, nplan, rc[0])     # live here anyway)
            if rc[0] != 0:
                if rc[0] == RM_ERR_LATE:    # accepted (queued), past the deadline
                    k += got
                break
            k += got
        return k

    cdef uint32_t alloc(self, uint32_t want) noexcept nogil:
        """Take up to ``want`` free peer slots (in alloc_tmp); how many. Short of
        slots, a ring that grows looks for the peer's next grant first."""
        cdef uint32_t got = self.sbm.alloc(want, self.alloc_tmp)
        if got < want and self.take_grant():
            got += self.sbm.alloc(want - got, self.alloc_tmp + got)
        return got

    cdef void ask_for(self, uint32_t k, uint32_t got, uint32_t nplan) noexcept nogil:
        """Short of the slots a ring that grows has granted, at planned slot ``k`` of
        ``nplan`` with ``got`` more in hand: what to ask the peer for in one grant
        (``ask``, sent with the credit flag; docs/protocol.md "Rings that grow"). Slots
        of earlier sends the peer still holds mean it reads slower than we send: the
        whole ring; else what this send needs, all of it. A send needing more than
        the whole ring goes in parts as slots come back."""
        cdef uint32_t held = self.sbm.usable - got
        if held > k:        # (this send's own k slots may be held too)
            self.ask = self.peer_nslots
        else:
            self.ask = min(self.peer_nslots, nplan)

    cdef bint take_grant(self) noexcept nogil:
        """The peer granted more of its ring: stage the new slots and use them."""
        cdef uint32_t n
        if self.sbm.usable >= self.peer_nslots or self.grow_failed:
            return False
        self.link.take_grant()
        n = min(self.peer_nslots, self.link.peer_granted())
        if n <= self.sbm.usable:
            return False
        return self.use_grant(n)

    cdef bint use_grant(self, uint32_t n) noexcept with gil:
        """Stage the slots up to ``n`` and use them (the GIL only here: a function with
        Python objects in it takes the GIL at every exit, so the hot path has none)."""
        try:
            self.stage(n)
            self.sbm.set_usable(n)
        except Exception as e:          # no room to register: go on with what we have
            self.grow_failed = True
            log.warning("%s: the peer granted %d ring slots; staging them failed "
                        "(%s): sending on %d", self.link.peer, n, e, self.sbm.usable)
            return False
        return True

    cdef int stage(self, uint32_t n) except -1:
        """Register the staging of slots [part_end[last], n) as a new part."""
        cdef uint32_t start = self.part_end[self.nparts - 1] if self.nparts else 0
        if n <= start:
            return 0
        if self.nparts == MAX_PARTS:
            raise ValueError(f"a ring of more than {MAX_PARTS} parts")
        self.part_lkey[self.nparts] = self.link.register_local(
            <size_t>self.staging + <size_t>start * self.peer_stride,
            <size_t>(n - start) * self.peer_stride)
        self.part_end[self.nparts] = n
        self.nparts += 1
        return 0

    cdef int send_one(self, const char *p, uint32_t L) noexcept nogil:
        """A batch of one eager message that takes_one(): no plan, its SINGLE slot (the
        header, the payload copied behind it) and the arrival word as one unsignaled
        chain; post() executed it when it returns (a synchronous transport), so it is
        complete there (Link.completed_in_post), with no completion queued and reaped.
        1: posted; 0: not sent (no free slot: the general path waits for one; or an
        earlier chain not completed yet); else the post's error. The caller holds the
        send lock (no chain is posted meanwhile)."""
        cdef uint32_t slot, nw
        cdef char *st
        cdef rm_slot_hdr *h
        cdef rm_wr *wr = self.wrs
        cdef int rc
        if self.link.batch_done != self.link.batch_posted or self.alloc(1) == 0:
            return 0
        slot = self.alloc_tmp[0]
        st = self.staging + <size_t>slot * self.peer_stride
        h = <rm_slot_hdr *>st
        h.seq = self.send_seq
        h.used = L
        h.count = 1
        h.flags = SLOT_SINGLE
        h.check = ~(<uint32_t>self.send_seq)
        h.reserved = 0
        self.send_seq += 1
        memcpy(st + SLOT_HEADER, p, L)
        wr.wr_id = 0
        wr.local_addr = <uint64_t>st
        wr.remote_off = <uint64_t>slot * self.peer_stride
        wr.length = SLOT_HEADER + L
        wr.lkey = self.lkey_of(slot)
        wr.rkey = RM_REGION_RING
        wr.opcode = RM_WR_WRITE
        wr.flags = 0
        wr.imm = 0
        nw = self.arrival_wrs(1)
        self.link.lock()
        rc = self.link.post(self.wrs, nw)
        self.link.unlock()
        if rc != 0 and rc != RM_ERR_LATE:     # (late: accepted, as a chain that goes)
            return rc
        self.link.completed_in_post()
        self.count(1, L, 1)
        rm_fence_seq_cst()
        if rm_load_acquire64(&self.link.ctrl[CTRL_RX_SLEEP]):
            self.link.wake_peer()
        return 1

    cdef int post_slots(self, uint32_t k0, uint32_t got) noexcept nogil:
        """Post planned slots k0..k0+got (allocated into alloc_tmp) as one chain: slot
        writes, then arrival words; only the last WR is signaled."""
        cdef uint32_t j, nw = 0
        cdef int rc
        for j in range(got):
            nw = self.build_slot(k0 + j, self.alloc_tmp[j], nw)
        nw = self.arrival_wrs(nw)
        # one signaled WR per post: per batch in batched mode, per message in ack mode
        self.wrs[nw - 1].flags |= RM_WR_SIGNALED
        self.wrs[nw - 1].wr_id = self.link.next_batch()
        self.link.lock()
        rc = self.link.post(self.wrs, nw)
        self.link.unlock()
        if rc != 0 and rc != RM_ERR_LATE:
            return rc
        self.link.reap_posted(self.link.batch_posted)
        rm_fence_seq_cst()
        if rm_load_acquire64(&self.link.ctrl[CTRL_RX_SLEEP]):
            self.link.wake_peer()
        return rc

    cdef void doorbell(self, uint32_t k0, uint32_t got, uint32_t nplan, int rc) noexcept nogil:
        """The timeline's record of the chain post_slots just posted (while one records):
        kept for its batch's record if it is the batch's last (nothing but the end of the
        call comes after it)."""
        self.batch.trace_doorbell(now_ns(), self.batch.plan_start[k0 + got] -
                                  self.batch.plan_start[k0], got, rc, k0 + got == nplan)

    cdef uint32_t build_slot(self, uint32_t k, uint32_t slot, uint32_t nw) noexcept nogil:
        """Fill staging for planned slot k going to peer slot ``slot``; append its WRs."""
        cdef uint8_t *kind = self.batch.kind      # (locals: the copy loop below
        cdef size_t *lens = self.batch.lens       # writes through char *, so fields
        cdef char **ptrs = self.batch.ptrs        # would be reloaded every message)
        cdef char *st = self.staging + <size_t>slot * self.peer_stride
        cdef rm_slot_hdr *h = <rm_slot_hdr *>st
        cdef uint32_t i, first = self.batch.plan_start[k], last = self.batch.plan_start[k + 1]
        cdef uint32_t L, lkey = self.lkey_of(slot)
        cdef char *p
        cdef rm_wr *wr
        h.seq = self.send_seq
        h.used = self.batch.plan_used[k]
        h.count = <uint16_t>(last - first)
        h.flags = self.batch.plan_flags[k]
        h.check = ~(<uint32_t>self.send_seq)
        h.reserved = 0
        self.send_seq += 1
        if self.batch.plan_flags[k] == SLOT_PACKED:
            p = st + SLOT_HEADER
            for i in range(first, last):
                if kind[i]:
                    nw = self.rs.desc_record(i, p, self.wrs, nw)
                    p += REC_HDR + DESC_BYTES
                    continue
                L = <uint32_t>lens[i]
                (<uint32_t *>p)[0] = L
                (<uint32_t *>p)[1] = 0
                rm_copy(p + REC_HDR, ptrs[i], L)
                p += REC_HDR + pad8(L)
            wr = &self.wrs[nw]
            wr.wr_id = 0
            wr.local_addr = <uint64_t>st
            wr.remote_off = <uint64_t>slot * self.peer_stride
            wr.length = SLOT_HEADER + self.batch.plan_used[k]
            wr.lkey = lkey
            wr.rkey = RM_REGION_RING
            wr.opcode = RM_WR_WRITE
            wr.flags = 0
            wr.imm = 0
            return nw + 1
        # SINGLE: the payload goes straight from the user's buffer when the provider
        # can read it (shm, tcp) and it is not small, else through the staging slot
        # (one WRITE); the header is inline.
        L = self.batch.plan_used[k]
        wr = &self.wrs[nw]
        wr.wr_id = 0
        wr.remote_off = <uint64_t>slot * self.peer_stride
        wr.lkey = lkey
        wr.rkey = RM_REGION_RING
        wr.opcode = RM_WR_WRITE
        wr.imm = 0
        if L == 0:
            wr.local_addr = <uint64_t>st
            wr.length = HDR_BYTES
            wr.flags = RM_WR_INLINE
            return nw + 1
        if L <= SMALL_COPY or not self.link.direct_source():
            memcpy(st + SLOT_HEADER, self.batch.ptrs[first], L)
            wr.local_addr = <uint64_t>st
            wr.length = SLOT_HEADER + L
            wr.flags = 0
            return nw + 1
        wr.local_addr = <uint64_t>self.batch.ptrs[first]
        wr.remote_off += SLOT_HEADER
        wr.length = L
        wr.flags = 0
        wr = &self.wrs[nw + 1]
        wr.wr_id = 0
        wr.local_addr = <uint64_t>st
        wr.remote_off = <uint64_t>slot * self.peer_stride
        wr.length = HDR_BYTES
        wr.lkey = lkey
        wr.rkey = RM_REGION_RING
        wr.opcode = RM_WR_WRITE
        wr.flags = RM_WR_INLINE
        wr.imm = 0
        return nw + 2

    cdef uint32_t arrival_wrs(self, uint32_t nw) noexcept nogil:
        """Append the WRITE(s) of the arrival words that changed (last in the chain).

        A transport that reads the source after post() returns (RDMA) gets a snapshot
        of the words, so a later batch's bits can never travel ahead of its data."""
        cdef uint32_t start, count, first_part, nwords = self.sbm.nwords
        cdef uint64_t *src = self.sbm.arrival
        cdef uint32_t lkey = self.lkey_arrival
        cdef uint64_t entry, oldest
        cdef rm_wr *wr
        if not self.sbm.take_dirty(&start, &count):
            return nw
        if not self.link.synchronous():
            entry = (self.link.batch_posted + 1) % SNAP_DEPTH
            oldest = (self.link.batch_posted + 1 - SNAP_DEPTH
                      if self.link.batch_posted + 1 > SNAP_DEPTH else 0)
            while self.link.batch_done < oldest and not self.link.peer_gone:
                self.link.reap()               # that entry's WRITE has not completed yet
                rm_cpu_relax()
            src = self.snap + entry * nwords
            memcpy(src, self.sbm.arrival, nwords * 8)
            lkey = self.lkey_snap
        first_part = count
        if start + count > nwords:
            first_part = nwords - start
        wr = &self.wrs[nw]
        wr.wr_id = 0
        wr.local_addr = <uint64_t>&src[start]
        wr.remote_off = start * 8
        wr.length = first_part * 8
        wr.lkey = lkey
        wr.rkey = RM_REGION_ARRIVAL
        wr.opcode = RM_WR_WRITE
        wr.flags = RM_WR_PUBLISH
        wr.imm = 0
        nw += 1
        if first_part < count:
            wr = &self.wrs[nw]
            wr[0] = self.wrs[nw - 1]
            wr.local_addr = <uint64_t>&src[0]
            wr.remote_off = 0
            wr.length = (count - first_part) * 8
            nw += 1
        return nw

    cdef dict diagnostics(self):
        return {
            "send_seq": self.send_seq, "free_send_slots": self.sbm.count_free(),
            "send_arrival_shadow": list(self.sbm.arrival_words),
            "send_reclaim_seen": list(self.sbm.reclaim_words),
        }
