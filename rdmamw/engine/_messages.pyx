# cython: freethreading_compatible = False
"""What users hold: the handle of a batch sent, a received message (a zero-copy view
of its bytes in the ring or in its rendezvous destination), and the buffers lent to
the channel as destinations (recv_into, post_recv)."""

cimport cython
from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_WRITABLE,
    PyBuffer_FillInfo,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_Fetch, PyErr_Restore
from cpython.object cimport PyObject, PyTypeObject, destructor
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport strchr

from rdmamw.engine._eager_recv cimport EagerReceiver
from rdmamw.engine._frames cimport REC_RNDV, SLOT_HEADER, SLOT_SINGLE
from rdmamw.transport._base cimport now_ns

import sys

cdef extern from "Python.h":
    void Py_SET_REFCNT(PyObject *o, Py_ssize_t n)

# The batches' completion times (rdmamw.metrics: rdmamw_batch_completion_seconds): while
# timed, a handle notes the clock when made (the batch posted) and its first done()
# that says yes, or its wait() that returns, adds the time since to a histogram of the
# process. Off, that is one branch at each; on, a clock read at each.
cdef enum:
    NBOUNDS = 23
cdef bint timed = False
cdef int64_t bounds_ns[NBOUNDS]     # the buckets' upper bounds (rdmamw.metrics.readings.BUCKETS)
cdef uint64_t counts[NBOUNDS + 1]   # the last: above every bound
cdef int64_t total_ns = 0


def time_batches(bounds, bint on) -> None:
    """Time the batches from now on (``on``) with these ``bounds`` (seconds, ascending,
    NBOUNDS of them), or stop."""
    global timed
    if len(bounds) != NBOUNDS:
        raise ValueError(f"{NBOUNDS} bounds, not {len(bounds)}")
    for i in range(NBOUNDS):
        bounds_ns[i] = <int64_t>round(bounds[i] * 1e9)
    timed = on


def batch_times() -> tuple:
    """(the observations per bucket, NBOUNDS + 1 of them, the sum in seconds)."""
    return [counts[i] for i in range(NBOUNDS + 1)], total_ns / 1e9


def forget_batch_times() -> None:
    """Start the histogram afresh (a fork child's)."""
    global total_ns
    for i in range(NBOUNDS + 1):
        counts[i] = 0
    total_ns = 0


cdef void completed(SendHandle h) noexcept:
    global total_ns
    cdef int64_t t = now_ns() - h.posted
    cdef int i = 0
    h.posted = 0
    while i < NBOUNDS and t > bounds_ns[i]:
        i += 1
    counts[i] += 1
    total_ns += t


cdef class Endpoint:
    cdef bint handle_done(self, uint64_t batch, uint64_t rndv) except -1:
        raise NotImplementedError

    cdef int handle_wait(self, uint64_t batch, uint64_t rndv, object timeout) except -1:
        raise NotImplementedError


@cython.freelist(1024)
@cython.no_gc               # it refers to its endpoint only, which never refers back
@cython.final
cdef class SendHandle:
    """Completion of one batch: its source buffers may be reused once ``done()``."""

    def done(self) -> bool:
        """True once the batch's buffers may be reused: its work requests completed
        and the receiver has taken every rendezvous message of it (done bits back)."""
        if not self.eng.handle_done(self.batch, self.rndv):
            return False
        if self.posted:
            completed(self)
        return True

    def wait(self, timeout=None) -> None:
        """Wait until ``done()``; Timeout after ``timeout`` seconds, PeerLost if the
        peer goes first."""
        self.eng.handle_wait(self.batch, self.rndv, timeout)
        if self.posted:
            completed(self)

    def __repr__(self):
        return f"<SendHandle batch={self.batch} messages={self.count} done={self.done()}>"


cdef SendHandle new_handle(Endpoint eng, uint64_t batch, Py_ssize_t count, uint64_t rndv):
    cdef SendHandle h = SendHandle.__new__(SendHandle)
    h.eng = eng
    h.batch = batch
    h.count = count
    h.rndv = rndv
    if timed:
        h.posted = now_ns()
    return h


@cython.freelist(8192)
@cython.no_gc
@cython.final
cdef class Message:
    """A received message: a read-only, zero-copy view of its bytes in the ring.

    Supports the buffer protocol (``memoryview(m)``, ``bytes(m)``,
    ``numpy.frombuffer(m)``). Its slot is reclaimed on :meth:`release`, on leaving a
    ``with`` block, or when the object is collected; after release the bytes may be
    overwritten by the peer, so keep a copy (``bytes(m)``) if you need them longer."""

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
        self.eng.rx.release_one(self.slot)

    @property
    def released(self) -> bool:
        return self.rel

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __repr__(self):
        state = "released" if self.rel else f"slot={self.slot}"
        return f"<Message {self.length} bytes {state}>"


