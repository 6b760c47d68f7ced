from libc.stdint cimport int64_t, uint32_t, uint64_t

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


cdef SendHandle new_handle(Endpoint eng, uint64_t batch, Py_ssize_t count, uint64_t rndv)


# (defined in _messages.pyx, beside Message: there its allocation is a direct call
# the C compiler inlines; from another module it would go through the type's tp_new)
cdef Message new_message(Endpoint eng, char *ptr, Py_ssize_t length, uint32_t slot,
                         object owner)
cdef list take_eager(Endpoint eng, list out, Py_ssize_t *got, Py_ssize_t maxn,
                     uint32_t *opened, char **rndv)
cdef Message take_one(Endpoint eng)
cdef Dest new_dest(object obj)
cdef object host_view(object obj)
