from cpython.ref cimport Py_DECREF, PyObject
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from rdmamw.engine._link cimport Link
from rdmamw.engine._messages cimport read_int
from rdmamw.engine._trace cimport rm_trace_on
from rdmamw.transport._base cimport now_ns


cdef class Packed:
    """send_many's messages: one buffer cut into messages by lengths, or a size."""
    cdef Py_buffer data             # the messages' bytes, back to back (held)
    cdef Py_buffer sizes            # their lengths (held when code != 0)
    cdef bint data_held, sizes_held
    cdef char code                  # the lengths' element type (struct code); 0: ``size``
    cdef uint64_t size              # every message's length, without lengths
    cdef readonly Py_ssize_t n      # messages
    cdef object bytes_view          # the data as a memoryview of bytes (rendezvous parts)
    cdef inline uint64_t length(self, Py_ssize_t i) noexcept nogil:
        """Message i's length, checked at construction (inline: once per message)."""
        if self.code == 0:
            return self.size
        return read_int(self.sizes.buf, self.code, i)
    cdef object part(self, size_t off, size_t length)


cdef class SendBatch:
    cdef Link link
    # per message of the batch, grown on demand, never per message
    cdef uint32_t cap
    cdef Py_buffer *bufs            # the buffers we hold (held[i])
    cdef char **ptrs
    cdef size_t *lens
    cdef uint8_t *held
    cdef uint8_t *kind              # 1: goes by rendezvous
    cdef uint8_t *msg_entry         # ... its rendezvous entry
    cdef PyObject **lease_of        # ... its registration Lease (owned; verbs)
    cdef uint32_t *lease_keys       # ... that Lease's lkey and rkey
    cdef PyObject **srcs            # a list's messages, held (owned) for the call
    cdef Py_ssize_t nsrcs           # ... how many (0: the caller's tuple holds them)
    cdef uint64_t bytes             # payload bytes of the batch
    cdef uint32_t nrndv             # ... of its messages, those that go by rendezvous
    # the plan: slot k holds messages plan_start[k] .. plan_start[k + 1]
    cdef uint32_t *plan_start
    cdef uint32_t *plan_used
    cdef uint16_t *plan_flags
    # what the batch is checked against (set once, at set-up)
    cdef uint32_t eager_limit       # the peer's slot_size
    cdef bint ack                   # one message per slot
    cdef bint rndv_on
    cdef uint64_t rndv_threshold
    cdef uint64_t rndv_limit        # the largest range one rendezvous moves here
    cdef str rendezvous             # the resolved strategy, for error messages
    cdef readonly object regcache   # sources the peer READs (or we WRITE from); verbs
    # while a timeline records: when the batch's posting began (0: not traced), the
    # Link's chains posted before it, and its last doorbell, kept for its record
    # (trace_doorbell: db_t 0, none kept)
    cdef int64_t traced
    cdef uint64_t chain0
    cdef int64_t db_t
    cdef uint64_t db_chain
    cdef uint32_t db_msgs, db_slots

    # the batch's record in the timeline (rdmamw/include/rm_trace.h; inline: off, one
    # load and a branch each)
    cdef inline void trace_begin(self) noexcept nogil:
        if rm_trace_on(self.link.trace):
            if self.db_t:           # (not left by a call: trace_end takes it)
                self.flush_doorbell()
            self.traced, self.chain0 = now_ns(), self.link.batch_posted

    cdef inline void trace_end(self, Py_ssize_t n) noexcept nogil:
        """The batch of ``n`` messages was posted whole (and counted)."""
        if self.traced:
            self.put_batch(n)

    cdef void put_batch(self, Py_ssize_t n) noexcept nogil
    cdef void trace_doorbell(self, int64_t t, uint32_t msgs, uint32_t slots, int rc,
                             bint last) noexcept nogil
    cdef void flush_doorbell(self) noexcept nogil

    # a rendezvous message's source and lease go to its entry (RndvSender) until its
    # done bit, and come back if it is not sent after all (inline: no call)
    cdef inline Py_buffer hand_over(self, uint32_t i, uint8_t e, PyObject **lease) noexcept nogil:
        lease[0] = self.lease_of[i]
        self.lease_of[i] = NULL
        self.held[i] = 0
        self.msg_entry[i] = e
        return self.bufs[i]

    cdef inline void take_back(self, uint32_t i, Py_buffer buf, PyObject *lease) noexcept nogil:
        self.lease_of[i] = lease
        self.bufs[i] = buf
        self.held[i] = 1

    cdef int use(self, object regcache) except -1
    cdef int _grow(self, uint32_t n) except -1
    cdef inline int grow(self, uint32_t n) except -1:
        """Room for batches of n messages (inline: once per send call, mostly room)."""
        if n <= self.cap:
            return 0
        return self._grow(n)
    cdef int acquire(self, object fast, Py_ssize_t n) except -1
    cdef int acquire_packed(self, Packed p) except -1

    cdef inline void drop_srcs(self) noexcept:
        """The send call ends: let go of the list's messages acquire() held."""
        while self.nsrcs:
            self.nsrcs -= 1
            Py_DECREF(<object>self.srcs[self.nsrcs])
    cdef int _take(self, Py_ssize_t i, object item, uint64_t peer_max) except -1
    cdef void release_bufs(self, Py_ssize_t n) noexcept
    cdef uint32_t plan(self, uint32_t n) noexcept nogil
    cdef uint32_t reclen(self, uint32_t i) noexcept nogil
