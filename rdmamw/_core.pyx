# cython: freethreading_compatible = False
"""The batch engine: slot rings, phase bitmaps and work-request batches.

One :class:`Engine` is one channel endpoint: it sends into the peer's ring and
receives on its own. A batch of messages becomes ONE chained list of work requests
handed to the provider (one doorbell): the slot writes, then the arrival-bitmap
words that changed, last; only the last request is signaled. Receiving scans the
arrival bitmap word-at-a-time, checks each slot's sequence number and hands out
zero-copy :class:`Message` views; releases flip reclaim bits locally and are written
back lazily, in batches. The wire format is in docs/protocol.md.

The data path runs with the GIL released and allocates no Python object per message
on the send side; on the receive side a Message (from a free list) is the view the
user asked for.
"""

cimport cython
from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_WRITABLE,
    PyBuffer_FillInfo,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytearray cimport PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from cpython.ref cimport Py_XDECREF, Py_XINCREF, PyObject
from cpython.tuple cimport PyTuple_GET_SIZE
from cpython.pythread cimport (
    NOWAIT_LOCK,
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

from rdmamw.bitmap._phase cimport RecvBitmaps, SendBitmaps
from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_OS,
    RM_ERR_PEER_LOST,
    RM_ERR_UNSUPPORTED,
    RM_OK,
    RM_REGION_ARRIVAL,
    RM_REGION_CTRL,
    RM_REGION_RECLAIM,
    RM_REGION_RING,
    RM_WR_EXPOSED,
    RM_WR_INLINE,
    RM_WR_PUBLISH,
    RM_WR_READ,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    Transport,
    now_ns,
    rm_mem,
    rm_wc,
    rm_wr,
)
from rdmamw.transport.atomics cimport (
    rm_copy,
    rm_cpu_relax,
    rm_fence_seq_cst,
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_unlock,
)

import logging

from rdmamw import _fork
from rdmamw.transport import layout
from rdmamw.transport.wire import MODES
from rdmamw.errors import (
    BufferTooSmall,
    ChannelClosed,
    MessageTooLarge,
    PeerLost,
    ProtocolError,
    RegistrationError,
    Timeout,
)

cdef extern from "Python.h":
    PyObject **PySequence_Fast_ITEMS(object o)
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)

cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

cdef extern from "sched.h" nogil:
    int sched_yield()

_log = logging.getLogger("rdmamw.channel")

# this process's pid, refreshed in a fork child: ownership checks compare with it
cdef int _pid = _fork.pid()


@_fork.at_child
def _refresh_pid():
    global _pid
    _pid = _fork.pid()

# ---- wire format (docs/protocol.md) --------------------------------------------

ctypedef struct rm_slot_hdr:
    uint64_t seq        # slot sequence number in this direction: 0, 1, 2, ...
    uint32_t used       # payload bytes used
    uint16_t count      # messages in the slot
    uint16_t flags      # SLOT_SINGLE or SLOT_PACKED
    uint32_t check      # ~(uint32)seq: catches a torn or garbage header
    uint32_t reserved

cdef enum:
    SLOT_SINGLE = 1     # one message, payload at offset 0
    SLOT_PACKED = 2     # records {uint32 len, uint32 0, bytes, pad to 8}
    HDR_BYTES = 24      # sizeof(rm_slot_hdr)
    SLOT_HEADER = 64    # header line before the payload
    REC_HDR = 8

cdef enum:
    CTRL_CREDIT_WAIT = 0    # word index (x8 bytes): see rdmamw/layout.py
    CTRL_RX_SLEEP = 8
    CTRL_CLOSED = 16
    CTRL_MAX_MSG = 64       # the largest message the peer takes (0: not announced)
    CTRL_RNDV_DONE = 128    # rendezvous-done bitmap (one word: RNDV_N entries)
    CTRL_ADVERT = 256       # RNDV_N advertised destinations of 4 words (docs/protocol.md)

# ---- rendezvous (docs/protocol.md): a record whose payload is a descriptor ----------

ctypedef struct rm_desc:
    uint64_t addr       # READ: the sender's address of the message (inside its exposure)
    uint64_t length     # bytes of the message
    uint64_t index      # rendezvous sequence number in this direction: 0, 1, 2, ...
    uint32_t key        # READ: the sender's exposure key
    uint16_t kind       # DESC_READ or DESC_WRITTEN
    uint16_t entry      # done bit: index % RNDV_N

cdef enum:
    REC_RNDV = 1            # record flag: the record is a descriptor
    DESC_BYTES = 32         # sizeof(rm_desc)
    DESC_READ = 1           # the receiver READs from the sender's exposure
    DESC_WRITTEN = 2        # the sender has WRITTEN it into the advertised destination
    RNDV_N = 64             # rendezvous entries per direction (one done word)
    WAIT_SLOTS = 0          # what a sender waits for (_wait_credit)
    WAIT_ENTRY = 1
    WAIT_DONE = 2

cdef uint64_t RNDV_WRID = (<uint64_t>1) << 62   # wr_id of a rendezvous READ (async transports)
cdef uint64_t MAX_WR_BYTES = 0xFFFFFFFF
cdef int READ_NAP_MS = 1                # a READ wait, past its spin, sleeps this long at most
cdef int64_t READ_SPIN_NS = 1000000     # ... and spins spin_us plus 1 ns a byte, up to this
cdef int64_t CLOSE_RNDV_NS = 5000000000          # close() waits this long for pending READs
cdef int64_t DYING_NS = 200000000       # a refused READ: how long to look for the peer's death

cdef uint32_t NONE = 0xFFFFFFFF
cdef int64_t SLICE_NS = 50000000        # return to the GIL this often while blocked (signals)
cdef int64_t PEER_CHECK_NS = 1000000    # ask the provider about the peer this often while spinning
cdef uint64_t NOGIL_BYTES = 16384       # batches from this size on copy without the GIL
cdef uint64_t SNAP_DEPTH = 16           # arrival-word snapshots in flight (async transports)
cdef uint32_t RECV_CALL_BYTES = 1 << 20 # slot memory one recv_batch call may hand out
cdef int64_t GIL_SPIN_NS = 3000         # a receive polls this long before releasing the GIL
cdef uint32_t FLUSH_BYTES = 1 << 18     # slot memory released before a lazy write-back

def _fresh_buffer(Py_ssize_t n):
    """The engine's own rendezvous destination when nobody gave it an allocator: an
    uninitialised bytearray (a Channel passes its pool's instead)."""
    return PyByteArray_FromStringAndSize(NULL, n)


cdef int _release_lease(object lease) except -1:
    """End a registration-cache Lease; one released already (the cache was closed
    under it) is fine."""
    try:
        lease.release()
    except RegistrationError:
        pass
    return 0


cdef inline uint32_t pad8(uint32_t n) noexcept nogil:
    return (n + 7u) & ~7u


# ---- handles and messages --------------------------------------------------------

@cython.final
cdef class SendHandle:
    """Completion of one batch: its source buffers may be reused once ``done()``."""
    cdef Engine eng
    cdef readonly uint64_t batch
    cdef readonly Py_ssize_t count
    cdef uint64_t rndv          # rendezvous messages sent up to and including this batch

    def done(self) -> bool:
        """True once the batch's buffers may be reused: its work requests completed
        and the receiver has taken every rendezvous message of it (done bits back)."""
        self.eng._check_owner()
        return self.eng._poll_done(self.batch) and self.eng._rndv_poll(self.rndv)

    def wait(self, timeout=None) -> None:
        cdef int64_t deadline = _deadline(timeout)
        cdef Engine eng = self.eng
        cdef uint64_t target = self.rndv
        cdef int st
        cdef bint first = True
        eng._check_owner()
        while not eng._poll_done(self.batch):
            if eng.peer_gone:
                raise PeerLost(eng._lost("peer lost before the batch completed"))
            if deadline and now_ns() > deadline:
                raise Timeout("send batch did not complete in time")
            with nogil:
                rm_cpu_relax()
        while not eng._rndv_poll(target):
            if deadline and now_ns() > deadline:
                raise Timeout("the receiver has not taken the batch's rendezvous messages")
            with nogil:     # ask the receiver for its done bits, as for free slots
                st = eng._wait_credit(eng._slice_end(deadline), first, WAIT_DONE, target)
            first = False
            if st < 0:
                eng._rndv_poll(target)
                if eng.rndv_upto >= target:
                    break
                eng._raise_peer(st, "waiting for the rendezvous done bits")
            PyErr_CheckSignals()

    def __repr__(self):
        return f"<SendHandle batch={self.batch} messages={self.count} done={self.done()}>"


