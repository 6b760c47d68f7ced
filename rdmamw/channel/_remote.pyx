# cython: freethreading_compatible = False
"""One-sided access to a peer's exposed memory (docs/remote-memory.md): the part of
the remote-memory API that touches the transport. RemoteOps exposes this side's
buffers as tagged regions (the transport's expose(), the tag above
RM_ACCESS_TAG_SHIFT) and posts READ/WRITE and atomic work requests on the peer's
regions (RM_WR_EXPOSED | RM_WR_REGION, imm = the region's tag): a batch, its atomics
among its READs and WRITEs, is one chain and one post (one doorbell; a provider that
bounds a chain, tcp, gets a longer batch as several chains of at most its
``region_chain_max``). References, bounds, access and
errors are the Python layer's (rdmamw/channel/remote.py); the provider checks every
request against the owner's exposure again, so nothing here is trusted by the owner.

It sits beside the channel, not in the engine (whose units reach the transport only
through the Link): it shares no state with the engine's units, and its chains hold
only EXPOSED work requests, which a provider that finishes the work inside post()
(shm) runs from any thread, as the engine's rendezvous READs do; chains of several
threads may run at the same time (the provider keeps its busy word odd while any does).

A gather or scatter (remote.py: many pieces of one region given as arrays) is a
:class:`Pieces`: its arrays' int64s held, every piece checked in C against the
reference's length when it is made, and turned into a work request a piece when the
chain is posted, on every provider (verbs: the same WR path as readv).

``one()`` is the lean path of a single read or write: the reference's fields are read
and checked here, one work request on the stack, no Python object made; anything it
does not take (a DLPack tensor, a refusal to explain, a transport that registers
memory) goes the checked way.

On a transport that registers memory (verbs), a region's buffer is leased from the
channel's registration cache of the process's shared domain (``expose_cache``: one
registration for every peer it is exposed to; the transport's expose_cached() binds a
window over it), or registered by the transport's expose() for this peer alone (no
shared domain); the local buffers of a chain are leased from ``local_cache`` for as
long as the post (which returns when the chain completed)."""

