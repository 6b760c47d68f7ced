# cython: freethreading_compatible = False
"""Rendezvous, sending side: a large message travels as a descriptor in a slot while
its source stays exposed (or is WRITTEN into the destination the receiver advertised)
until the receiver flips its done bit. RNDV_N entries per direction (docs/protocol.md)."""

cimport cython
from cpython.buffer cimport PyBuffer_Release
from cpython.ref cimport Py_XDECREF
from libc.stdint cimport int64_t
from libc.string cimport memcpy

from rdmamw.engine._frames cimport (
    CTRL_ADVERT,
    CTRL_RNDV_DONE,
    DESC_BYTES,
    DESC_READ,
    DESC_WRITTEN,
    REC_HDR,
    REC_RNDV,
    RNDV_N,
    WAIT_ENTRY,
)
from rdmamw.engine._leases cimport end_owned
from rdmamw.engine._trace cimport TR_RNDV_DONE, TR_RNDV_EXPOSE, rm_trace_on, rm_trace_put
from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_READ,
    RM_ERR_AGAIN,
    RM_WR_EXPOSED,
    RM_WR_WRITE,
    now_ns,
)
from rdmamw.transport.atomics cimport rm_load_acquire64


@cython.final
cdef class RndvSender:
    """The rendezvous entries of one direction and the sources they hold."""

    def __cinit__(self, Link link, SendBatch batch, bint write):
        self.link = link
        self.batch = batch
        self.write = write

    def __dealloc__(self):
        cdef uint32_t i
        for i in range(RNDV_N):
            if self.held[i]:
                PyBuffer_Release(&self.buf[i])
                self.held[i] = 0
            Py_XDECREF(self.lease[i])       # a Lease releases itself when it dies
            self.lease[i] = NULL

    cdef void give_back(self) noexcept:
        """close(): the sources go back whether or not their done bits came."""
        self.upto = self.next
        self.release()

    cdef uint32_t prepare_rndv(self, uint32_t k, uint32_t want, int *rc) noexcept nogil:
        """prepare() of a batch with rendezvous messages."""
        cdef uint32_t end = self.batch.plan_start[k + want], s = 0
        cdef int r
        while self.prep_i < end:
            if self.batch.kind[self.prep_i]:
                if self.next - self.released >= RNDV_N:
                    break
                r = self.prepare_one(self.prep_i)
                if r == RM_ERR_AGAIN:
                    break
                if r != 0:
                    rc[0] = r
                    break
            self.prep_i += 1
        while s < want and self.batch.plan_start[k + s + 1] <= self.prep_i:
            s += 1
        return s

    cdef int prepare_one(self, uint32_t i) noexcept nogil:
        """Give message i the next entry: WRITTEN into the destination the receiver
        advertised for this index if it fits, else exposed for its READ."""
        cdef uint64_t j = self.next
        cdef uint8_t e = <uint8_t>(j % RNDV_N)
        cdef uint64_t *adv = self.link.ctrl + CTRL_ADVERT + 4 * e
        cdef uint64_t L = self.batch.lens[i]
        cdef bint written = False
        cdef rm_mem mem
        cdef rm_desc *d = &self.desc[e]
        cdef int rc
        cdef int64_t t0 = now_ns() if rm_trace_on(self.link.trace) else 0
        if self.write and rm_load_acquire64(&adv[3]) == j + 1 and adv[1] >= L:
            written = True
            self.waddr[e] = adv[0]
            self.wkey[e] = <uint32_t>adv[2]
        if self.batch.lease_of[i] != NULL:       # registered by the cache (remote read)
            rc = self.link.expose_cached(<uint64_t>self.batch.ptrs[i], L,
                                         RM_ACCESS_LOCAL if written else RM_ACCESS_REMOTE_READ,
                                         self.batch.lease_keys[2 * i],
                                         self.batch.lease_keys[2 * i + 1], &mem)
        else:
            rc = self.link.expose(<uint64_t>self.batch.ptrs[i], L,
                                  RM_ACCESS_LOCAL if written else RM_ACCESS_REMOTE_READ,
                                  &mem)
        if rc != 0:
            return rc
        d.addr = 0 if written else <uint64_t>self.batch.ptrs[i]
        d.length = L
        d.index = j
        d.key = 0 if written else mem.rkey
        d.kind = DESC_WRITTEN if written else DESC_READ
        d.entry = e
        self.mem[e] = mem
        # the entry keeps the source (and its lease) alive until the done bit
        self.buf[e] = self.batch.hand_over(i, e, &self.lease[e])
        self.held[e] = 1
        self.shadow ^= (<uint64_t>1) << e
        self.next += 1
        self.link.cnt.rndv_sends += 1
        self.link.cnt.rndv_bytes += L
        if written:
            self.link.cnt.rndv_writes += 1
        if t0:
            rm_trace_put(self.link.trace, TR_RNDV_EXPOSE, self.link.serial, t0, now_ns(), j, L,
                         0, written)
        return 0

    cdef void unprepare(self, uint32_t first) noexcept:
        """Undo the preparation of messages first.. that were not posted (timeout)."""
        cdef SendBatch b = self.batch
        cdef uint32_t i = self.prep_i
        cdef uint8_t e
        while i > first:
            i -= 1
            if not b.kind[i] or b.held[i]:
                continue
            e = b.msg_entry[i]
            self.link.unexpose(self.mem[e].handle)
            self.mem[e].handle = 0
            b.take_back(i, self.buf[e], self.lease[e])
            self.lease[e] = NULL
            self.held[e] = 0
            self.shadow ^= (<uint64_t>1) << e
            self.next -= 1
            self.link.cnt.rndv_sends -= 1
            self.link.cnt.rndv_bytes -= b.lens[i]
            if self.desc[e].kind == DESC_WRITTEN:
                self.link.cnt.rndv_writes -= 1
        self.prep_i = first

    cdef uint32_t desc_record(self, uint32_t i, char *p, rm_wr *wrs, uint32_t nw) noexcept nogil:
        """Write message i's descriptor record at p; a message going to an advertised
        destination gets its data WRITE appended to ``wrs`` first (RC order, frame
        order). The new length of ``wrs``."""
        cdef uint8_t e = self.batch.msg_entry[i]
        cdef rm_wr *wr
        (<uint32_t *>p)[0] = DESC_BYTES
        (<uint32_t *>p)[1] = REC_RNDV
        memcpy(p + REC_HDR, &self.desc[e], DESC_BYTES)
        if self.desc[e].kind != DESC_WRITTEN:
            return nw
        wr = &wrs[nw]
        wr.wr_id = 0
        wr.local_addr = <uint64_t>self.batch.ptrs[i]
        wr.remote_off = self.waddr[e]
        wr.length = <uint32_t>self.batch.lens[i]
        wr.lkey = self.mem[e].lkey
        wr.rkey = self.wkey[e]
        wr.opcode = RM_WR_WRITE
        wr.flags = RM_WR_EXPOSED
        wr.imm = 0
        return nw + 1

    cdef void reap(self) noexcept nogil:
        """Advance ``upto`` over the entries whose done bit came back (in order)."""
        cdef uint64_t done = rm_load_acquire64(&self.link.ctrl[CTRL_RNDV_DONE])
        cdef uint64_t diff = done ^ self.shadow
        cdef uint64_t before = self.upto
        cdef int64_t t
        while self.upto < self.next and not (diff >> (self.upto % RNDV_N)) & 1:
            self.upto += 1
        if self.upto != before and rm_trace_on(self.link.trace):
            t = now_ns()
            rm_trace_put(self.link.trace, TR_RNDV_DONE, self.link.serial, t, t, 0, 0,
                         self.upto, 0)

    cdef void release(self) noexcept:
        """Un-expose and let go of the sources of done messages. An entry is taken
        whole before anything that may run Python code (a buffer's release, the
        cache's lock): another thread may come in then, and must find it gone."""
        cdef uint8_t e
        cdef Py_buffer b
        cdef bint held
        cdef PyObject *lease
        while self.released < self.upto:
            e = <uint8_t>(self.released % RNDV_N)
            self.link.unexpose(self.mem[e].handle)
            self.mem[e].handle = 0
            held = self.held[e]
            self.held[e] = 0
            b = self.buf[e]
            lease = self.lease[e]
            self.lease[e] = NULL
            self.released += 1
            if held:
                PyBuffer_Release(&b)
            if lease != NULL:           # the MR stays cached; only the lease ends
                end_owned(lease)

    cdef bint poll(self, uint64_t target) noexcept:
        """True once the sources of the first ``target`` messages are released."""
        if self.released < target:
            self.reap()
            self.release()
        return self.released >= target

    cdef bint ready(self, int what, uint64_t target) noexcept nogil:
        """WAIT_ENTRY: an entry can be recycled; WAIT_DONE: ``target`` is done."""
        self.reap()
        if what == WAIT_ENTRY:
            return self.upto > self.released
        return self.upto >= target
