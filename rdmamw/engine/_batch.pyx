# cython: freethreading_compatible = False
"""The messages of one send call: their buffers (held for the call), which go by
rendezvous, and the plan that packs them into slots. Checked whole before anything is
posted, so a bad or oversized item sends nothing."""

cimport cython
from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBuffer_Release,
    PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.list cimport PyList_CheckExact
from cpython.ref cimport Py_XDECREF, Py_XINCREF
from libc.stdlib cimport free, realloc
from libc.string cimport memset

from rdmamw.engine._frames cimport (
    CTRL_MAX_MSG,
    DESC_BYTES,
    REC_HDR,
    RNDV_N,
    SLOT_PACKED,
    SLOT_SINGLE,
    pad8,
)
from rdmamw.engine._leases cimport end_owned, take_lease
from rdmamw.engine._messages cimport host_view, int_code, read_int
from rdmamw.engine._trace cimport TR_BATCH, TR_BATCH_ONE, TR_DOORBELL, rm_trace_put_chan
from rdmamw.transport._base cimport now_ns
from rdmamw.transport.atomics cimport rm_load_acquire64

from array import array

from rdmamw.errors import MessageTooLarge

cdef extern from "Python.h":
    PyObject **PySequence_Fast_ITEMS(object o)


cdef void *_grown(void *p, size_t n) except NULL:
    """realloc that raises MemoryError (the old block stays valid then)."""
    cdef void *q = realloc(p, n)
    if q == NULL:
        raise MemoryError()
    return q


