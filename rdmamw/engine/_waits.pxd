from libc.stdint cimport int64_t, uint32_t, uint64_t

from rdmamw.engine._eager_recv cimport EagerReceiver
from rdmamw.engine._eager_send cimport EagerSender
from rdmamw.engine._link cimport Link
from rdmamw.engine._rndv_send cimport RndvSender


cdef class Waiter:
    cdef Link link
    cdef EagerSender tx
    cdef RndvSender rs
    cdef EagerReceiver rx
    cdef bint arrival_up     # the sleep flag stays raised between slices of one receive

    cdef bint ready(self, int what, uint64_t target) noexcept nogil
    cdef int spin(self, int what, uint64_t target, int64_t until, uint32_t relax) noexcept nogil
    cdef int wait(self, int what, uint64_t target, int64_t until, bint spin,
                  bint keep=*, bint closer=*) noexcept nogil
    cdef int _wait(self, int what, uint64_t target, int64_t until, bint spin, bint keep,
                   bint closer, int64_t t) noexcept nogil
    cdef void lower(self) noexcept nogil
    cdef void waited(self, uint64_t ns) noexcept nogil
    cdef bint arm(self, int what, uint64_t target, int64_t spin_ns) noexcept nogil
    cdef void disarm(self) noexcept nogil
    cdef void _serve(self, int what) noexcept nogil
    cdef void _flag(self, int what, bint up) noexcept nogil
    cdef int handle(self, uint64_t batch, uint64_t rndv, int64_t deadline) except -1

    cdef inline void end_receive(self) noexcept:
        """A receive call ends: lower the sleep flag it kept raised, if it did (a plain
        load first, inline: a receive that never slept pays no GIL release for it)."""
        if self.arrival_up:
            with nogil:
                self.lower()