# Message's tp_dealloc is _message_dealloc, not a __dealloc__: Cython wraps every
# __dealloc__ in a save and restore of the error state (PyErr_Fetch / PyErr_Restore,
# ~50 instructions per message received), which giving a slot back does not need: it
# runs no Python code. Cython's own tp_dealloc (the fields cleared, the free list)
# runs after it.
cdef destructor _plain_dealloc = (<PyTypeObject *>Message).tp_dealloc


cdef void _let_go(Message m) noexcept:
    """A Message goes: its slot back, or its destination (rendezvous) dropped."""
    cdef PyObject *t
    cdef PyObject *v
    cdef PyObject *tb
    if m.owner is not None:
        PyErr_Fetch(&t, &v, &tb)        # a buffer's release may run Python code
        m.rel = True
        m.owner = None
        PyErr_Restore(t, v, tb)
    elif not m.rel and m.eng is not None:
        m.rel = True
        m.eng.rx.release_fast(m.slot)


cdef void _message_dealloc(PyObject *o) noexcept:
    Py_SET_REFCNT(o, 1)                 # alive while _let_go holds it
    _let_go(<Message>o)
    Py_SET_REFCNT(o, 0)
    _plain_dealloc(o)


(<PyTypeObject *>Message).tp_dealloc = _message_dealloc


@cython.final
cdef class Dest:
    """A destination of a message: a writable buffer held (exported) for as long as
    this object lives, so it can be neither freed nor resized meanwhile."""

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)
        if self.lens_held:
            PyBuffer_Release(&self.lens)


cdef Message new_message(Endpoint eng, char *ptr, Py_ssize_t length, uint32_t slot,
                         object owner):
    """A Message viewing ``length`` bytes at ``ptr``: in slot ``slot`` of eng's ring, or
    in ``owner`` (a Dest) when it came by rendezvous (slot RM_NO_SLOT)."""
    cdef Message m = Message.__new__(Message)
    m.eng = eng
    m.ptr = ptr
    m.length = length
    m.slot = slot
    if owner is not None:
        m.owner = owner
    return m


cdef list take_eager(Endpoint eng, list out, Py_ssize_t *got, Py_ssize_t maxn,
                     uint32_t *opened, char **rndv):
    """Append a Message for each eager message at the head of eng's ring to ``out``
    (None: no list yet; the first message makes it, of one item, so a receive of one
    message appends nothing) until it holds ``maxn`` (``got[0]`` so far, updated),
    the call's share of slots (``opened`` of ``max_open``) is used, the slots found
    ready are used up (once it has messages), nothing more has arrived or a
    rendezvous descriptor is next (``rndv`` points at it, peeked, not consumed; else
    NULL). Return the list (None while it has no message).
    Here, beside Message, each allocation is a direct call the C compiler inlines."""
    cdef EagerReceiver rx = eng.rx
    cdef char *base
    cdef uint32_t L, fl
    cdef Message m
    cdef Py_ssize_t n = got[0]
    rndv[0] = NULL
    while n < maxn:
        if not rx.next_record(&base, &L):   # (inline: a message of the open PACKED slot)
            if rx.cur_left == 0:
                # a bounded share of the ring per call: a caller that still holds the
                # previous list while waiting for the next one never starves the sender
                if opened[0] >= rx.max_open:
                    break
                if n and rx.ready_len == 0:
                    break   # no second look at the arrival bitmap in one call: the
                            # first saw what had arrived (a look costs a pass over its words)
                opened[0] += 1
            if not rx.peek(&base, &L, &fl):
                break
            if fl == REC_RNDV:
                rndv[0] = base
                break
        m = Message.__new__(Message)
        m.eng = eng
        m.ptr = base
        m.length = L
        m.slot = rx.cur_slot
        if out is None:
            out = [m]
        else:
            out.append(m)
        rx.advance(L, L)
        n += 1
    got[0] = n
    return out