@cython.freelist(8192)
@cython.no_gc
@cython.final
cdef class Message:
    """A received message: a read-only, zero-copy view of its bytes in the ring.

    Supports the buffer protocol (``memoryview(m)``, ``bytes(m)``,
    ``numpy.frombuffer(m)``). Its slot is reclaimed on :meth:`release`, on leaving a
    ``with`` block, or when the object is collected; after release the bytes may be
    overwritten by the peer, so keep a copy (``bytes(m)``) if you need them longer."""
    cdef Engine eng
    cdef char *ptr
    cdef Py_ssize_t length
    cdef uint32_t slot
    cdef int exports
    cdef bint rel
    cdef object owner       # a rendezvous message: its destination (_Dest), no slot

    def __len__(self):
        return self.length

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if self.rel:
            raise ValueError("message was released; its bytes are no longer ours")
        PyBuffer_FillInfo(buffer, self, self.ptr, self.length, 1, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self.exports -= 1

    def __bytes__(self):
        if self.rel:
            raise ValueError("message was released")
        return PyBytes_FromStringAndSize(self.ptr, self.length)

    def tobytes(self) -> bytes:
        return self.__bytes__()

    def release(self) -> None:
        """Give the slot back to the sender (idempotent)."""
        if self.rel:
            return
        if self.exports:
            raise BufferError(f"{self.exports} view(s) of this message are still alive")
        self.rel = True
        if self.owner is not None:
            self.owner = None
            return
        self.eng._release_one(self.slot)

    @property
    def released(self) -> bool:
        return self.rel

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __dealloc__(self):
        cdef Engine eng = self.eng
        if self.owner is not None:
            self.rel = True
            self.owner = None
        elif not self.rel and eng is not None:
            self.rel = True
            if eng.slot_refs[self.slot] > 1:     # fast path: not the slot's last message
                eng.slot_refs[self.slot] -= 1
            else:
                eng._release_one(self.slot)

    def __repr__(self):
        state = "released" if self.rel else f"slot={self.slot}"
        return f"<Message {self.length} bytes {state}>"


@cython.final
cdef class _Dest:
    """A destination of a rendezvous message: a writable buffer held (exported) for as
    long as this object lives, so it can be neither freed nor resized meanwhile."""
    cdef Py_buffer view
    cdef bint held
    cdef readonly object obj
    cdef uint64_t index         # posted: the rendezvous index it is for
    cdef bint advertised        # posted with "write": exposed and announced to the sender
    cdef rm_mem adv

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


cdef _Dest _dest(object obj):
    cdef _Dest d = _Dest.__new__(_Dest)
    try:
        PyObject_GetBuffer(obj, &d.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    except (TypeError, BufferError, ValueError) as e:
        raise TypeError(f"{type(obj).__name__} is not a writable C-contiguous buffer "
                        f"(numpy array, bytearray, memoryview, ...)") from e
    d.held = True
    d.obj = obj
    return d


cdef inline void _fill_wr(rm_wr *wr, uint64_t *src, uint32_t lkey, uint32_t region,
                          uint64_t off, uint32_t length) noexcept nogil:
    """A WRITE of words into a region of the peer, stored in order (PUBLISH)."""
    wr.wr_id = 0
    wr.local_addr = <uint64_t>src
    wr.remote_off = off
    wr.length = length
    wr.lkey = lkey
    wr.rkey = region
    wr.opcode = RM_WR_WRITE
    wr.flags = RM_WR_PUBLISH | RM_WR_INLINE
    wr.imm = 0


cdef int64_t _deadline(object timeout) except -1:
    if timeout is None:
        return 0
    t = float(timeout)
    if t < 0:
        raise ValueError("timeout must be >= 0 or None")
    return now_ns() + <int64_t>(t * 1e9) + 1


# ---- the engine --------------------------------------------------------------------

cdef class Engine:
    """One channel endpoint. Created by a provider's connect/accept, never directly."""
    cdef Transport tp
    cdef SendBitmaps sbm
    cdef RecvBitmaps rbm
    cdef readonly str mode
    cdef bint ack
    cdef readonly bint closed
    cdef readonly bint peer_gone
    cdef object broken
    cdef int owner_pid                  # the process that set it up (rdmamw/_fork.py)
    cdef bint lost_logged               # PeerLost is logged once, with its cause

    # my receive ring
    cdef char *ring
    cdef readonly uint32_t nslots
    cdef uint32_t stride
    cdef readonly uint32_t slot_size
    # the peer's ring, which I send into; staging mirrors it slot for slot
    cdef readonly uint32_t peer_nslots
    cdef uint32_t peer_stride
    cdef readonly uint32_t peer_slot_size
    cdef char *staging
    cdef uint64_t *ctrl
    cdef uint64_t send_seq
    cdef uint64_t recv_seq

    # send scratch, grown on demand, never per message
    cdef Py_buffer *bufs
    cdef char **ptrs
    cdef size_t *lens
    cdef uint8_t *held
    cdef uint32_t *plan_start
    cdef uint32_t *plan_used
    cdef uint16_t *plan_flags
    cdef uint32_t cap
    cdef uint64_t batch_bytes
    cdef uint32_t *alloc_tmp
    cdef rm_wr *wrs
    cdef uint32_t wr_cap
    cdef rm_wc wcs[64]
    cdef int reap_lock                  # wcs and what _reap updates: the send thread and a
                                        # receive thread waiting for its READ reap at once

    # receive state
    cdef uint32_t *pend
    cdef uint32_t *pend_d
    cdef uint32_t *order
    cdef uint32_t *ready
    cdef uint32_t ready_head
    cdef uint32_t ready_len
    cdef uint32_t *slot_refs
    cdef uint32_t cur_slot
    cdef uint32_t cur_left
    cdef uint32_t cur_off
    cdef uint32_t cur_used
    cdef uint16_t cur_flags
    cdef int64_t gap_since
    cdef uint32_t gap_pending           # slots pending behind the gap (they do not wake us)
    cdef uint32_t max_open
    cdef int64_t gap_timeout_ns

    # tuning
    cdef readonly uint32_t flush_threshold
    cdef int64_t spin_ns
    cdef int64_t last_peer_check

    # locks: one sender and one receiver at a time; `spin` guards posts and reclaim state
    cdef PyThread_type_lock send_lock
    cdef PyThread_type_lock recv_lock
    cdef int spin
    cdef uint64_t *words            # [0] = 0, [1] = 1: sources of control-word writes
    cdef uint32_t lkey_words, lkey_staging, lkey_arrival, lkey_reclaim, lkey_snap
    cdef uint64_t *snap             # SNAP_DEPTH copies of the arrival words (async transports)
    cdef bint credit_flag_set
    cdef bint sleep_flag_set

    # rendezvous, sending: entry e = index % RNDV_N keeps the source until its done bit
    cdef readonly str rendezvous        # "off", "read" or "write" (as resolved)
    cdef readonly uint64_t rndv_threshold
    cdef bint rndv_on, rndv_write
    cdef uint8_t *kind                  # per message of the batch: 1 = rendezvous
    cdef uint8_t *msg_entry             # ... its entry
    cdef uint32_t prep_i                # messages of the batch prepared (exposed) so far
    cdef uint64_t rndv_next             # rendezvous messages prepared (next index)
    cdef readonly uint64_t rndv_upto    # ... of which done (in order)
    cdef uint64_t rndv_released         # ... of which source released (GIL)
    cdef uint64_t rndv_shadow           # phase word I own; the peer's done word follows it
    cdef Py_buffer rndv_buf[64]
    cdef uint8_t rndv_held[64]
    cdef rm_mem rndv_mem[64]
    cdef rm_desc rndv_desc[64]
    cdef uint64_t rndv_waddr[64]        # DESC_WRITTEN: the advertised destination
    cdef uint32_t rndv_wkey[64]
    # registration caches (rdmamw.memory.regcache) of a transport that registers
    # memory (verbs: mr_register): a source or READ target is registered on first use,
    # and the entry's Lease is held until the transfer is over (done bit / READ done)
    cdef public object regcache         # sources the peer READs (or we WRITE from)
    cdef public object regcache_dst     # destinations we READ into (local access only)
    # a writable buffer of n bytes for a rendezvous message received without a posted
    # or given destination: the channel's pool (rdmamw.channel.rendezvous.allocate)
    cdef public object allocate
    cdef bint cache_ok                  # the transport's keys come from the caches
    cdef PyObject **lease_of            # per message of the batch: its Lease (owned)
    cdef uint32_t *lease_keys           # ... its lkey and rkey
    cdef PyObject *rndv_lease[64]       # per entry: the Lease of its source (owned)
    cdef int blocked_on                 # what _post_available ran out of (WAIT_*)
    # rendezvous, receiving
    cdef uint64_t rrndv_next            # next rendezvous index expected
    cdef uint32_t done_unflushed        # done bits flipped since the last write-back
    cdef object posted                  # deque of _Dest from post_recv, in index order
    cdef uint64_t *advsrc               # sources of advert writes (registered)
    cdef uint32_t lkey_adv
    cdef uint64_t max_msg               # the largest message this side takes
    cdef int64_t rx_until               # the running receive call's deadline (0: none)
    cdef _Dest rd_dst                   # a READ still in flight when a receive timed out:
    cdef object rd_lease                # its destination, the destination's lease or
    cdef rm_mem rd_mem                  # exposure, its descriptor, index + 1 (0: none),
    cdef rm_desc rd_desc                # and whether rd_dst is a recv_into buffer
    cdef uint64_t rd_want
    cdef bint rd_user
    cdef uint64_t n_rndv_refused
    cdef uint64_t rndv_read_done        # async transports: last READ completed (index + 1)
    cdef int rndv_read_status
    cdef uint64_t n_rndv_sends, n_rndv_writes, n_rndv_reads, n_rndv_bytes, n_rndv_recv
    cdef uint64_t n_done_wb, n_rndv_bytes_recv
    cdef uint64_t last_rndv_len

    # counters
    cdef uint64_t n_msgs_sent, n_bytes_sent, n_batches, n_slots_sent
    cdef uint64_t n_msgs_recv, n_bytes_recv, n_slots_recv
    cdef uint64_t n_reclaim_wb, n_credit_waits, n_arrival_waits
    cdef uint64_t batch_posted, batch_done

    def __cinit__(self, *args, **kwargs):
        self.send_lock = PyThread_allocate_lock()
        self.recv_lock = PyThread_allocate_lock()
        if self.send_lock == NULL or self.recv_lock == NULL:
            raise MemoryError()
        self.words = <uint64_t *>calloc(8, 8)
        if self.words == NULL:
            raise MemoryError()
        self.allocate = _fresh_buffer
        self.words[0] = 0
        self.words[1] = 1          # words[2]: the done bits of what I received (rendezvous)
        self.cur_slot = NONE
        self.closed = True      # until _setup succeeds
        self.owner_pid = _pid

    def _setup(self, Transport tp, uint32_t nslots, uint32_t slot_size, uint32_t peer_nslots,
               uint32_t peer_slot_size, str mode="batched", double spin_us=100.0,
               double gap_timeout=2.0, flush_fraction=0.25, str rendezvous="off",
               rndv_threshold=None, uint64_t max_message_size=1 << 30):
        """Wire the engine to a connected transport whose regions follow _layout.

        ``rendezvous`` is "off", "read" or "write" (rdmamw/channel/rendezvous.py resolves
        "auto"); messages above ``rndv_threshold`` (at most, and by default, the peer's
        slot_size) then go by rendezvous when the transport can expose memory. A
        rendezvous message above ``max_message_size`` is refused (MessageTooLarge); the
        limit is announced to the peer, whose sender then refuses it locally."""
        if mode not in MODES:
            raise ValueError(f"mode must be 'batched' or 'ack', not {mode!r}")
        if rendezvous not in ("off", "read", "write"):
            raise ValueError(f"rendezvous must be 'off', 'read' or 'write', not {rendezvous!r}")
        if rndv_threshold is not None and rndv_threshold < 0:
            raise ValueError("rndv_threshold must be >= 0")
        if not 0.0 < flush_fraction <= 1.0:
            raise ValueError("flush_fraction must be in (0, 1]")
        if max_message_size == 0:
            raise ValueError("max_message_size must be at least 1")
        layout.check_ring(nslots, slot_size)
        layout.check_ring(peer_nslots, peer_slot_size)
        self.tp = tp
        self.mode = mode
        self.ack = mode == "ack"
        self.nslots, self.slot_size = nslots, slot_size
        self.stride = layout.slot_stride(slot_size)
        self.peer_nslots, self.peer_slot_size = peer_nslots, peer_slot_size
        self.peer_stride = layout.slot_stride(peer_slot_size)
        if tp.local[RM_REGION_RING].length < <uint64_t>nslots * self.stride:
            raise ValueError("transport ring region is smaller than the ring")
        if tp.peer[RM_REGION_RING].length < <uint64_t>peer_nslots * self.peer_stride:
            raise ValueError("peer ring region is smaller than its ring")
        self.ring = tp.local[RM_REGION_RING].addr
        self.ctrl = <uint64_t *>tp.local[RM_REGION_CTRL].addr
        arrival = tp._region_view(RM_REGION_ARRIVAL)
        reclaim = tp._region_view(RM_REGION_RECLAIM)
        self.rbm = RecvBitmaps(nslots, arrival)
        self.sbm = SendBitmaps(peer_nslots, reclaim)
        cdef void *mem = NULL
        if posix_memalign(&mem, 4096, <size_t>peer_nslots * self.peer_stride) != 0:
            raise MemoryError()
        self.staging = <char *>mem
        self.alloc_tmp = <uint32_t *>malloc(4 * peer_nslots)
        self.pend = <uint32_t *>malloc(4 * nslots)
        self.pend_d = <uint32_t *>malloc(4 * nslots)
        self.order = <uint32_t *>malloc(4 * nslots)
        self.ready = <uint32_t *>malloc(4 * nslots)
        self.slot_refs = <uint32_t *>malloc(4 * nslots)
        if (self.alloc_tmp == NULL or self.pend == NULL or self.pend_d == NULL
                or self.order == NULL or self.ready == NULL or self.slot_refs == NULL):
            raise MemoryError()
        # everything a work request may read from must be known to the transport
        self.lkey_staging = tp.register_local(<size_t>self.staging,
                                              <size_t>peer_nslots * self.peer_stride)
        self.lkey_arrival = tp.register_local(<size_t>self.sbm.arrival, self.sbm.nwords * 8)
        self.lkey_reclaim = tp.register_local(<size_t>self.rbm.reclaim, self.rbm.nwords * 8)
        self.lkey_words = tp.register_local(<size_t>self.words, 64)
        self.rndv_on = rendezvous != "off" and tp.can_expose
        self.rndv_write = self.rndv_on and rendezvous == "write"
        self.rendezvous = rendezvous if self.rndv_on else "off"
        self.rndv_threshold = peer_slot_size if rndv_threshold is None else min(
            <uint64_t>rndv_threshold, peer_slot_size)
        import collections
        self.posted = collections.deque()
        if posix_memalign(&mem, 64, RNDV_N * 32) != 0:
            raise MemoryError()
        self.advsrc = <uint64_t *>mem
        memset(self.advsrc, 0, RNDV_N * 32)
        self.lkey_adv = tp.register_local(<size_t>self.advsrc, RNDV_N * 32)
        self.cache_ok = tp.registers_memory
        if not tp.synchronous:
            self.snap = <uint64_t *>calloc(SNAP_DEPTH * self.sbm.nwords, 8)
            if self.snap == NULL:
                raise MemoryError()
            self.lkey_snap = tp.register_local(<size_t>self.snap,
                                               SNAP_DEPTH * self.sbm.nwords * 8)
        memset(self.order, 0xFF, 4 * nslots)
        memset(self.slot_refs, 0, 4 * nslots)
        # per receive call: at most a quarter of the ring and about RECV_CALL_BYTES of
        # slots, so a caller holding the previous list never starves the sender and
        # big slots come back in small groups
        self.max_open = max(1, min(nslots // 4, RECV_CALL_BYTES // self.stride))
        # write releases back after a quarter of the ring, or sooner when slots are big
        self.flush_threshold = max(1, min(<uint32_t>(nslots * flush_fraction),
                                          FLUSH_BYTES // self.stride))
        if self.ack:
            self.flush_threshold = 1
        self.spin_ns = <int64_t>(spin_us * 1000.0)
        self.gap_timeout_ns = <int64_t>(gap_timeout * 1e9)
        self._grow(64)
        self.max_msg = min(max_message_size, MAX_WR_BYTES)
        self.words[3] = self.max_msg        # announce it in the peer's CTRL_MAX_MSG
        self._put_word(RM_REGION_CTRL, CTRL_MAX_MSG, &self.words[3])
        self.closed = False

    def __dealloc__(self):
        cdef uint32_t i
        if self.rd_want and self.rd_dst is not None:
            # dropped with a READ in flight: its destination must outlive the transport
            # (tcp's progress thread may still write into it), so it is leaked
            Py_XINCREF(<PyObject *>self.rd_dst)
        if not self.closed and self.tp is not None and not self.peer_gone \
                and self.owner_pid == _pid:
            # dropped without close(): still tell the peer it was a clean close
            self._put_word(RM_REGION_CTRL, CTRL_CLOSED, &self.words[1])
            rm_fence_seq_cst()
            self.tp.wake_peer()
        if self.bufs != NULL:
            free(self.bufs)
        free(self.ptrs); free(self.lens); free(self.held)
        free(self.plan_start); free(self.plan_used); free(self.plan_flags)
        for i in range(RNDV_N):
            if self.rndv_held[i]:
                PyBuffer_Release(&self.rndv_buf[i])
                self.rndv_held[i] = 0
            Py_XDECREF(self.rndv_lease[i])      # a Lease releases itself when it dies
            self.rndv_lease[i] = NULL
        for i in range(self.cap):
            Py_XDECREF(self.lease_of[i])
        free(self.lease_of); free(self.lease_keys)
        free(self.kind); free(self.msg_entry); free(self.advsrc)
        free(self.alloc_tmp); free(self.wrs); free(self.staging); free(self.words)
        free(self.snap)
        free(self.pend); free(self.pend_d); free(self.order); free(self.ready); free(self.slot_refs)
        if self.send_lock != NULL:
            PyThread_free_lock(self.send_lock)
        if self.recv_lock != NULL:
            PyThread_free_lock(self.recv_lock)

    cdef int _grow(self, uint32_t n) except -1:
        """Scratch for batches of n messages (amortised, never per message)."""
        if n <= self.cap:
            return 0
        cdef uint32_t c = max(n, 2 * self.cap)
        cdef void *p
        p = realloc(self.bufs, c * sizeof(Py_buffer));  self.bufs = <Py_buffer *>p if p else self.bufs
        if p == NULL: raise MemoryError()
        p = realloc(self.ptrs, c * sizeof(char *));  self.ptrs = <char **>p if p else self.ptrs
        if p == NULL: raise MemoryError()
        p = realloc(self.lens, c * sizeof(size_t));  self.lens = <size_t *>p if p else self.lens
        if p == NULL: raise MemoryError()
        p = realloc(self.held, c);  self.held = <uint8_t *>p if p else self.held
        if p == NULL: raise MemoryError()
        p = realloc(self.plan_start, c * 4);  self.plan_start = <uint32_t *>p if p else self.plan_start
        if p == NULL: raise MemoryError()
        p = realloc(self.plan_used, c * 4);  self.plan_used = <uint32_t *>p if p else self.plan_used
        if p == NULL: raise MemoryError()
        p = realloc(self.plan_flags, c * 2);  self.plan_flags = <uint16_t *>p if p else self.plan_flags
        if p == NULL: raise MemoryError()
        p = realloc(self.kind, c);  self.kind = <uint8_t *>p if p else self.kind
        if p == NULL: raise MemoryError()
        p = realloc(self.msg_entry, c);  self.msg_entry = <uint8_t *>p if p else self.msg_entry
        if p == NULL: raise MemoryError()
        p = realloc(self.lease_of, c * sizeof(PyObject *));  self.lease_of = <PyObject **>p if p else self.lease_of
        if p == NULL: raise MemoryError()
        memset(self.lease_of + self.cap, 0, (c - self.cap) * sizeof(PyObject *))
        p = realloc(self.lease_keys, c * 8);  self.lease_keys = <uint32_t *>p if p else self.lease_keys
        if p == NULL: raise MemoryError()
        p = realloc(self.wrs, (2 * c + 4) * sizeof(rm_wr));  self.wrs = <rm_wr *>p if p else self.wrs
        if p == NULL: raise MemoryError()
        self.cap = c
        self.wr_cap = 2 * c + 4
        return 0

    # ---- state checks -------------------------------------------------------------

    cdef int _check_owner(self) except -1:
        if self.owner_pid != _pid:
            _fork.refuse("channel", self.owner_pid)
        return 0

    cdef int _check_usable(self) except -1:
        if self.owner_pid != _pid:
            _fork.refuse("channel", self.owner_pid)
        if self.broken is not None:
            raise ProtocolError(self.broken)
        if self.closed:
            raise ChannelClosed("channel is closed")
        return 0

    cdef int _peer_status(self) noexcept nogil:
        """RM_OK while the peer is there; RM_ERR_CLOSED / RM_ERR_PEER_LOST after."""
        cdef int st
        if self.peer_gone:
            return RM_ERR_PEER_LOST
        if rm_load_acquire64(&self.ctrl[CTRL_CLOSED]):
            return RM_ERR_CLOSED
        st = self.tp.peer_state()
        if st == RM_ERR_CLOSED or rm_load_acquire64(&self.ctrl[CTRL_CLOSED]):
            return RM_ERR_CLOSED
        if st < 0:
            self.peer_gone = True
            return RM_ERR_PEER_LOST
        return RM_OK

    cdef int _peer_dying(self) noexcept nogil:
        """After a refused READ: is the peer dying? A process killed mid-READ may have
        its memory registrations torn down before its connection shows EOF (verbs: the
        NIC answers 'remote access error' and the QP fails), so while our connection is
        failed but the peer's end not yet seen closed, look for up to DYING_NS."""
        cdef int64_t until = now_ns() + DYING_NS
        while not self.tp.peer_exited():
            if self.tp.peer_state() >= 0 or now_ns() >= until:
                return RM_OK        # (a connection still up: the peer refused, alive)
            self.tp.wait(10)
        self.peer_gone = True
        return RM_ERR_PEER_LOST

    cdef int _raise_post(self, int rc) except -1:
        if rc == RM_ERR_BOUNDS:
            self.broken = "a work request fell outside the peer's registered regions"
            raise ProtocolError(self.broken)
        if rc == RM_ERR_CLOSED and self.closed:
            raise ChannelClosed("channel was closed during the send")
        if rc == RM_ERR_UNSUPPORTED or rc == RM_ERR_OS:
            raise MessageTooLarge(f"the transport could not expose a rendezvous source ({rc})")
        self.peer_gone = True
        raise PeerLost(self._lost(f"the transport failed the post ({rc})"))

    cdef int _raise_peer(self, int st, str where) except -1:
        if st == RM_ERR_CLOSED:
            raise ChannelClosed(f"peer closed the channel ({where})")
        raise PeerLost(self._lost(f"peer lost ({where})"))

    cdef str _lost(self, str what):
        """``what``, with the provider's account of the failure when it has one."""
        detail = self.tp.error_detail()
        msg = f"{what}: {detail}" if detail else what
        if not self.lost_logged:
            self.lost_logged = True
            _log.info("PeerLost on the channel with %s: %s", getattr(self, "peer", "?"), msg)
        return msg

    # ---- small posts: control words and reclaim write-back ------------------------

    cdef int _put_word(self, uint32_t region, uint32_t word, uint64_t *src) noexcept nogil:
        cdef rm_wr wr
        _fill_wr(&wr, src, self.lkey_words, region, word * 8, 8)
        return self.tp.post(&wr, 1)

    cdef int _flush_locked(self) noexcept nogil:
        """Write the changed reclaim words, and the rendezvous-done word, back to the
        sender (caller holds spin)."""
        cdef uint32_t lo, hi
        cdef rm_wr wr
        cdef int rc
        if self.done_unflushed:
            self.done_unflushed = 0
            self.n_done_wb += 1
            rc = self._put_word(RM_REGION_CTRL, CTRL_RNDV_DONE, &self.words[2])
            if not self.rbm.take_dirty(&lo, &hi):
                rm_fence_seq_cst()
                if rc == 0 and rm_load_acquire64(&self.ctrl[CTRL_CREDIT_WAIT]):
                    self.tp.wake_peer()
                return rc
        elif not self.rbm.take_dirty(&lo, &hi):
            return 0
        wr.wr_id = 0
        wr.local_addr = <uint64_t>&self.rbm.reclaim[lo]
        wr.remote_off = lo * 8
        wr.length = (hi - lo) * 8
        wr.lkey = self.lkey_reclaim
        wr.rkey = RM_REGION_RECLAIM
        wr.opcode = RM_WR_WRITE
        wr.flags = RM_WR_PUBLISH
        wr.imm = 0
        rc = self.tp.post(&wr, 1)
        self.n_reclaim_wb += 1
        rm_fence_seq_cst()
        if rc == 0 and rm_load_acquire64(&self.ctrl[CTRL_CREDIT_WAIT]):
            self.tp.wake_peer()
        return rc

    cdef inline bint _unflushed(self) noexcept nogil:
        return self.rbm.unflushed != 0 or self.done_unflushed != 0

    cdef int _flush(self) noexcept nogil:
        cdef int rc
        rm_spin_lock(&self.spin)
        rc = self._flush_locked()
        rm_spin_unlock(&self.spin)
        return rc

    cdef void _release_one(self, uint32_t slot) noexcept:
        """One message of ``slot`` is released; the slot goes back when all are."""
        if slot >= self.nslots or self.slot_refs[slot] == 0:
            return
        self.slot_refs[slot] -= 1
        if self.slot_refs[slot] or self.owner_pid != _pid:
            return          # in a fork child the slot is the parent's to give back
        rm_spin_lock(&self.spin)
        self.rbm.release(slot)
        if not self.closed and not self.peer_gone and (
                self.rbm.unflushed >= self.flush_threshold
                or rm_load_acquire64(&self.ctrl[CTRL_CREDIT_WAIT])):
            self._flush_locked()
        rm_spin_unlock(&self.spin)

    # ---- sending ------------------------------------------------------------------

    cdef int _acquire(self, object fast, Py_ssize_t n) except -1:
        cdef PyObject **items = PySequence_Fast_ITEMS(fast)
        cdef Py_ssize_t i
        cdef object item
        cdef size_t limit = self.peer_slot_size
        cdef bint rndv
        cdef uint64_t peer_max = rm_load_acquire64(&self.ctrl[CTRL_MAX_MSG])
        self.batch_bytes = 0
        for i in range(n):
            item = <object>items[i]
            self.kind[i] = 0
            if PyBytes_CheckExact(item) and not (
                    self.rndv_on and <uint64_t>PyBytes_GET_SIZE(item) > self.rndv_threshold):
                self.ptrs[i] = PyBytes_AS_STRING(item)
                self.lens[i] = <size_t>PyBytes_GET_SIZE(item)
                self.held[i] = 0
            else:
                try:
                    PyObject_GetBuffer(item, &self.bufs[i], PyBUF_C_CONTIGUOUS)
                except (TypeError, BufferError, ValueError) as e:
                    self._release_bufs(i)
                    raise TypeError(
                        f"message {i} ({type(item).__name__}) is not a C-contiguous "
                        f"bytes-like object; nothing was sent") from e
                self.held[i] = 1
                self.ptrs[i] = <char *>self.bufs[i].buf
                self.lens[i] = <size_t>self.bufs[i].len
            self.batch_bytes += self.lens[i]
            rndv = self.rndv_on and self.lens[i] > self.rndv_threshold
            if rndv and (self.lens[i] > MAX_WR_BYTES
                         or (self.tp.max_expose and self.lens[i] > self.tp.max_expose)):
                self._release_bufs(i + 1)
                raise MessageTooLarge(
                    f"message {i} is {self.lens[i]} bytes; rendezvous takes at most "
                    f"{min(MAX_WR_BYTES, self.tp.max_expose or MAX_WR_BYTES)} bytes here; "
                    f"nothing was sent")
            if rndv and peer_max and self.lens[i] > peer_max:
                self._release_bufs(i + 1)
                raise MessageTooLarge(
                    f"message {i} is {self.lens[i]} bytes; the peer takes at most "
                    f"{peer_max} (its max_message_size / RDMAMW_MAX_MESSAGE_SIZE); "
                    f"nothing was sent")
            if self.lens[i] > limit and not rndv:
                self._release_bufs(i + 1)
                raise MessageTooLarge(
                    f"message {i} is {self.lens[i]} bytes; the peer's eager limit is "
                    f"{limit} bytes (its slot_size) and rendezvous is "
                    f"{self.rendezvous}; nothing was sent")
            self.kind[i] = rndv
            if rndv and self.cache_ok and self.regcache is not None:
                try:
                    lease = self._lease(self.regcache, item)
                except BaseException:
                    self._release_bufs(i + 1)
                    raise
                self.lease_keys[2 * i] = lease.handle[1]
                self.lease_keys[2 * i + 1] = lease.handle[2]
                Py_XINCREF(<PyObject *>lease)
                self.lease_of[i] = <PyObject *>lease
        return 0

    cdef object _lease(self, object cache, object buf):
        """A Lease of ``cache`` on ``buf``: its owner is registered once, then reused;
        ``lease.handle`` is the transport's (mr, lkey, rkey). A refused registration
        first lets the idle cached ones go (they may be what exhausts the pinning
        limit)."""
        try:
            try:
                lease = cache.acquire(buf)
            except OSError:
                cache.clear()
                lease = cache.acquire(buf)
        except OSError as e:
            raise MessageTooLarge(f"the transport could not register a rendezvous buffer "
                                  f"({e}); nothing was sent") from e
        except RegistrationError as e:
            if self.closed:
                raise ChannelClosed("channel is closed") from e
            raise
        return lease

    cdef void _end_lease(self, PyObject *lease) noexcept:
        """Release a Lease taken by _lease and drop our reference (GIL held)."""
        cdef object obj = <object>lease
        Py_XDECREF(lease)
        _release_lease(obj)

    cdef void _release_bufs(self, Py_ssize_t n) noexcept:
        cdef Py_ssize_t i
        cdef PyObject *lease
        for i in range(n):
            if self.held[i]:
                PyBuffer_Release(&self.bufs[i])
                self.held[i] = 0
            if self.lease_of[i] != NULL:    # a source that was never handed to an entry
                lease = self.lease_of[i]
                self.lease_of[i] = NULL
                self._end_lease(lease)

    cdef uint32_t _plan(self, uint32_t n) noexcept nogil:
        """Assign messages to slots: greedy packing, a lone message as SINGLE."""
        cdef uint32_t k = 0, i = 0, start, used, rec, nr
        cdef uint32_t cap = self.peer_slot_size
        while i < n:
            start = i
            if self.ack or (not self.kind[i] and REC_HDR + pad8(<uint32_t>self.lens[i]) > cap):
                used = self._reclen(i)
                i += 1
            else:
                used = 0
                nr = 0      # a slot's descriptors must fit the entries: a quarter of them
                while i < n:
                    rec = self._reclen(i)
                    if rec > cap - used or (self.kind[i] and nr == RNDV_N // 4):
                        break
                    nr += self.kind[i]
                    used += rec
                    i += 1
            self.plan_start[k] = start
            if i - start == 1 and not self.kind[start]:
                self.plan_flags[k] = SLOT_SINGLE
                self.plan_used[k] = <uint32_t>self.lens[start]
            else:
                self.plan_flags[k] = SLOT_PACKED
                self.plan_used[k] = used
            k += 1
        self.plan_start[k] = n
        return k

    cdef inline uint32_t _reclen(self, uint32_t i) noexcept nogil:
        """Bytes of message i's record in a PACKED slot (a descriptor if rendezvous)."""
        if self.kind[i]:
            return REC_HDR + DESC_BYTES
        return REC_HDR + pad8(<uint32_t>self.lens[i])

    cdef uint32_t _build_slot(self, uint32_t k, uint32_t slot, uint32_t nw) noexcept nogil:
        """Fill staging for planned slot k going to peer slot ``slot``; append its WRs."""
        cdef char *st = self.staging + <size_t>slot * self.peer_stride
        cdef rm_slot_hdr *h = <rm_slot_hdr *>st
        cdef uint32_t i, first = self.plan_start[k], last = self.plan_start[k + 1]
        cdef uint32_t off, L
        cdef char *p
        cdef rm_wr *wr
        h.seq = self.send_seq
        h.used = self.plan_used[k]
        h.count = <uint16_t>(last - first)
        h.flags = self.plan_flags[k]
        h.check = ~(<uint32_t>self.send_seq)
        h.reserved = 0
        self.send_seq += 1
        if self.plan_flags[k] == SLOT_PACKED:
            p = st + SLOT_HEADER
            for i in range(first, last):
                if self.kind[i]:
                    nw = self._desc_record(i, p, nw)
                    p += REC_HDR + DESC_BYTES
                    continue
                L = <uint32_t>self.lens[i]
                (<uint32_t *>p)[0] = L
                (<uint32_t *>p)[1] = 0
                rm_copy(p + REC_HDR, self.ptrs[i], L)
                p += REC_HDR + pad8(L)
            wr = &self.wrs[nw]
            wr.wr_id = 0
            wr.local_addr = <uint64_t>st
            wr.remote_off = <uint64_t>slot * self.peer_stride
            wr.length = SLOT_HEADER + self.plan_used[k]
            wr.lkey = self.lkey_staging
            wr.rkey = RM_REGION_RING
            wr.opcode = RM_WR_WRITE
            wr.flags = 0
            wr.imm = 0
            return nw + 1
        # SINGLE: the payload goes straight from the user's buffer when the provider
        # can read it (shm), else through the staging slot; the header is inline.
        L = self.plan_used[k]
        wr = &self.wrs[nw]
        wr.wr_id = 0
        wr.remote_off = <uint64_t>slot * self.peer_stride
        wr.lkey = self.lkey_staging
        wr.rkey = RM_REGION_RING
        wr.opcode = RM_WR_WRITE
        wr.imm = 0
        if L == 0:
            wr.local_addr = <uint64_t>st
            wr.length = HDR_BYTES
            wr.flags = RM_WR_INLINE
            return nw + 1
        if not self.tp.direct_source:
            memcpy(st + SLOT_HEADER, self.ptrs[first], L)
            wr.local_addr = <uint64_t>st
            wr.length = SLOT_HEADER + L
            wr.flags = 0
            return nw + 1
        wr.local_addr = <uint64_t>self.ptrs[first]
        wr.remote_off += SLOT_HEADER
        wr.length = L
        wr.flags = 0
        wr = &self.wrs[nw + 1]
        wr.wr_id = 0
        wr.local_addr = <uint64_t>st
        wr.remote_off = <uint64_t>slot * self.peer_stride
        wr.length = HDR_BYTES
        wr.lkey = self.lkey_staging
        wr.rkey = RM_REGION_RING
        wr.opcode = RM_WR_WRITE
        wr.flags = RM_WR_INLINE
        wr.imm = 0
        return nw + 2

    cdef uint32_t _desc_record(self, uint32_t i, char *p, uint32_t nw) noexcept nogil:
        """Write message i's descriptor record at p; a message going to an advertised
        destination gets its data WRITE first in the chain (RC order, frame order)."""
        cdef uint8_t e = self.msg_entry[i]
        cdef rm_wr *wr
        (<uint32_t *>p)[0] = DESC_BYTES
        (<uint32_t *>p)[1] = REC_RNDV
        memcpy(p + REC_HDR, &self.rndv_desc[e], DESC_BYTES)
        if self.rndv_desc[e].kind != DESC_WRITTEN:
            return nw
        wr = &self.wrs[nw]
        wr.wr_id = 0
        wr.local_addr = <uint64_t>self.ptrs[i]
        wr.remote_off = self.rndv_waddr[e]
        wr.length = <uint32_t>self.lens[i]
        wr.lkey = self.rndv_mem[e].lkey
        wr.rkey = self.rndv_wkey[e]
        wr.opcode = RM_WR_WRITE
        wr.flags = RM_WR_EXPOSED
        wr.imm = 0
        return nw + 1

    cdef uint32_t _arrival_wrs(self, uint32_t nw) noexcept nogil:
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
        if not self.tp.synchronous:
            entry = (self.batch_posted + 1) % SNAP_DEPTH
            oldest = self.batch_posted + 1 - SNAP_DEPTH if self.batch_posted + 1 > SNAP_DEPTH else 0
            while self.batch_done < oldest and not self.peer_gone:
                self._reap()              # that entry's WRITE has not completed yet
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

    cdef int _post_slots(self, uint32_t k0, uint32_t got) noexcept nogil:
        """Post planned slots k0..k0+got (already allocated into alloc_tmp) as one
        chain: slot writes, then arrival words; only the last WR is signaled."""
        cdef uint32_t j, nw = 0
        cdef int rc, polled
        for j in range(got):
            nw = self._build_slot(k0 + j, self.alloc_tmp[j], nw)
        nw = self._arrival_wrs(nw)
        # one signaled WR per post: per batch in batched mode, per message in ack mode
        self.wrs[nw - 1].flags |= RM_WR_SIGNALED
        self.batch_posted += 1
        self.wrs[nw - 1].wr_id = self.batch_posted
        rm_spin_lock(&self.spin)
        rc = self.tp.post(self.wrs, nw)
        rm_spin_unlock(&self.spin)
        if rc != 0:
            return rc
        self._reap()
        rm_fence_seq_cst()
        if rm_load_acquire64(&self.ctrl[CTRL_RX_SLEEP]):
            self.tp.wake_peer()
        return 0

    cdef void _reap(self) noexcept nogil:
        cdef int i, k
        rm_spin_lock(&self.reap_lock)
        while True:
            k = self.tp.poll(self.wcs, 64)
            if k <= 0:
                break
            for i in range(k):
                if self.wcs[i].wr_id & RNDV_WRID:        # a rendezvous READ (receiver)
                    self.rndv_read_status = self.wcs[i].status
                    self.rndv_read_done = self.wcs[i].wr_id & ~RNDV_WRID
                    continue
                if self.wcs[i].status != 0:
                    self.peer_gone = True
                if self.wcs[i].wr_id > self.batch_done:
                    self.batch_done = self.wcs[i].wr_id
        rm_spin_unlock(&self.reap_lock)

    cdef bint _poll_done(self, uint64_t batch) noexcept:
        if self.batch_done < batch:
            with nogil:
                self._reap()
        return self.batch_done >= batch

    cdef bint _credit_ready(self, int what, uint64_t target) noexcept nogil:
        if what == WAIT_SLOTS:
            return self.sbm.count_free() != 0
        self._rndv_reap()
        if what == WAIT_ENTRY:
            return self.rndv_upto > self.rndv_released
        return self.rndv_upto >= target

    cdef int _wait_credit(self, int64_t until, bint spin, int what=WAIT_SLOTS,
                          uint64_t target=0) noexcept nogil:
        """Spin, then sleep, until a slot is free (WAIT_SLOTS), a rendezvous entry can be
        recycled (WAIT_ENTRY) or rendezvous ``target`` is done (WAIT_DONE): 1; ``until``
        passes: 0; the peer goes: <0. While asleep a flag in the peer's control words
        asks it to write its reclaim and done words back now."""
        cdef int64_t t = now_ns(), spin_end = t + (self.spin_ns if spin else 0)
        cdef int64_t next_check = t + PEER_CHECK_NS
        cdef int st, r
        cdef uint32_t i
        if spin:
            self.n_credit_waits += 1
        while True:
            if self._credit_ready(what, target):
                return 1
            if self.tp.assist() == 0:
                for i in range(64):
                    rm_cpu_relax()
            t = now_ns()
            if t >= next_check:
                st = self._peer_status()
                if st < 0:
                    return st
                next_check = t + PEER_CHECK_NS
            if t >= spin_end or t >= until:
                break
        rm_spin_lock(&self.spin)
        if not self.credit_flag_set:
            self._put_word(RM_REGION_CTRL, CTRL_CREDIT_WAIT, &self.words[1])
            self.credit_flag_set = True
        rm_spin_unlock(&self.spin)
        rm_fence_seq_cst()
        self.tp.wake_peer()
        while True:
            if self._credit_ready(what, target):
                r = 1
                break
            st = self._peer_status()
            if st < 0:
                r = st
                break
            t = now_ns()
            if t >= until:
                r = 0
                break
            self.tp.n_sleeps += 1
            st = self.tp.wait(<int>((until - t) // 1000000) + 1)
            if st < 0 and st != RM_ERR_CLOSED:
                st = self._peer_status()
                if st < 0:
                    r = st
                    break
        self._clear_credit_flag()
        return r

    cdef void _clear_credit_flag(self) noexcept nogil:
        rm_spin_lock(&self.spin)
        if self.credit_flag_set:
            self._put_word(RM_REGION_CTRL, CTRL_CREDIT_WAIT, &self.words[0])
            self.credit_flag_set = False
        rm_spin_unlock(&self.spin)

    cdef int _lock(self, PyThread_type_lock lock) except -1:
        if not PyThread_acquire_lock(lock, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(lock, WAIT_LOCK)
        return 0

    def send_batch(self, msgs, timeout=None) -> SendHandle:
        """Send every message of ``msgs`` (bytes-like objects, numpy arrays, ...) in
        order, as few chained work-request lists as the free slots allow.

        Either the whole batch is accepted or, on a bad item (``TypeError``) or an
        oversized one (``MessageTooLarge``), nothing is sent. If the ring stays full
        past ``timeout``, :class:`Timeout` says how many messages went (``.sent``)."""
        if isinstance(msgs, (bytes, bytearray, memoryview, str)):
            raise TypeError("send_batch takes an iterable of messages; use send() for one")
        return self._send(msgs if type(msgs) is tuple else tuple(msgs), timeout)

    def send(self, msg, timeout=None) -> SendHandle:
        """Send one message (a batch of one)."""
        return self._send((msg,), timeout)

    cdef SendHandle _send(self, tuple fast, object timeout):
        cdef Py_ssize_t n
        cdef int64_t deadline
        cdef uint32_t nplan = 0, k = 0, got
        cdef bint first_wait = True
        cdef int rc = 0, st
        cdef SendHandle h
        n = PyTuple_GET_SIZE(fast)
        self._check_usable()
        if n >= 0xFFFF0000:
            raise ValueError("batch too large")
        deadline = _deadline(timeout)
        if self.peer_gone or rm_load_acquire64(&self.ctrl[CTRL_CLOSED]):
            self._raise_peer(self._peer_status(), "send")
        self._lock(self.send_lock)
        try:
            self._grow(<uint32_t>n + 1)
            self._acquire(fast, n)
            self.prep_i = 0
            if self.rndv_released < self.rndv_next:
                self._rndv_poll(self.rndv_next)
            if self.done_unflushed:     # done bits of what we received ride along
                self._flush()
            try:
                # tiny batches cost less than a GIL release; big copies run without it
                if self.batch_bytes >= NOGIL_BYTES:
                    with nogil:
                        nplan = self._plan(<uint32_t>n)
                        k = self._post_available(0, nplan, &rc)
                else:
                    nplan = self._plan(<uint32_t>n)
                    k = self._post_available(0, nplan, &rc)
                while k < nplan or rc:
                    if rc != 0:
                        self._raise_post(rc)
                    # ring full (or no rendezvous entry): wait for reclaim (done) bits,
                    # a slice at a time (signals)
                    with nogil:
                        st = self._wait_credit(self._slice_end(deadline), first_wait,
                                               self.blocked_on)
                    first_wait = False
                    self._rndv_poll(self.rndv_next)
                    if st < 0:
                        self._raise_peer(st, "waiting for free slots")
                    if st == 0:
                        PyErr_CheckSignals()
                        if deadline and now_ns() >= deadline:
                            raise Timeout(
                                f"ring full for the whole timeout; {self.plan_start[k]} of "
                                f"{n} messages sent", sent=self.plan_start[k])
                        continue
                    with nogil:
                        got = self._post_available(k, nplan, &rc)
                    if got > k:
                        first_wait = True
                    k = got
            finally:
                if nplan and self.prep_i > self.plan_start[k]:
                    self._unprepare(self.plan_start[k])
                self._release_bufs(n)
            self._count_sent(n, nplan)
        finally:
            PyThread_release_lock(self.send_lock)
        h = SendHandle.__new__(SendHandle)
        h.eng = self
        h.batch = self.batch_posted
        h.count = n
        h.rndv = self.rndv_next
        return h

    cdef uint32_t _post_available(self, uint32_t k, uint32_t nplan, int *rc) noexcept nogil:
        """Post planned slots from k on while free slots last; return the new k."""
        cdef uint32_t got, want
        rc[0] = 0
        self.blocked_on = WAIT_SLOTS
        while k < nplan:
            want = 1 if self.ack else nplan - k
            if self.prep_i < self.plan_start[k + want]:
                want = self._prepare_rndv(k, want, rc)
                if rc[0] != 0:
                    break
                if want == 0:
                    self.blocked_on = WAIT_ENTRY
                    break
            got = self.sbm.alloc(want, self.alloc_tmp)
            if got == 0:
                break
            rc[0] = self._post_slots(k, got)
            if rc[0] != 0:
                break
            k += got
        return k

    # ---- rendezvous, sending side --------------------------------------------------

    cdef uint32_t _prepare_rndv(self, uint32_t k, uint32_t want, int *rc) noexcept nogil:
        """Expose the rendezvous messages of planned slots k..k+want in order while
        entries (and the provider) allow; return how many of those slots are ready."""
        cdef uint32_t end = self.plan_start[k + want], s = 0
        cdef int r
        while self.prep_i < end:
            if self.kind[self.prep_i]:
                if self.rndv_next - self.rndv_released >= RNDV_N:
                    break
                r = self._rndv_prepare(self.prep_i)
                if r == RM_ERR_AGAIN:
                    break
                if r != 0:
                    rc[0] = r
                    break
            self.prep_i += 1
        while s < want and self.plan_start[k + s + 1] <= self.prep_i:
            s += 1
        return s

    cdef int _rndv_prepare(self, uint32_t i) noexcept nogil:
        """Give message i the next rendezvous entry: WRITTEN into the destination the
        receiver advertised for this index if it fits, else exposed for its READ."""
        cdef uint64_t j = self.rndv_next
        cdef uint8_t e = <uint8_t>(j % RNDV_N)
        cdef uint64_t *adv = self.ctrl + CTRL_ADVERT + 4 * e
        cdef uint64_t L = self.lens[i]
        cdef bint written = False
        cdef rm_mem mem
        cdef rm_desc *d = &self.rndv_desc[e]
        cdef int rc
        if self.rndv_write and rm_load_acquire64(&adv[3]) == j + 1 and adv[1] >= L:
            written = True
            self.rndv_waddr[e] = adv[0]
            self.rndv_wkey[e] = <uint32_t>adv[2]
        if self.lease_of[i] != NULL:        # registered by the cache (remote read)
            mem.handle = 0
            mem.lkey = self.lease_keys[2 * i]
            mem.rkey = self.lease_keys[2 * i + 1]
        else:
            rc = self.tp.expose(<uint64_t>self.ptrs[i], L,
                                RM_ACCESS_LOCAL if written else RM_ACCESS_REMOTE_READ, &mem)
            if rc != 0:
                return rc
        self.rndv_lease[e] = self.lease_of[i]   # the entry holds it until the done bit
        self.lease_of[i] = NULL
        d.addr = 0 if written else <uint64_t>self.ptrs[i]
        d.length = L
        d.index = j
        d.key = 0 if written else mem.rkey
        d.kind = DESC_WRITTEN if written else DESC_READ
        d.entry = e
        self.rndv_mem[e] = mem
        self.rndv_buf[e] = self.bufs[i]     # the entry keeps the source alive until done
        self.held[i] = 0
        self.rndv_held[e] = 1
        self.msg_entry[i] = e
        self.rndv_shadow ^= (<uint64_t>1) << e
        self.rndv_next += 1
        self.n_rndv_sends += 1
        self.n_rndv_bytes += L
        if written:
            self.n_rndv_writes += 1
        return 0

    cdef void _unprepare(self, uint32_t first) noexcept:
        """Undo the preparation of messages first.. that were not posted (timeout)."""
        cdef uint32_t i = self.prep_i
        cdef uint8_t e
        while i > first:
            i -= 1
            if not self.kind[i] or self.held[i]:
                continue
            e = self.msg_entry[i]
            self.tp.unexpose(self.rndv_mem[e].handle)
            self.rndv_mem[e].handle = 0
            self.lease_of[i] = self.rndv_lease[e]
            self.rndv_lease[e] = NULL
            self.bufs[i] = self.rndv_buf[e]
            self.held[i] = 1
            self.rndv_held[e] = 0
            self.rndv_shadow ^= (<uint64_t>1) << e
            self.rndv_next -= 1
            self.n_rndv_sends -= 1
            self.n_rndv_bytes -= self.lens[i]
            if self.rndv_desc[e].kind == DESC_WRITTEN:
                self.n_rndv_writes -= 1
        self.prep_i = first

    cdef void _rndv_reap(self) noexcept nogil:
        """Advance rndv_upto over the entries whose done bit came back (in order)."""
        cdef uint64_t done = rm_load_acquire64(&self.ctrl[CTRL_RNDV_DONE])
        cdef uint64_t diff = done ^ self.rndv_shadow
        while self.rndv_upto < self.rndv_next and not (diff >> (self.rndv_upto % RNDV_N)) & 1:
            self.rndv_upto += 1

    cdef void _rndv_release(self) noexcept:
        """Un-expose and let go of the sources of done rendezvous messages. An entry is
        taken whole before anything that may run Python code (a buffer's release, the
        cache's lock): another thread may come in then, and must find it gone."""
        cdef uint8_t e
        cdef Py_buffer b
        cdef bint held
        cdef PyObject *lease
        while self.rndv_released < self.rndv_upto:
            e = <uint8_t>(self.rndv_released % RNDV_N)
            self.tp.unexpose(self.rndv_mem[e].handle)
            self.rndv_mem[e].handle = 0
            held = self.rndv_held[e]
            self.rndv_held[e] = 0
            b = self.rndv_buf[e]
            lease = self.rndv_lease[e]
            self.rndv_lease[e] = NULL
            self.rndv_released += 1
            if held:
                PyBuffer_Release(&b)
            if lease != NULL:           # the MR stays cached; only the lease ends
                self._end_lease(lease)

    cdef bint _rndv_poll(self, uint64_t target) noexcept:
        if self.rndv_released < target:
            self._rndv_reap()
            self._rndv_release()
        return self.rndv_released >= target

    cdef void _count_sent(self, Py_ssize_t n, uint32_t nplan) noexcept:
        self.n_msgs_sent += n
        self.n_bytes_sent += self.batch_bytes
        self.n_slots_sent += nplan
        self.n_batches += 1

    cdef int64_t _slice_end(self, int64_t deadline) noexcept nogil:
        cdef int64_t t = now_ns() + SLICE_NS
        if deadline and deadline < t:
            return deadline
        return t

    # ---- receiving ----------------------------------------------------------------

    cdef int _fail(self, str why) except -1:
        self.broken = why
        raise ProtocolError(why)

    cdef int _fill_ready(self) except -1:
        """Move arrived slots, in sequence order, to the ready queue."""
        cdef uint32_t k, i, j, s, d, delivered = 0
        cdef rm_slot_hdr *h
        cdef uint64_t seq
        cdef uint32_t check
        cdef int64_t t
        k = self.rbm.pending(self.pend, self.nslots)
        if k == 0:
            self.gap_since = 0
            return 0
        for j in range(k):
            s = self.pend[j]
            h = <rm_slot_hdr *>(self.ring + <size_t>s * self.stride)
            seq = (<volatile uint64_t *>&h.seq)[0]
            check = (<volatile uint32_t *>&h.check)[0]
            d = <uint32_t>(seq - self.recv_seq) if seq - self.recv_seq < self.nslots else NONE
            if d == NONE or check != <uint32_t>~(<uint32_t>seq) or self.order[d] != NONE:
                for i in range(j):
                    self.order[self.pend_d[i]] = NONE
                self._fail(f"slot {s} carries sequence number {seq} (check {check:#x}); "
                           f"expected one of {self.recv_seq}..{self.recv_seq + self.nslots - 1}, "
                           f"each once")
            self.order[d] = s
            self.pend_d[j] = d
        while delivered < self.nslots and self.order[delivered] != NONE:
            s = self.order[delivered]
            self.ready[(self.ready_head + self.ready_len) % self.nslots] = s
            self.ready_len += 1
            self.rbm.consume(s)
            delivered += 1
        for j in range(k):
            self.order[self.pend_d[j]] = NONE
        self.recv_seq += delivered
        if delivered:
            self.gap_since = 0
        else:
            t = now_ns()
            self.gap_pending = k
            if self.gap_since == 0:
                self.gap_since = t
            elif t - self.gap_since > self.gap_timeout_ns:
                self._fail(f"sequence number {self.recv_seq} never arrived while later "
                           f"slots did")
        return delivered

    cdef int _open_slot(self) except -1:
        cdef uint32_t s = self.ready[self.ready_head]
        cdef rm_slot_hdr h = (<rm_slot_hdr *>(self.ring + <size_t>s * self.stride))[0]
        self.ready_head = (self.ready_head + 1) % self.nslots
        self.ready_len -= 1
        if h.used > self.slot_size or h.count == 0 or not (
                (h.flags == SLOT_SINGLE and h.count == 1)
                or (h.flags == SLOT_PACKED and <uint64_t>h.count * REC_HDR <= h.used)):
            self._fail(f"slot {s} (seq {h.seq}) has a malformed header: used={h.used} "
                       f"count={h.count} flags={h.flags}")
        self.cur_slot = s
        self.cur_left = h.count
        self.cur_off = 0
        self.cur_used = h.used
        self.cur_flags = h.flags
        self.slot_refs[s] = h.count
        return 0

    cdef int _peek(self, char **pbase, uint32_t *plen, uint32_t *pflags) except -1:
        """Point at the next message without consuming it: 1 if there is one, else 0."""
        cdef char *base
        cdef uint32_t L, fl = 0
        if self.cur_left == 0:
            if self.ready_len == 0:
                self._fill_ready()
                if self.ready_len == 0:
                    return 0
            self._open_slot()
        base = self.ring + <size_t>self.cur_slot * self.stride + SLOT_HEADER
        if self.cur_flags == SLOT_SINGLE:
            L = self.cur_used
        else:
            if self.cur_off + REC_HDR > self.cur_used:
                self._fail(f"slot {self.cur_slot}: record {self.cur_off} past used bytes")
            L = (<volatile uint32_t *>(base + self.cur_off))[0]
            fl = (<volatile uint32_t *>(base + self.cur_off))[1]
            if L > self.cur_used - self.cur_off - REC_HDR:
                self._fail(f"slot {self.cur_slot}: record of {L} bytes overruns the slot")
            if fl > REC_RNDV or (fl == REC_RNDV and L != DESC_BYTES):
                self._fail(f"slot {self.cur_slot}: record flags {fl} with {L} bytes")
            base += self.cur_off + REC_HDR
        pbase[0] = base
        plen[0] = L
        pflags[0] = fl
        return 1

    cdef void _advance(self, uint32_t L, uint64_t nbytes) noexcept:
        """The message _peek pointed at is consumed."""
        if self.cur_flags != SLOT_SINGLE:
            self.cur_off += REC_HDR + pad8(L)
        self.cur_left -= 1
        self.n_msgs_recv += 1
        self.n_bytes_recv += nbytes
        if self.cur_left == 0:
            self.n_slots_recv += 1

    cdef Py_ssize_t _deliver(self, list out, Py_ssize_t maxn) except -1:
        cdef Py_ssize_t got = 0
        cdef char *base
        cdef uint32_t L, fl, opened = 0, slot
        cdef Message m
        cdef _Dest dst
        while got < maxn:
            if self.cur_left == 0:
                # a bounded share of the ring per call: a caller that still holds the
                # previous list while waiting for the next one never starves the sender
                if opened >= self.max_open:
                    break
                opened += 1
            if not self._peek(&base, &L, &fl):
                break
            if fl == REC_RNDV:
                if got:         # a failing READ must not take earlier messages with it
                    break
                dst = self._rndv_receive(base, None)
                m = Message.__new__(Message)
                m.eng = self
                m.ptr = <char *>dst.view.buf
                m.length = <Py_ssize_t>self.last_rndv_len
                m.slot = NONE
                m.owner = dst
                slot = self.cur_slot
                self._advance(L, self.last_rndv_len)
                self._release_one(slot)
            else:
                m = Message.__new__(Message)
                m.eng = self
                m.ptr = base
                m.length = L
                m.slot = self.cur_slot
                self._advance(L, L)
            out.append(m)
            got += 1
        return got

    cdef Py_ssize_t _deliver_into(self, _Dest into) except -2:
        """The next message into ``into``: its length, or -1 if none has arrived."""
        cdef char *base
        cdef uint32_t L, fl, slot
        cdef uint64_t n
        if not self._peek(&base, &L, &fl):
            return -1
        if fl == REC_RNDV:
            self._rndv_receive(base, into)
            n = self.last_rndv_len
        else:
            if L > <uint64_t>into.view.len:
                raise BufferTooSmall(f"the next message is {L} bytes; the buffer holds "
                                     f"{into.view.len}", needed=L)
            memcpy(into.view.buf, base, L)
            n = L
        slot = self.cur_slot
        self._advance(L, n)
        self._release_one(slot)
        return <Py_ssize_t>n

    # ---- rendezvous, receiving side ------------------------------------------------

    cdef _Dest _rndv_receive(self, char *base, _Dest into):
        """Bring the rendezvous message described at ``base`` into ``into``, its posted
        destination, or a new one; flip its done bit. On any error nothing is
        consumed: the message stays receivable (or the channel is broken), except a
        message above max_message_size, which is refused (see _refuse)."""
        cdef rm_desc d
        cdef _Dest dst, posted = None
        memcpy(&d, base, DESC_BYTES)    # read once: the peer may rewrite the slot
        self._check_desc(&d)
        if self.posted and (<_Dest>self.posted[0]).index == d.index:
            posted = self.posted[0]
        if d.length > self.max_msg:
            self._refuse(&d, posted)
        if d.kind == DESC_WRITTEN and (posted is None or not posted.advertised
                                       or <uint64_t>posted.view.len < d.length):
            self._fail(f"rendezvous {d.index} claims to be written into a destination "
                       f"this side did not advertise (or that is too small)")
        if into is not None and posted is not None:
            raise ValueError(f"rendezvous message {d.index} goes to the buffer posted "
                             f"for it with post_recv; receive it with recv/recv_batch")
        if self.rd_want:
            dst = self._resume_read(&d, into, posted)
        else:
            dst = into if into is not None else posted
            if dst is None:
                dst = _dest(self.allocate(d.length))
            self._check_room(dst, posted, &d)
            if d.kind == DESC_READ:
                self._read_into(dst, &d, into is not None)
                self.n_rndv_reads += 1
        if posted is not None:
            self._drop_posted()
        self.n_rndv_recv += 1
        self.n_rndv_bytes_recv += d.length
        self.last_rndv_len = d.length
        self._rndv_consumed(&d)
        return dst

    cdef int _check_room(self, _Dest dst, _Dest posted, rm_desc *d) except -1:
        """BufferTooSmall (the message stays) unless ``dst`` holds the message."""
        if <uint64_t>dst.view.len < d.length:
            if dst is posted:           # hand the posted buffer back; the message stays
                self._drop_posted()
            raise BufferTooSmall(f"the next message is {d.length} bytes; the "
                                 f"{'posted ' if dst is posted else ''}buffer holds "
                                 f"{dst.view.len}", needed=d.length)
        return 0

    cdef void _rndv_consumed(self, rm_desc *d) noexcept:
        """Message ``d.index`` is taken out of the stream: flip its done bit (the sender
        may release its source)."""
        self.rrndv_next += 1
        rm_spin_lock(&self.spin)
        self.words[2] ^= (<uint64_t>1) << d.entry
        self.done_unflushed += 1
        if not self.closed and not self.peer_gone and (
                rm_load_acquire64(&self.ctrl[CTRL_CREDIT_WAIT])):
            self._flush_locked()
        rm_spin_unlock(&self.spin)

    cdef int _refuse(self, rm_desc *d, _Dest posted) except -1:
        """A message above max_message_size: consume its record without allocating or
        reading anything, tell the sender it is done with it, raise MessageTooLarge
        once. The channel goes on with the next message."""
        cdef uint32_t slot = self.cur_slot
        if posted is not None:
            self._drop_posted()
        self._rndv_consumed(d)
        self.n_rndv_refused += 1
        self._advance(DESC_BYTES, 0)
        self._release_one(slot)
        if not self.closed and not self.peer_gone:
            self._flush()
        raise MessageTooLarge(f"the peer sent rendezvous message {d.index} of {d.length} "
                              f"bytes; this channel takes at most {self.max_msg} bytes "
                              f"(max_message_size / RDMAMW_MAX_MESSAGE_SIZE): it was "
                              f"refused unread; the next message follows")

    cdef int _check_desc(self, rm_desc *d) except -1:
        if d.kind != DESC_READ and d.kind != DESC_WRITTEN:
            self._fail(f"rendezvous descriptor of unknown kind {d.kind}")
        if d.index != self.rrndv_next or d.entry != d.index % RNDV_N:
            self._fail(f"rendezvous descriptor {d.index} (entry {d.entry}); expected "
                       f"{self.rrndv_next}")
        if d.length == 0 or d.length > MAX_WR_BYTES:
            self._fail(f"rendezvous descriptor of {d.length} bytes")
        return 0

    cdef int _read_into(self, _Dest dst, rm_desc *d, bint user) except -1:
        """READ the described message into ``dst``: through a cached registration of
        its owner when the transport registers memory (a pooled or reused buffer is then
        registered once), else exposed for this READ only. On an asynchronous READ that
        outlives the receive's deadline, Timeout: the READ stays in flight (rd_*) and
        the next receive call finishes it (_resume_read)."""
        cdef int rc
        cdef rm_mem mem
        cdef rm_wr wr
        cdef bint wait = not self.tp.synchronous or self.tp.async_read
        cdef bint registered = False
        lease = None
        mem.handle = 0
        mem.lkey = 0
        if self.cache_ok and self.regcache_dst is not None:
            try:
                lease = self._lease(self.regcache_dst, dst.obj)
            except MessageTooLarge as e:
                raise ProtocolError(f"cannot register the destination of rendezvous "
                                    f"message {d.index}: {e.__cause__}") from e
            mem.lkey = lease.handle[1]
            registered = True
        wr.wr_id = RNDV_WRID | (d.index + 1)
        wr.local_addr = <uint64_t>dst.view.buf
        wr.remote_off = d.addr
        wr.length = <uint32_t>d.length
        wr.rkey = d.key
        wr.opcode = RM_WR_READ
        wr.flags = RM_WR_EXPOSED | RM_WR_SIGNALED if wait else RM_WR_EXPOSED
        wr.imm = 0
        with nogil:
            rc = 0 if registered else self.tp.expose(
                wr.local_addr, d.length, RM_ACCESS_LOCAL, &mem)
            if rc == 0:
                wr.lkey = mem.lkey
                rc = self.tp.post(&wr, 1)
        if rc != 0 or not wait:
            self.tp.unexpose(mem.handle)
            if lease is not None:
                _release_lease(lease)
            if rc != 0:
                self._raise_read(rc, d)
            return 0
        self.rd_dst, self.rd_lease, self.rd_mem = dst, lease, mem
        self.rd_desc, self.rd_want, self.rd_user = d[0], d.index + 1, user
        return self._wait_read()

    cdef _Dest _resume_read(self, rm_desc *d, _Dest into, _Dest posted):
        """Finish the READ an earlier receive left in flight; the message lands where
        this call says (copied there if that is not where it was being read)."""
        cdef _Dest src = self.rd_dst, dst
        if memcmp(d, &self.rd_desc, DESC_BYTES) != 0:
            self._fail(f"the peer rewrote rendezvous descriptor {d.index} while it was "
                       f"being read")
        dst = into if into is not None else posted
        if dst is None and not self.rd_user:
            dst = src
        if dst is not None:
            self._check_room(dst, posted, d)
        self._wait_read()
        self.n_rndv_reads += 1
        if dst is None:
            dst = _dest(self.allocate(d.length))
        if dst.view.buf != src.view.buf:
            memcpy(dst.view.buf, src.view.buf, d.length)
        return dst

    cdef int _wait_read(self) except -1:
        """Wait for the READ in flight until the receive's deadline (Timeout: it stays
        in flight), in slices that let signals through; then end it."""
        cdef int rc
        cdef int64_t deadline = self.rx_until
        cdef rm_desc d = self.rd_desc
        while True:
            with nogil:
                rc = self._read_wait(self._slice_end(deadline))
            if rc != 1:
                break
            if deadline and now_ns() >= deadline:
                raise Timeout(f"rendezvous message {d.index} ({d.length} bytes) is still "
                              f"being read; receive again to finish it (nothing is lost)")
            PyErr_CheckSignals()
        self._end_read()
        if rc != 0:
            self._raise_read(rc, &d)
        return 0

    cdef int _read_wait(self, int64_t until) noexcept nogil:
        """Spin, then sleep, until the READ in flight completed (0, or a RM_ERR_* if it
        failed), ``until`` passes (1) or the peer is lost (RM_ERR_PEER_LOST). It
        spins about as long as the data takes at 1 GB/s (at most READ_SPIN_NS more than
        spin_us), yielding the core: the answer needs CPU here too (tcp's progress
        thread)."""
        cdef int64_t t = now_ns()
        cdef int64_t spin_end = t + self.spin_ns + <int64_t>min(self.rd_desc.length,
                                                                <uint64_t>READ_SPIN_NS)
        cdef int64_t next_check = t + PEER_CHECK_NS
        cdef uint64_t done
        cdef int status
        while True:
            self._reap()
            rm_spin_lock(&self.reap_lock)       # done and status: one completion's
            done, status = self.rndv_read_done, self.rndv_read_status
            rm_spin_unlock(&self.reap_lock)
            if done == self.rd_want:
                if status == 0:
                    return 0
                # IBV_WC_REM_INV_REQ_ERR / REM_ACCESS_ERR: outside the peer's MR
                return RM_ERR_BOUNDS if status in (9, 10) else RM_ERR_PEER_LOST
            if self.peer_gone:
                return RM_ERR_PEER_LOST
            t = now_ns()
            if t >= next_check:         # a QP in error flushes the READ; a transport
                # that saw the peer die some other way says so here
                if self._peer_status() == RM_ERR_PEER_LOST:
                    return RM_ERR_PEER_LOST
                next_check = t + PEER_CHECK_NS
            if t >= until:
                return 1
            if t < spin_end:
                sched_yield()
                continue
            self.tp.n_sleeps += 1       # tcp wakes us when the answer is in
            self.tp.wait(min(READ_NAP_MS, <int>((until - t) // 1000000) + 1))

    cdef int _end_read(self) except -1:
        """The READ in flight is over (or the transport closed): give back its exposure
        and lease."""
        cdef object lease = self.rd_lease
        if self.rd_want == 0:
            return 0
        self.tp.unexpose(self.rd_mem.handle)
        self.rd_mem.handle = 0
        self.rd_lease = None
        self.rd_dst = None
        self.rd_want = 0
        if lease is not None:
            _release_lease(lease)
        return 0

    cdef int _raise_read(self, int rc, rm_desc *d) except -1:
        cdef int st
        if rc == RM_ERR_BOUNDS:
            with nogil:
                st = self._peer_dying()
            if st == RM_ERR_PEER_LOST:
                rc = st     # its memory went with it: not the peer's lie, its death
        if rc == RM_ERR_BOUNDS:
            self._fail(f"rendezvous descriptor {d.index} ({d.length} bytes at {d.addr:#x}, "
                       f"key {d.key:#x}) is outside what the sender exposed; nothing read")
        st = self._peer_status()
        if st == RM_ERR_CLOSED:
            raise ChannelClosed(f"the peer closed before rendezvous message {d.index} "
                                f"was read; it is lost")
        if st < 0 or rc == RM_ERR_PEER_LOST:
            self.peer_gone = True
            raise PeerLost(self._lost(f"peer lost while reading rendezvous message {d.index}"))
        raise ProtocolError(f"the rendezvous READ of message {d.index} failed ({rc})")

    cdef void _drop_posted(self) noexcept:
        cdef _Dest p = self.posted.popleft()
        if p.advertised:
            self.tp.unexpose(p.adv.handle)
            p.advertised = False

    def post_recv(self, buffer) -> None:
        """Post ``buffer`` (writable, C-contiguous: numpy array, bytearray, ...) as the
        destination of the next rendezvous message that has none yet. It is lent to the
        channel until that message was received (recv/recv_batch return a Message that
        views it); with ``rendezvous="write"`` the sender WRITEs straight into it."""
        cdef _Dest d = _dest(buffer)
        cdef uint8_t e
        cdef int rc
        cdef rm_wr wr[2]
        self._check_usable()
        self._lock(self.recv_lock)
        try:
            if not self.rndv_on:
                raise ValueError("rendezvous is off on this channel; nothing to post for")
            if len(self.posted) >= RNDV_N:
                raise ValueError(f"at most {RNDV_N} destinations may be posted ahead")
            d.index = self.rrndv_next + len(self.posted)
            if self.rndv_write and d.view.len:
                rc = self.tp.expose(<uint64_t>d.view.buf, d.view.len, RM_ACCESS_REMOTE_WRITE,
                                    &d.adv)
                if rc == 0:
                    d.advertised = True
                    e = <uint8_t>(d.index % RNDV_N)
                    self.advsrc[4 * e] = <uint64_t>d.view.buf
                    self.advsrc[4 * e + 1] = <uint64_t>d.view.len
                    self.advsrc[4 * e + 2] = d.adv.rkey
                    self.advsrc[4 * e + 3] = d.index + 1     # the tag, written last
                    _fill_wr(&wr[0], &self.advsrc[4 * e], self.lkey_adv, RM_REGION_CTRL,
                             (CTRL_ADVERT + 4 * e) * 8, 24)
                    _fill_wr(&wr[1], &self.advsrc[4 * e + 3], self.lkey_adv, RM_REGION_CTRL,
                             (CTRL_ADVERT + 4 * e + 3) * 8, 8)
                    rm_spin_lock(&self.spin)
                    rc = self.tp.post(wr, 2)
                    rm_spin_unlock(&self.spin)
                    if rc != 0:
                        self.tp.unexpose(d.adv.handle)
                        self._raise_post(rc)
                elif rc != RM_ERR_UNSUPPORTED and rc != RM_ERR_AGAIN:
                    self._raise_post(rc)
            self.posted.append(d)
        finally:
            PyThread_release_lock(self.recv_lock)

    def recv_into(self, buffer, timeout=None) -> int:
        """Receive the next message into ``buffer`` (writable, C-contiguous) and return
        its length, like ``socket.recv_into``. A small message is copied out of the
        ring; a rendezvous message is READ straight into ``buffer``. Too small a buffer
        raises :class:`BufferTooSmall` (``.needed``) and the message stays receivable."""
        return self._recv(0, timeout, _dest(buffer))

    cdef bint _spin_with_gil(self) noexcept:
        """Poll a few microseconds before giving up the GIL: a reply that is about to
        land (ping-pong) costs less than a GIL release and re-acquire."""
        cdef int64_t end = now_ns() + GIL_SPIN_NS
        cdef uint32_t i
        while True:
            if self._has_arrivals():
                return True
            for i in range(16):
                rm_cpu_relax()
            if now_ns() >= end:
                return False

    cdef bint _has_arrivals(self) noexcept nogil:
        """Something to deliver, or a slot arrived since the last look found a gap (the
        slots waiting behind a gap do not count: waiting for the gap sleeps)."""
        if self.cur_left != 0 or self.ready_len != 0:
            return True
        if self.gap_since == 0:
            return self.rbm.pending(self.pend, 1) != 0
        return self.rbm.pending(self.pend, self.gap_pending + 1) > self.gap_pending

    cdef int _wait_arrival(self, int64_t until, bint spin) noexcept nogil:
        """Spin, then sleep, until something arrived (1), ``until`` passes (0), or
        the peer goes (<0). Before sleeping, unflushed releases are written back and
        a flag in the peer's control words asks it to wake us after publishing."""
        cdef int64_t t = now_ns(), spin_end = t + (self.spin_ns if spin else 0)
        cdef int64_t next_check = t + PEER_CHECK_NS
        cdef int st, r
        cdef uint32_t i
        while True:
            if self._has_arrivals():
                return 1
            if rm_load_acquire64(&self.ctrl[CTRL_CREDIT_WAIT]) and self._unflushed():
                self._flush()
            if self.tp.assist() == 0:
                for i in range(32):
                    rm_cpu_relax()
            t = now_ns()
            if t >= next_check:
                st = self._peer_status()
                if st < 0:
                    return 1 if self._has_arrivals() else st
                next_check = t + PEER_CHECK_NS
            if t >= spin_end or t >= until:
                break
        self.n_arrival_waits += 1
        rm_spin_lock(&self.spin)
        if self._unflushed():
            self._flush_locked()
        self._put_word(RM_REGION_CTRL, CTRL_RX_SLEEP, &self.words[1])
        self.sleep_flag_set = True
        rm_spin_unlock(&self.spin)
        rm_fence_seq_cst()
        while True:
            if self._has_arrivals():
                r = 1
                break
            st = self._peer_status()
            if st < 0:
                r = 1 if self._has_arrivals() else st
                break
            t = now_ns()
            if t >= until:
                r = 0
                break
            if rm_load_acquire64(&self.ctrl[CTRL_CREDIT_WAIT]) and self._unflushed():
                self._flush()
            self.tp.n_sleeps += 1
            self.tp.wait(<int>((until - t) // 1000000) + 1)
        rm_spin_lock(&self.spin)
        self._put_word(RM_REGION_CTRL, CTRL_RX_SLEEP, &self.words[0])
        self.sleep_flag_set = False
        rm_spin_unlock(&self.spin)
        return r

    def recv_batch(self, max_messages=None, timeout=None) -> list:
        """Return the messages that have arrived (at least one, at most
        ``max_messages``, from at most a quarter of the ring's slots), waiting up to
        ``timeout`` seconds for the first.

        ``timeout=0`` polls; ``None`` waits until a message, a clean close of the peer
        (:class:`ChannelClosed`) or its loss (:class:`PeerLost`). Messages that arrived
        before the peer went are still delivered first."""
        cdef Py_ssize_t maxn
        if max_messages is None:
            maxn = 1 << 40
        else:
            maxn = max_messages
            if maxn <= 0:
                raise ValueError("max_messages must be positive")
        return self._recv(maxn, timeout, None)

    def recv(self, timeout=None) -> Message:
        """Receive one message (see :meth:`recv_batch`)."""
        return self._recv(1, timeout, None)[0]

    cdef object _recv(self, Py_ssize_t maxn, object timeout, _Dest into):
        cdef int64_t deadline
        cdef int st
        cdef bint first_wait = True
        cdef list out = []
        cdef Py_ssize_t n
        self._check_owner()
        if self.broken is not None:
            raise ProtocolError(self.broken)
        deadline = _deadline(timeout)
        self._lock(self.recv_lock)
        self.rx_until = deadline
        try:
            while True:
                if self.broken is not None:
                    raise ProtocolError(self.broken)
                if into is None:
                    if self._deliver(out, maxn):
                        if self.done_unflushed:     # one done write-back per call
                            self._flush()
                        return out
                else:
                    n = self._deliver_into(into)
                    if n >= 0:
                        if self.done_unflushed:
                            self._flush()
                        return n
                if self.closed:
                    raise ChannelClosed("channel is closed")
                if timeout is not None and deadline <= now_ns():
                    st = self._peer_status()
                    if st < 0:
                        self._raise_peer(st, "receive")
                    raise Timeout("no message within the timeout")
                if first_wait and self._spin_with_gil():
                    first_wait = False
                    continue
                with nogil:
                    st = self._wait_arrival(self._slice_end(deadline), first_wait)
                first_wait = False
                if st < 0:
                    self._raise_peer(st, "receive")
                if st == 0:
                    PyErr_CheckSignals()
        finally:
            PyThread_release_lock(self.recv_lock)


    # ---- lifetime and introspection ------------------------------------------------

    def close(self) -> None:
        """Close this endpoint; the peer sees :class:`ChannelClosed` once it has
        received what was sent. Messages already received stay readable."""
        cdef int64_t until
        if self.closed:
            return
        if self.owner_pid != _pid:
            self.closed = True      # a fork child: the connection is the parent's
            return
        if self.tp is not None and self.rndv_released < self.rndv_next:
            # the receiver may still be READing our sources: give it a bounded time
            until = now_ns() + CLOSE_RNDV_NS
            while not self._rndv_poll(self.rndv_next) and now_ns() < until:
                with nogil:
                    if self._wait_credit(self._slice_end(until), False, WAIT_DONE,
                                         self.rndv_next) < 0:
                        break
            self.rndv_upto = self.rndv_next      # give the sources back regardless
            self._rndv_release()
        self.closed = True
        if self.tp is None:
            return
        while self.posted:
            self._drop_posted()
        for cache in (self.regcache, self.regcache_dst):
            if self.cache_ok and cache is not None:
                cache.close()       # idle MRs go now, those still leased when released
        with nogil:
            rm_spin_lock(&self.spin)
            if not self.peer_gone:
                if self._unflushed():
                    self._flush_locked()
                self._put_word(RM_REGION_CTRL, CTRL_CLOSED, &self.words[1])
                rm_fence_seq_cst()
                self.tp.wake_peer()
            rm_spin_unlock(&self.spin)
        self.tp.close()
        self._end_read()            # a READ left in flight: nothing writes into it now

    def stats(self) -> dict:
        """Counters of this endpoint; everything that hit the transport is counted."""
        d = {
            "messages": self.n_msgs_sent,
            "batches": self.n_batches,
            "bytes": self.n_bytes_sent,
            "slots_sent": self.n_slots_sent,
            "messages_received": self.n_msgs_recv,
            "bytes_received": self.n_bytes_recv,
            "slots_received": self.n_slots_recv,
            "reclaim_writebacks": self.n_reclaim_wb,
            "credit_waits": self.n_credit_waits,
            "arrival_sleeps": self.n_arrival_waits,
            "free_send_slots": self.sbm.count_free() if self.sbm is not None else 0,
            "rndv_sends": self.n_rndv_sends,
            "rndv_writes": self.n_rndv_writes,
            "rndv_bytes": self.n_rndv_bytes,
            "rndv_received": self.n_rndv_recv,
            "rndv_reads": self.n_rndv_reads,
            "rndv_bytes_received": self.n_rndv_bytes_recv,
            "rndv_done_writebacks": self.n_done_wb,
            "rndv_refused": self.n_rndv_refused,
        }
        if self.tp is not None:
            d.update(self.tp.counters())
        return d

    @property
    def rndv_pending(self) -> int:
        """Rendezvous messages sent whose sources the receiver has not released yet."""
        return self.rndv_next - self.rndv_released

    @property
    def max_message_size(self) -> int:
        """Largest message this side takes (larger ones are refused: MessageTooLarge)."""
        return self.max_msg

    @property
    def peer_max_message_size(self) -> int:
        """Largest message the peer takes, as it announced (0 until it has)."""
        return rm_load_acquire64(&self.ctrl[CTRL_MAX_MSG]) if self.ctrl != NULL else 0

    @property
    def eager_limit(self) -> int:
        """Largest message the peer's ring takes (its slot_size)."""
        return self.peer_slot_size

    def diagnostics(self) -> dict:
        """The engine's sequence numbers, bitmap words, control words and rendezvous
        state, for diagnosing a stuck channel (docs/api.md, "Diagnostics"); the keys
        may change between versions, unlike ``stats()``'s."""
        cdef uint32_t i, held = 0
        for i in range(self.nslots):
            if self.slot_refs[i]:
                held += 1
        return {
            "send_seq": self.send_seq, "recv_seq": self.recv_seq,
            "unflushed": self.rbm.unflushed, "slots_held": held,
            "ready_len": self.ready_len, "cur_left": self.cur_left,
            "pending": self.rbm.pending_slots(),
            "free_send_slots": self.sbm.count_free(),
            "ctrl": [self.ctrl[0], self.ctrl[8], self.ctrl[16]],
            "arrival": list(self.rbm.arrival_words), "consumed": list(self.rbm.consumed_words),
            "reclaim_shadow": list(self.rbm.reclaim_words),
            "send_arrival_shadow": list(self.sbm.arrival_words),
            "send_reclaim_seen": list(self.sbm.reclaim_words),
            "rndv_next": self.rndv_next, "rndv_upto": self.rndv_upto,
            "rndv_released": self.rndv_released, "rrndv_next": self.rrndv_next,
            "rndv_read_done": self.rndv_read_done, "rndv_read_status": self.rndv_read_status,
            "peer_gone": self.peer_gone,
            "ring": {"address": <size_t>self.ring, "stride": self.stride,
                     "slots": self.nslots},
            "transport_error": self.tp.error_detail() if self.tp is not None else None,
        }