@cython.final
cdef class Packed:
    """The messages of one send_many call: ``data`` (any C-contiguous buffer) cut, in
    order, into messages of the lengths ``sizes`` gives (an integer array or
    sequence), or all of ``size`` bytes. Checked whole here, before the send takes
    its lock: TypeError for what is no buffer or no integers, ValueError for a
    negative length or lengths that do not add up to the buffer."""

    def __cinit__(self, data, sizes=None, size=None):
        cdef Py_ssize_t i
        cdef uint64_t total = 0, v, room
        take_buffer(data, &self.data, "data")
        self.data_held = True
        room = <uint64_t>self.data.len
        if (sizes is None) == (size is None):
            raise TypeError("send_many takes the messages' lengths (sizes) or one length "
                            "for all (size=), not both or neither")
        if size is not None:
            if size < 1:
                raise ValueError(f"size={size}: every message must be at least 1 byte "
                                 f"(send zero-length messages with sizes)")
            self.size = size
            if room % self.size:
                raise ValueError(f"data holds {room} bytes, not a multiple of size={size}")
            self.n = <Py_ssize_t>(room // self.size)
            return
        if not PyObject_CheckBuffer(sizes):
            try:
                sizes = array("q", sizes)       # a sequence of Python ints
            except (TypeError, OverflowError) as e:
                raise TypeError(f"sizes ({type(sizes).__name__}) is neither an integer "
                                f"array nor a sequence of ints: {e}") from e
        try:
            PyObject_GetBuffer(sizes, &self.sizes, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        except (BufferError, ValueError) as e:
            raise TypeError(f"sizes is not a C-contiguous array: {e}") from e
        self.sizes_held = True
        self.code = int_code(&self.sizes, "sizes")
        self.n = self.sizes.len // self.sizes.itemsize
        for i in range(self.n):
            v = self.length(i)
            if self.code in b"bhiq" and <int64_t>v < 0:
                raise ValueError(f"sizes[{i}] is {<int64_t>v}: a length is never negative")
            if v > room - total:
                raise ValueError(f"sizes add up to more than the {room} bytes of data "
                                 f"(at sizes[{i}])")
            total += v
        if total != room:
            raise ValueError(f"sizes add up to {total} bytes; data holds {room}")

    def __dealloc__(self):
        if self.data_held:
            PyBuffer_Release(&self.data)
        if self.sizes_held:
            PyBuffer_Release(&self.sizes)

    cdef object part(self, size_t off, size_t length):
        """Bytes [off, off + length) of the data as a memoryview: the source of a message
        that goes by rendezvous, held (and registered) as send_batch holds its items."""
        if self.bytes_view is None:
            self.bytes_view = memoryview(self.data.obj).cast("B")
        return self.bytes_view[off:off + length]


cdef int take_buffer(object obj, Py_buffer *view, str what) except -1:
    """Hold ``obj``'s C-contiguous buffer in ``view`` (a host tensor through its host
    view); TypeError if it has none."""
    try:
        PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS)
    except (TypeError, BufferError, ValueError) as e:
        try:
            PyObject_GetBuffer(host_view(obj), view, PyBUF_C_CONTIGUOUS)
        except (TypeError, BufferError, ValueError) as e2:
            raise TypeError(f"{what} ({type(obj).__name__}) is not a C-contiguous "
                            f"bytes-like object ({e2}); nothing was sent") from e
    return 0


@cython.final
cdef class SendBatch:
    """Scratch for the messages of one send call (amortised, never per message)."""

    def __cinit__(self, Link link, uint32_t eager_limit, bint ack, bint rndv_on,
                  uint64_t rndv_threshold, uint64_t rndv_limit, str rendezvous):
        self.link = link
        self.eager_limit = eager_limit
        self.ack = ack
        self.rndv_on = rndv_on
        self.rndv_threshold = rndv_threshold
        self.rndv_limit = rndv_limit
        self.rendezvous = rendezvous
        self.grow(64)

    def __dealloc__(self):
        cdef uint32_t i
        for i in range(self.cap):
            Py_XDECREF(self.lease_of[i])
        self.drop_srcs()
        free(self.srcs); free(self.bufs); free(self.ptrs); free(self.lens); free(self.held)
        free(self.kind); free(self.msg_entry); free(self.lease_of); free(self.lease_keys)
        free(self.plan_start); free(self.plan_used); free(self.plan_flags)

    cdef int use(self, object regcache) except -1:
        """The channel's registration cache of sources (None: not registered)."""
        self.regcache = regcache
        return 0

    cdef int _grow(self, uint32_t n) except -1:
        """grow(): room for batches of n messages (n + 1 plan entries), reallocated."""
        cdef uint32_t c = max(n, 2 * self.cap)
        self.srcs = <PyObject **>_grown(self.srcs, c * sizeof(PyObject *))
        self.bufs = <Py_buffer *>_grown(self.bufs, c * sizeof(Py_buffer))
        self.ptrs = <char **>_grown(self.ptrs, c * sizeof(char *))
        self.lens = <size_t *>_grown(self.lens, c * sizeof(size_t))
        self.held = <uint8_t *>_grown(self.held, c)
        self.kind = <uint8_t *>_grown(self.kind, c)
        self.msg_entry = <uint8_t *>_grown(self.msg_entry, c)
        self.lease_of = <PyObject **>_grown(self.lease_of, c * sizeof(PyObject *))
        memset(self.lease_of + self.cap, 0, (c - self.cap) * sizeof(PyObject *))
        self.lease_keys = <uint32_t *>_grown(self.lease_keys, c * 8)
        self.plan_start = <uint32_t *>_grown(self.plan_start, c * 4)
        self.plan_used = <uint32_t *>_grown(self.plan_used, c * 4)
        self.plan_flags = <uint16_t *>_grown(self.plan_flags, c * 2)
        self.cap = c
        return 0

    cdef int acquire(self, object fast, Py_ssize_t n) except -1:
        """Hold the buffers of the n messages of ``fast`` (a tuple, or a list: its
        messages held in ``srcs`` first, as a tuple of them would, until drop_srcs)
        and check each against the limits; on a bad one release all and raise
        (nothing was sent). A bytes object that goes eager needs no buffer and passes
        every check: taken here, in a loop without Python temporaries; anything else
        by _take (which may run Python code: the list may change, srcs do not)."""
        cdef PyObject **items = PySequence_Fast_ITEMS(fast)
        cdef Py_ssize_t i
        if PyList_CheckExact(fast):
            for i in range(n):
                Py_XINCREF(items[i])
                self.srcs[i] = items[i]
            self.nsrcs = n
            items = self.srcs
        cdef size_t L, total = 0
        cdef uint64_t peer_max = rm_load_acquire64(&self.link.ctrl[CTRL_MAX_MSG])
        cdef size_t eager = self.eager_limit
        cdef uint8_t *kind = self.kind      # (locals, as in acquire_packed: a store
        cdef uint8_t *held = self.held      # through these pointers may alias any
        cdef char **ptrs = self.ptrs        # field, which would be reloaded every
        cdef size_t *lens = self.lens       # message)
        cdef PyObject *item
        if self.rndv_on and self.rndv_threshold < eager:
            eager = self.rndv_threshold     # larger ones go by rendezvous
        self.bytes = 0
        self.nrndv = 0
        for i in range(n):
            item = items[i]
            if PyBytes_CheckExact(<object>item):
                L = <size_t>PyBytes_GET_SIZE(<object>item)
                if L <= eager:
                    kind[i] = 0
                    held[i] = 0
                    ptrs[i] = PyBytes_AS_STRING(<object>item)
                    lens[i] = L
                    total += L
                    continue
            self._take(i, <object>item, peer_max)      # (which counts its bytes)
        self.bytes += total
        return 0

    cdef int acquire_packed(self, Packed p) except -1:
        """acquire() for send_many: message i is bytes of p's buffer, taken in a loop
        without a Python object: an eager one as a pointer into the buffer (p holds it
        for the call), one that goes by rendezvous through _take, as a memoryview of
        its bytes (an object per large message only: its source until its done bit)."""
        cdef char *base = <char *>p.data.buf
        cdef uint8_t *kind = self.kind      # (locals: stores through these pointers
        cdef uint8_t *held = self.held      # may alias any field, which would be
        cdef char **ptrs = self.ptrs        # reloaded every message)
        cdef size_t *lens = self.lens
        cdef const void *sizes = p.sizes.buf
        cdef char code = p.code
        cdef uint64_t fixed = p.size, eager = self.eager_limit, total = 0, L
        cdef size_t off = 0
        cdef Py_ssize_t i
        cdef uint64_t peer_max = rm_load_acquire64(&self.link.ctrl[CTRL_MAX_MSG])
        if self.rndv_on and self.rndv_threshold < eager:
            eager = self.rndv_threshold     # larger ones go by rendezvous
        self.bytes = 0
        self.nrndv = 0
        for i in range(p.n):
            L = fixed if code == 0 else read_int(sizes, code, i)
            if L <= eager:
                kind[i] = 0
                held[i] = 0
                ptrs[i] = base + off
                lens[i] = <size_t>L
                total += L
            else:
                try:
                    self._take(i, p.part(off, L), peer_max)
                except BaseException:
                    self.release_bufs(i)
                    raise
            off += L
        self.bytes += total
        return 0

    cdef int _take(self, Py_ssize_t i, object item, uint64_t peer_max) except -1:
        """Message i of acquire(): its buffer held (or a bytes object's pointer), its
        size checked against the eager limit, rendezvous and the peer's maximum."""
        cdef size_t limit = self.eager_limit
        cdef bint rndv
        cdef object given = item
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
                try:
                    item = host_view(item)      # a CPU tensor, a DLPack host array
                    PyObject_GetBuffer(item, &self.bufs[i], PyBUF_C_CONTIGUOUS)
                except (TypeError, BufferError, ValueError) as e2:
                    self.release_bufs(i)
                    raise TypeError(
                        f"message {i} ({type(given).__name__}) is not a "
                        f"C-contiguous bytes-like object ({e2}); nothing was "
                        f"sent") from e
            self.held[i] = 1
            self.ptrs[i] = <char *>self.bufs[i].buf
            self.lens[i] = <size_t>self.bufs[i].len
        self.bytes += self.lens[i]
        rndv = self.rndv_on and self.lens[i] > self.rndv_threshold
        if rndv and self.lens[i] > self.rndv_limit:
            self.release_bufs(i + 1)
            raise MessageTooLarge(
                f"message {i} is {self.lens[i]} bytes; rendezvous takes at most "
                f"{self.rndv_limit} bytes here; nothing was sent")
        if rndv and peer_max and self.lens[i] > peer_max:
            self.release_bufs(i + 1)
            raise MessageTooLarge(
                f"message {i} is {self.lens[i]} bytes; the peer takes at most "
                f"{peer_max} (its max_message_size / RDMAMW_MAX_MESSAGE_SIZE); "
                f"nothing was sent")
        if self.lens[i] > limit and not rndv:
            self.release_bufs(i + 1)
            raise MessageTooLarge(
                f"message {i} is {self.lens[i]} bytes; the peer's eager limit is "
                f"{limit} bytes (its slot_size) and rendezvous is "
                f"{self.rendezvous}; nothing was sent")
        self.kind[i] = rndv
        self.nrndv += rndv
        if rndv and self.regcache is not None:
            try:
                lease = take_lease(self.regcache, item, self.link.closed)
            except BaseException:
                self.release_bufs(i + 1)
                raise
            self.lease_keys[2 * i] = lease.handle[1]
            self.lease_keys[2 * i + 1] = lease.handle[2]
            Py_XINCREF(<PyObject *>lease)
            self.lease_of[i] = <PyObject *>lease
        return 0

    cdef void release_bufs(self, Py_ssize_t n) noexcept:
        """Let go of what messages 0..n still hold (a rendezvous entry took its own)."""
        cdef Py_ssize_t i
        cdef PyObject *lease
        for i in range(n):
            if self.held[i]:
                PyBuffer_Release(&self.bufs[i])
                self.held[i] = 0
            if self.lease_of[i] != NULL:    # a source that was never handed to an entry
                lease = self.lease_of[i]
                self.lease_of[i] = NULL
                end_owned(lease)

    cdef uint32_t plan(self, uint32_t n) noexcept nogil:
        """Assign messages to slots: greedy packing, a lone message as SINGLE; the
        number of slots."""
        cdef uint32_t k = 0, i = 0, start, used, rec, nr
        cdef uint32_t cap = self.eager_limit
        if n == 1 and not self.kind[0]:     # one eager message (acquire checked its size)
            self.plan_start[0], self.plan_start[1] = 0, 1     # is a SINGLE slot, always
            self.plan_flags[0] = SLOT_SINGLE
            self.plan_used[0] = <uint32_t>self.lens[0]
            return 1
        while i < n:
            start = i
            if self.ack or (not self.kind[i] and REC_HDR + pad8(<uint32_t>self.lens[i]) > cap):
                used = self.reclen(i)
                i += 1
            else:
                used = 0
                nr = 0      # a slot's descriptors must fit the entries: a quarter of them
                while i < n:
                    rec = self.reclen(i)
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

    cdef inline uint32_t reclen(self, uint32_t i) noexcept nogil:
        """Bytes of message i's record in a PACKED slot (a descriptor if rendezvous)."""
        if self.kind[i]:
            return REC_HDR + DESC_BYTES
        return REC_HDR + pad8(<uint32_t>self.lens[i])

    # ---- the batch's records in the timeline (docs/trace.md) ----------------------

    cdef void put_batch(self, Py_ssize_t n) noexcept nogil:
        """trace_end: a batch posted in one chain that completed within its post (shm,
        tcp) is one record that ends at its doorbell (read after the post and its reap:
        when the chain had completed; no clock read more); else the kept doorbell and
        the batch record, which says whether its last chain completed by its end."""
        cdef uint64_t last = self.link.batch_posted
        cdef bint done = self.link.batch_done >= last
        cdef int64_t t1
        if (done and self.db_t and self.db_chain == last and last - self.chain0 == 1
                and self.db_msgs == <uint64_t>n):
            rm_trace_put_chan(self.link.trace, TR_BATCH_ONE, self.link.serial, self.traced,
                              self.db_t, <uint64_t>n, self.bytes, last, self.db_slots, 0)
            self.db_t = 0
        else:
            t1 = now_ns()
            self.flush_doorbell()
            rm_trace_put_chan(self.link.trace, TR_BATCH, self.link.serial, self.traced, t1,
                              <uint64_t>n, self.bytes, last,
                              <uint32_t>(last - self.chain0), done)
        self.traced = 0

    cdef void trace_doorbell(self, int64_t t, uint32_t msgs, uint32_t slots, int rc,
                             bint last) noexcept nogil:
        """A chain of this batch was posted at ``t`` (the Link's last): the one that ends
        a traced batch's plan is kept for the batch's record (put_batch: the call ends
        without a wait after it, so its record is written); any other, or one that
        failed, is a record of its own at once (a call that fails after it, in a wait
        for slots, leaves it in the timeline)."""
        if self.traced and last and rc == 0:
            self.flush_doorbell()
            self.db_t, self.db_chain = t, self.link.batch_posted
            self.db_msgs, self.db_slots = msgs, slots
            return
        self.flush_doorbell()
        rm_trace_put_chan(self.link.trace, TR_DOORBELL, self.link.serial, t, t, msgs, slots,
                          self.link.batch_posted, <uint32_t>rc, 0)

    cdef void flush_doorbell(self) noexcept nogil:
        """The kept doorbell, if any, as a record of its own."""
        if self.db_t:
            rm_trace_put_chan(self.link.trace, TR_DOORBELL, self.link.serial, self.db_t,
                              self.db_t, self.db_msgs, self.db_slots, self.db_chain, 0, 0)
            self.db_t = 0
