from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from rdmamw.engine._eager_recv cimport EagerReceiver


cdef class Endpoint:
    """What messages and handles see of the engine that made them (the engine
    subclasses it): the receiver whose slots messages view, a batch's done / wait."""
    cdef EagerReceiver rx
    cdef bint handle_done(self, uint64_t batch, uint64_t rndv) except -1
    cdef int handle_wait(self, uint64_t batch, uint64_t rndv, object timeout) except -1


cdef class SendHandle:
    cdef Endpoint eng
    cdef readonly uint64_t batch
    cdef readonly Py_ssize_t count
    cdef uint64_t rndv              # rendezvous messages sent up to and including this batch
    cdef int64_t posted             # now_ns() at its post while batches are timed, else 0


cdef class Message:
    cdef Endpoint eng               # keeps the endpoint alive; eng.rx owns the slot
    cdef char *ptr
    cdef Py_ssize_t length
    cdef uint32_t slot
    cdef int exports
    cdef bint rel
    cdef object owner               # a rendezvous message: its destination (Dest), no slot


cdef class Dest:
    cdef Py_buffer view
    cdef bint held
    cdef readonly object obj
    # recv_many_into: where the messages' lengths go (held while lens_held), how many
    # fit (0: a destination of one message), 8 bytes each (``wide``) or 4
    cdef Py_buffer lens
    cdef bint lens_held
    cdef Py_ssize_t nlens
    cdef bint wide


cdef SendHandle new_handle(Endpoint eng, uint64_t batch, Py_ssize_t count, uint64_t rndv)


# (defined in _messages.pyx, beside Message: there its allocation is a direct call
# the C compiler inlines; from another module it would go through the type's tp_new)
cdef Message new_message(Endpoint eng, char *ptr, Py_ssize_t length, uint32_t slot,
                         object owner)
cdef list take_eager(Endpoint eng, list out, Py_ssize_t *got, Py_ssize_t maxn,
                     uint32_t *opened, char **rndv)
cdef Message take_one(Endpoint eng)
cdef Dest new_dest(object obj)
cdef Dest new_many_dest(object obj, object lengths)
cdef char int_code(Py_buffer *v, str what) except 0


cdef inline uint64_t read_int(const void *buf, char code, Py_ssize_t i) noexcept nogil:
    """Element i of an integer array of int_code ``code`` (a negative one wraps: the
    caller checked the array's signs)."""
    if code == b'q':
        return <uint64_t>(<const int64_t *>buf)[i]
    if code == b'Q':
        return (<const uint64_t *>buf)[i]
    if code == b'i':
        return <uint64_t><int64_t>(<const int32_t *>buf)[i]
    if code == b'I':
        return (<const uint32_t *>buf)[i]
    if code == b'h':
        return <uint64_t><int64_t>(<const int16_t *>buf)[i]
    if code == b'H':
        return (<const uint16_t *>buf)[i]
    if code == b'b':
        return <uint64_t><int64_t>(<const int8_t *>buf)[i]
    return (<const uint8_t *>buf)[i]
cdef object host_view(object obj)