cdef Message take_one(Endpoint eng):
    """recv()'s first look: the next message, if it has arrived and is eager, as a
    Message (no list); else None, and the general path delivers (a rendezvous
    descriptor stays peeked, not consumed) or waits. The caller holds the receive
    lock."""
    cdef EagerReceiver rx = eng.rx
    cdef char *base
    cdef uint32_t L, fl
    cdef Message m
    if rx.cur_left == 0:        # (peek's first part: a SINGLE slot needs no more)
        if rx.ready_len == 0:
            rx.fill_ready()
            if rx.ready_len == 0:
                return None
        rx.open_slot()
    if rx.cur_flags == SLOT_SINGLE:
        base = rx.ring + <size_t>rx.cur_slot * rx.stride + SLOT_HEADER
        L = rx.cur_used
    elif not rx.peek(&base, &L, &fl) or fl == REC_RNDV:     # a record of a PACKED slot
        return None
    m = Message.__new__(Message)
    m.eng = eng
    m.ptr = base
    m.length = L
    m.slot = rx.cur_slot
    rx.advance(L, L)
    if rx.done_unflushed:       # (as a receive call's end: the done bits ride along)
        rx.flush()
    return m


cdef Dest new_dest(object obj):
    cdef Dest d = Dest.__new__(Dest)
    cdef object given = obj
    try:
        PyObject_GetBuffer(obj, &d.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    except (TypeError, BufferError, ValueError) as e:
        try:
            obj = host_view(obj)            # a CPU tensor, a DLPack host array
            PyObject_GetBuffer(obj, &d.view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        except (TypeError, BufferError, ValueError) as e2:
            raise TypeError(f"{type(given).__name__} is not a writable C-contiguous buffer "
                            f"(numpy array, bytearray, memoryview, CPU tensor, ...): "
                            f"{e2}") from e
    d.held = True
    d.obj = obj
    return d


cdef Dest new_many_dest(object obj, object lengths):
    """recv_many_into's destination: ``obj`` for the messages' bytes, ``lengths`` (a
    writable uint32, int64 or uint64 array, at least one element) for their lengths."""
    cdef Dest d = new_dest(obj)
    cdef char code
    try:
        PyObject_GetBuffer(lengths, &d.lens,
                           PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT)
    except (TypeError, BufferError, ValueError) as e:
        raise TypeError(f"lengths ({type(lengths).__name__}) is not a writable "
                        f"C-contiguous array (numpy uint32/int64/uint64): {e}") from e
    d.lens_held = True
    code = int_code(&d.lens, "lengths")
    if code not in (b'I', b'q', b'Q'):
        raise TypeError(f"lengths holds {d.lens.format.decode()} items; it takes "
                        f"uint32, int64 or uint64 (a message is up to 4 GiB - 1)")
    d.wide = d.lens.itemsize == 8
    d.nlens = d.lens.len // d.lens.itemsize
    if d.nlens == 0:
        raise ValueError("lengths has no room for one message's length")
    return d


cdef char int_code(Py_buffer *v, str what) except 0:
    """The integer type of buffer ``v`` (exported with its format), as one struct code
    of its size: b/B h/H i/I q/Q (signed/unsigned, 1 to 8 bytes); TypeError for any
    other type (floats, a byte order not the machine's, a structure). Read in C: a
    receive asks once per call."""
    cdef const char *f = v.format
    cdef char c
    if f == NULL:
        f = b"B"
    if f[0] == b'@' or f[0] == b'=' or (f[0] == b'<' and not _BIG_ENDIAN):
        f += 1
    c = f[0]
    if c != 0 and f[1] == 0 and strchr(b"bBhHiIlLqQnN", c) != NULL:
        if v.itemsize == 1:
            return b'b' if c >= b'a' else b'B'
        if v.itemsize == 2:
            return b'h' if c >= b'a' else b'H'
        if v.itemsize == 4:
            return b'i' if c >= b'a' else b'I'
        if v.itemsize == 8:
            return b'q' if c >= b'a' else b'Q'
    raise TypeError(f"{what} holds {(<bytes>f).decode(errors='replace')!r} items, not "
                    f"integers in this machine's byte order (numpy int8 .. uint64)")


cdef bint _BIG_ENDIAN = sys.byteorder == "big"


#: what gives a tensor-like object without the buffer protocol (a torch tensor, a
#: DLPack exporter) as an array over its host memory, or raises TypeError naming its
#: device: rdmamw.memory.buffer.host_view, set by rdmamw.channel (the engine imports
#: nothing above it). Only objects the buffer protocol refused come here.
cdef object _host_view = None


def set_host_view(fn) -> None:
    global _host_view
    _host_view = fn


cdef object host_view(object obj):
    if _host_view is None:
        raise TypeError("no buffer protocol")
    return _host_view(obj)