from cpython.buffer cimport (
    PyBUF_ANY_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset

from rdmamw.engine._link cimport deadline_of
from rdmamw.transport._base cimport (
    RM_ACCESS_REMOTE_WRITE,
    RM_ACCESS_TAG_SHIFT,
    RM_ERR_AGAIN,
    RM_WR_CMP_SWAP,
    RM_WR_EXPOSED,
    RM_WR_FETCH_ADD,
    RM_WR_READ,
    RM_WR_REGION,
    RM_WR_WRITE,
    Transport,
    pthread_self,
    rm_mem,
    rm_wr,
)

cdef uint64_t PIECE = 1 << 30       # one work request moves at most this much
cdef uint32_t TAG_MAX = 0xFFFFFF    # tags are 24 bits (above RM_ACCESS_TAG_SHIFT)
cdef uint32_t ACC_R = 1, ACC_W = 2  # a reference's access bits (remote.py R, W)
ONE_CHECKED = 1                     # one(): not tried, go the checked way
cdef enum:                          # post()'s operation kinds (remote.py: OP_*)
    K_READ = 0                      # (a READ and a WRITE may be given as False, True)
    K_WRITE = 1
    K_FETCH_ADD = 2
    K_CMP_SWAP = 3
    K_GATHER = 4                    # Pieces: a READ a piece
    K_SCATTER = 5                   # Pieces: a WRITE a piece
OP_READ, OP_WRITE, OP_FETCH_ADD, OP_CMP_SWAP = K_READ, K_WRITE, K_FETCH_ADD, K_CMP_SWAP
OP_GATHER, OP_SCATTER = K_GATHER, K_SCATTER
cdef uint32_t _last_tag = 0         # tags are unique in the process, not per channel: a
                                    # request that names another channel's exposure
                                    # never finds its tag in this channel's table


cdef inline int post_by(Transport tp, rm_wr *wrs, uint32_t n, int64_t deadline) noexcept nogil:
    """tp.post() with this thread's post deadline (RM_ERR_LATE once it passed: a
    provider that waits for its peer, tcp, gives the chain up by then)."""
    cdef int rc
    if deadline == 0:
        if tp.post_owner == pthread_self():
            tp.post_deadline = 0        # none of an earlier call of this thread's
        return tp.post(wrs, n)
    tp.deadline_posts(deadline)
    rc = tp.post(wrs, n)
    if tp.post_owner == pthread_self():
        tp.post_deadline = 0
    return rc


cdef class Pieces:
    """The pieces of one array operation (remote.py: Batch.gather / Batch.scatter): one
    local buffer cut into consecutive pieces from its byte 0, piece ``i`` of
    ``lengths[i]`` bytes (or ``size`` each) at ``offsets[i]`` of one region. Made by
    :func:`pieces`, which checks every piece in C; posted as a work request a piece.
    It holds its arrays' buffers (int64s) until it goes."""
    cdef readonly object local
    cdef Py_buffer views[2]             # the offsets and the lengths (held: ``nviews``)
    cdef int nviews
    cdef const int64_t *offs
    cdef const int64_t *lens            # NULL when every piece is ``size`` bytes
    cdef readonly int64_t size
    cdef readonly Py_ssize_t count
    #: the bytes of all pieces; the lowest offset and the highest end (their span in
    #: the region); work requests (a piece above PIECE is several)
    cdef readonly uint64_t total, lo, hi, nwr
    #: the first piece refused (-1: none) and why: 1 outside the region, 2 a length < 1
    cdef readonly Py_ssize_t bad
    cdef readonly int why

    cdef const int64_t *hold(self, obj) except NULL:
        """The int64s of ``obj`` (a contiguous array of them), held."""
        cdef Py_buffer *v = &self.views[self.nviews]
        PyObject_GetBuffer(obj, v, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT)
        self.nviews += 1
        if v.itemsize != 8 or v.format == NULL or v.format[0] not in b"lq@=<" \
                or v.format[1 if v.format[0] in b"@=<" else 0] not in b"lq" \
                or v.ndim > 1:
            raise TypeError("offsets and lengths are contiguous int64 arrays")
        return <const int64_t *>(v.buf if v.buf != NULL else <void *>&self.size)

    def __dealloc__(self):
        while self.nviews > 0:
            self.nviews -= 1
            PyBuffer_Release(&self.views[self.nviews])


def pieces(local, offsets, lengths, int64_t size, uint64_t region_length) -> Pieces:
    """Check the pieces of ``local`` (``lengths``, or ``size`` each when ``lengths``
    is None) at ``offsets`` (contiguous int64 arrays) against a region of
    ``region_length`` bytes: the Pieces, whose ``bad`` / ``why`` name the first one
    refused (the caller raises)."""
    cdef Pieces p = Pieces()
    cdef Py_ssize_t i, n
    cdef int64_t o, L
    cdef uint64_t total = 0, lo = <uint64_t>-1, hi = 0, nwr = 0
    p.local, p.size, p.bad, p.why = local, size, -1, 0
    p.offs = p.hold(offsets)
    n = p.views[0].len // 8
    if lengths is not None:
        p.lens = p.hold(lengths)
        if p.views[1].len // 8 != n:
            raise ValueError(f"{p.views[1].len // 8} lengths for {n} offsets")
    p.count = n
    with nogil:
        for i in range(n):
            o = p.offs[i]
            L = p.lens[i] if p.lens != NULL else size
            if L < 1:
                p.bad, p.why = i, 2
                break
            if o < 0 or <uint64_t>o > region_length \
                    or <uint64_t>L > region_length - <uint64_t>o:
                p.bad, p.why = i, 1
                break
            total += <uint64_t>L
            lo = min(lo, <uint64_t>o)
            hi = max(hi, <uint64_t>(o + L))
            nwr += (<uint64_t>L + PIECE - 1) // PIECE
    p.total, p.lo, p.hi, p.nwr = total, (lo if n else 0), hi, nwr
    return p


cdef Py_ssize_t fill(rm_wr *wrs, uint64_t local, uint64_t remote, uint64_t n, uint32_t key,
                     uint32_t tag, uint16_t opcode, uint32_t lkey) noexcept nogil:
    """The work requests of ``n`` bytes (one a PIECE): how many."""
    cdef uint64_t done = 0, piece
    cdef Py_ssize_t k = 0
    while True:
        piece = min(n - done, PIECE)
        wrs[k].wr_id = 0
        wrs[k].local_addr = local + done
        wrs[k].remote_off = remote + done
        wrs[k].length = <uint32_t>piece
        wrs[k].rkey = key
        wrs[k].lkey = lkey
        wrs[k].imm = tag
        wrs[k].opcode = opcode
        wrs[k].flags = RM_WR_EXPOSED | RM_WR_REGION
        k += 1
        done += piece
        if done >= n:
            return k


cdef Py_ssize_t fill_pieces(rm_wr *wrs, Pieces p, uint64_t local, uint64_t base,
                            uint32_t key, uint32_t tag, uint16_t opcode,
                            uint32_t lkey) noexcept nogil:
    """The work requests of every piece of ``p`` (local bytes from ``local`` on, remote
    at ``base`` + its offset): how many."""
    cdef Py_ssize_t i, k = 0
    cdef uint64_t at = 0, L
    for i in range(p.count):
        L = <uint64_t>(p.lens[i] if p.lens != NULL else p.size)
        k += fill(wrs + k, local + at, base + <uint64_t>p.offs[i], L, key, tag, opcode,
                  lkey)
        at += L
    return k


cdef class Pinned:
    """A buffer held while it is exposed: the exposure keeps its memory alive, however
    the owner drops its own references (and its registration: ``lease``)."""
    cdef Py_buffer view
    cdef bint held
    cdef uint32_t handle            # the transport's, for unexpose()
    cdef object lease               # of the registration cache (verbs), or None

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = False


cdef class RemoteOps:
    """One channel endpoint's regions and one-sided operations."""
    cdef Transport tp
    cdef uint64_t peer              # the peer endpoint's identity (0: not known yet)
    cdef Py_ssize_t chain_max       # work requests per chain at most (0: no bound)
    cdef dict live                  # key -> Pinned: the regions exposed now
    cdef object expose_cache, local_cache   # registration caches (verbs), or None
    cdef list stuck                 # Pinned whose revoke timed out: held until we go
    cdef bint exact                 # a region's registration is exactly its range
    cdef readonly uint64_t ops, chains, bytes_read, bytes_written

    def __init__(self, Transport tp, expose_cache=None, local_cache=None, bint exact=False):
        """``exact``: lease each region's registration for exactly its range, not its
        owner's (a device that does not check a window's bounds: the registration's
        are the ones it checks)."""
        self.tp, self.exact = tp, exact
        self.live = {}
        self.stuck = []
        self.chain_max = getattr(tp, "region_chain_max", 0)
        self.expose_cache, self.local_cache = expose_cache, local_cache
        if tp.registers_memory and local_cache is None:
            raise ValueError("a transport that registers memory needs a local cache")

    def expose(self, obj, uint32_t access, file=None) -> tuple:
        """Expose ``obj``'s memory with RM_ACCESS_REMOTE_* ``access``: (0, key, tag,
        address, length), or (rc, 0, 0, 0, 0) with the transport's error code.
        ``file``: (memfd, offset) of shared memory holding it, for a transport that
        maps it for atomics (shm: its expose_shared())."""
        cdef Pinned p = Pinned()
        cdef rm_mem mem
        cdef int rc
        global _last_tag
        cdef uint32_t tag, lkey, rkey
        flags = PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if access & RM_ACCESS_REMOTE_WRITE
                                        else 0)
        PyObject_GetBuffer(obj, &p.view, flags)
        p.held = True
        if p.view.len == 0:
            raise ValueError("an empty buffer cannot be exposed")
        _last_tag = _last_tag % TAG_MAX + 1
        tag = _last_tag
        access |= tag << RM_ACCESS_TAG_SHIFT
        if file is not None:
            rc, key = self.tp.expose_shared(<uint64_t>p.view.buf, <uint64_t>p.view.len,
                                            access, file[0], file[1])
            mem.handle = mem.rkey = key
        elif self.expose_cache is not None:
            p.lease = self.expose_cache.acquire(obj, exact=self.exact)
            lkey, rkey = p.lease.handle[1], p.lease.handle[2]
            with nogil:
                rc = self.tp.expose_cached(<uint64_t>p.view.buf, <uint64_t>p.view.len,
                                           access, lkey, rkey, &mem)
        else:
            with nogil:
                rc = self.tp.expose(<uint64_t>p.view.buf, <uint64_t>p.view.len, access,
                                    &mem)
        if rc != 0:
            if p.lease is not None:
                p.lease.release()
            return rc, 0, 0, 0, 0
        p.handle = mem.handle
        self.live[mem.rkey] = p
        return 0, mem.rkey, tag, <uint64_t>p.view.buf, p.view.len

    def unexpose(self, uint32_t key) -> int:
        """Withdraw region ``key``; once the transport says no byte of it moves any more,
        its buffer is let go. RM_ERR_AGAIN: the peer's access in progress did not end
        (a stopped peer): the buffer stays held as long as this endpoint."""
        cdef int rc
        cdef Pinned p = self.live.pop(key, None)
        if p is None:
            return 0
        with nogil:
            rc = self.tp.unexpose(p.handle)
        if rc == RM_ERR_AGAIN:
            self.stuck.append(p)
        elif p.lease is not None:
            p.lease.release()
            p.lease = None
        return rc

    def unexpose_all(self) -> int:
        """Withdraw every region (the channel closes); the last error code, or 0."""
        cdef int rc = 0, r
        for key in list(self.live):
            r = self.unexpose(key)
            rc = r if r else rc
        return rc

    @property
    def exposed(self) -> int:
        return len(self.live)

    def post(self, list ops, timeout=None) -> int:
        """Post ``ops`` as one chain: each ``(kind, local, offset, length, key, tag,
        remote_address)``, ``kind`` an OP_* (a bool: READ or WRITE), ``local`` a buffer
        whose ``[offset, offset + length)`` the caller checked; a READ fills it, a WRITE
        sends it. An atomic's ``length`` is 8 (the word) and its local range 16 bytes:
        its two operands (remote.py's _WORDS), the first replaced by the word's old
        value. OP_GATHER / OP_SCATTER: ``local`` a checked :class:`Pieces`, a READ /
        WRITE a piece, its offsets from ``remote_address`` - ``offset`` (its span's
        start minus its lowest offset). The transport's code (RM_ERR_LATE: ``timeout``
        s passed first; no READ target is written after)."""
        cdef Py_ssize_t i, k = 0, nops = len(ops), nwr = 0, at, step, nchains = 0
        cdef Py_buffer *views
        cdef rm_wr *wrs
        cdef int rc = 0
        cdef uint64_t off, n, rbytes = 0, wbytes = 0, need, count = 0
        cdef uint32_t kind
        cdef int64_t deadline = deadline_of(timeout)
        cdef uint32_t lkey = 0
        cdef Pieces p
        leases = [] if self.local_cache is not None else None
        lkeys = {}                      # id(local) -> its lease's lkey: one lease a buffer
        for op in ops:
            if op[0] >= K_GATHER:
                nwr += <Py_ssize_t>(<Pieces?>op[1]).nwr
            else:
                nwr += <Py_ssize_t>((<uint64_t>op[3] + PIECE - 1) // PIECE) or 1
        views = <Py_buffer *>calloc(nops, sizeof(Py_buffer))
        wrs = <rm_wr *>calloc(nwr or 1, sizeof(rm_wr))
        if views == NULL or wrs == NULL:
            free(views)
            free(wrs)
            raise MemoryError()
        i = 0
        try:
            for i in range(nops):
                op = ops[i]
                kind = op[0]
                if kind > K_SCATTER:
                    raise ValueError(f"operation {i}: no kind {kind}")
                p = op[1] if kind >= K_GATHER else None
                local = p.local if p is not None else op[1]
                PyObject_GetBuffer(local, &views[i], PyBUF_ANY_CONTIGUOUS
                                   | (0 if kind == K_WRITE or kind == K_SCATTER
                                      else PyBUF_WRITABLE))
                off, n = op[2], op[3]
                need = 16 if kind == K_FETCH_ADD or kind == K_CMP_SWAP else \
                    p.total if p is not None else n
                if ((kind == K_FETCH_ADD or kind == K_CMP_SWAP) and n != 8) \
                        or off > <uint64_t>views[i].len \
                        or need > <uint64_t>views[i].len - off:
                    PyBuffer_Release(&views[i])
                    raise ValueError(f"operation {i}: {need} bytes at {off} of a buffer "
                                     f"of {views[i].len}")
                if leases is not None:
                    if id(local) not in lkeys:
                        lease = self.local_cache.acquire(local)
                        leases.append(lease)
                        lkeys[id(local)] = lease.handle[1]
                    lkey = lkeys[id(local)]
                if p is not None:       # (an atomic: one work request on its word)
                    k += fill_pieces(wrs + k, p, <uint64_t>views[i].buf,
                                     <uint64_t>op[6] - p.lo, op[4], op[5],
                                     RM_WR_READ if kind == K_GATHER else RM_WR_WRITE, lkey)
                    count += <uint64_t>p.count
                else:
                    k += fill(wrs + k, <uint64_t>views[i].buf + off, <uint64_t>op[6], n,
                              op[4], op[5], RM_WR_READ if kind == K_READ else RM_WR_WRITE
                              if kind == K_WRITE else RM_WR_FETCH_ADD
                              if kind == K_FETCH_ADD else RM_WR_CMP_SWAP, lkey)
                    count += 1
                if kind == K_WRITE or kind == K_SCATTER:
                    wbytes += need
                elif kind == K_READ or kind == K_GATHER:
                    rbytes += need
            i = nops
            step = self.chain_max if self.chain_max > 0 else k
            at = 0
            with nogil:
                while at < k and rc == 0:
                    rc = post_by(self.tp, wrs + at, <uint32_t>min(step, k - at), deadline)
                    at += step
                    nchains += 1
        finally:
            while i > 0:
                i -= 1
                PyBuffer_Release(&views[i])
            free(views)
            free(wrs)
            for lease in leases or ():
                lease.release()
        if rc == 0:
            self.ops += count
            self.chains += nchains
            self.bytes_read += rbytes
            self.bytes_written += wbytes
        return rc

    def one(self, bint write, obj, ref, Py_ssize_t offset, timeout=None) -> int:
        """Read the region ``ref`` at ``offset`` into all of ``obj``, or write all of
        ``obj`` there, as one work request: the transport's code, or ONE_CHECKED when
        it did not try (a reference of another channel, an access or range it does not
        allow, a buffer it cannot take): the caller then goes the checked way, which
        says why. Nothing was posted when ONE_CHECKED is returned."""
        cdef Py_buffer view
        cdef rm_wr wr
        cdef uint64_t base, length, n, off, key, tag
        cdef int rc
        cdef int64_t deadline = 0 if timeout is None else deadline_of(timeout)
        if self.local_cache is not None:
            return ONE_CHECKED          # its buffer needs a lease: post() takes one
        if self.peer == 0:
            self.peer = self.tp.region_ids()[1]
        try:
            if ref.channel != self.peer or self.peer == 0 or offset < 0 \
                    or not <uint32_t>ref.access & (ACC_W if write else ACC_R):
                return ONE_CHECKED
            base, length, key, tag, off = ref.base, ref.length, ref.key, ref.tag, offset
            if key >> 32 or tag >> 32 or base + length < base:
                return ONE_CHECKED
            PyObject_GetBuffer(obj, &view,
                               PyBUF_ANY_CONTIGUOUS | (0 if write else PyBUF_WRITABLE))
        except Exception:
            return ONE_CHECKED
        n = <uint64_t>view.len
        if n == 0 or n > PIECE or off > length or n > length - off:
            PyBuffer_Release(&view)
            return ONE_CHECKED
        memset(&wr, 0, sizeof(wr))
        wr.local_addr = <uint64_t>view.buf
        wr.remote_off = base + off
        wr.length = <uint32_t>n
        wr.rkey = <uint32_t>key
        wr.imm = <uint32_t>tag
        wr.opcode = RM_WR_WRITE if write else RM_WR_READ
        wr.flags = RM_WR_EXPOSED | RM_WR_REGION
        with nogil:
            rc = post_by(self.tp, &wr, 1, deadline)
        PyBuffer_Release(&view)
        if rc == 0:
            self.ops += 1
            self.chains += 1
            if write:
                self.bytes_written += n
            else:
                self.bytes_read += n
        return rc

    def atomic(self, bint cas, object operands, uint32_t key, uint32_t tag,
               uint64_t addr, timeout=None) -> int:
        """fetch_add (``cas`` False) or compare_swap on the aligned 64-bit word at
        ``addr`` of region ``key``/``tag``: ``operands`` a writable 16-byte buffer of
        two native 64-bit words (the value to add, or the expected value and the
        new one), whose first word becomes the word's old value. The transport's
        code (a provider without atomics refuses the work request)."""
        cdef Py_buffer view
        cdef rm_wr wr
        cdef int rc
        cdef int64_t deadline = 0 if timeout is None else deadline_of(timeout)
        lease = self.local_cache.acquire(operands) if self.local_cache is not None \
            else None
        PyObject_GetBuffer(operands, &view, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
        try:
            if view.len != 16:
                raise ValueError("the operands are two 64-bit words")
            memset(&wr, 0, sizeof(wr))
            wr.local_addr = <uint64_t>view.buf
            wr.remote_off = addr
            wr.length = 8
            wr.lkey = lease.handle[1] if lease is not None else 0
            wr.rkey = key
            wr.imm = tag
            wr.opcode = RM_WR_CMP_SWAP if cas else RM_WR_FETCH_ADD
            wr.flags = RM_WR_EXPOSED | RM_WR_REGION
            with nogil:
                rc = post_by(self.tp, &wr, 1, deadline)
        finally:
            PyBuffer_Release(&view)
            if lease is not None:
                lease.release()
        if rc == 0:
            self.ops += 1
            self.chains += 1
        return rc
