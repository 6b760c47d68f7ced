# The engine's fields and its calls' C entry points, declared here so that the
# calls built on them in other modules (rdmamw/engine/_many.pyx: send_many,
# recv_many_into) reach the same locks and wait loops; only _engine.pyx writes them.
from libc.stdint cimport uint64_t

from rdmamw.engine._batch cimport Packed, SendBatch
from rdmamw.engine._eager_send cimport EagerSender
from rdmamw.engine._link cimport Link
from rdmamw.engine._messages cimport Dest, Endpoint, Message, SendHandle
from rdmamw.engine._rndv_recv cimport RndvReceiver
from rdmamw.engine._rndv_send cimport RndvSender
from rdmamw.engine._waits cimport Waiter


cdef class Engine(Endpoint):
    cdef Link link
    cdef SendBatch batch
    cdef EagerSender tx
    cdef RndvSender rs
    cdef RndvReceiver rr                # (rx, the EagerReceiver: a field of Endpoint)
    cdef Waiter w
    cdef readonly str mode
    cdef readonly str rendezvous        # "off", "read" or "write" (as resolved)
    cdef readonly uint64_t trace_id     # this endpoint's number in the timeline's records
    cdef bint ack
    cdef bint rndv_on
    cdef bint cache_ok                  # the transport's keys come from the caches
    cdef object _regcache, _regcache_dst
    cdef int send_lock, recv_lock       # the calls' locks (_calllock.pxd)
    cdef long send_owner, recv_owner    # waiting calls' threads (0: none; close() from one)

    cdef void _say_closed(self) noexcept nogil
    cdef SendHandle _send_one(self, object msg, object timeout)
    cdef SendHandle _send(self, object fast, object timeout, Packed packed=*)
    cdef list _deliver(self, Py_ssize_t maxn)
    cdef object _first_look(self, Py_ssize_t maxn)
    cdef object _recv(self, Py_ssize_t maxn, object timeout, Dest into)
