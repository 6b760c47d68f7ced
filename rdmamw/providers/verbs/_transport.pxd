# The verbs provider's data path on a VerbsQP (_qp.pxd): post, poll, wait, the
# wake-ups and the grants of a ring that grows, in one extension.
from libc.stdint cimport uint32_t, uint64_t

from rdmamw.transport._base cimport rm_wr
from rdmamw.providers.verbs._qp cimport VerbsQP


cdef class VerbsTransport(VerbsQP):
    cdef void _fill(self, uint32_t j, rm_wr *wr) noexcept nogil
    cdef int _post_chain(self, uint32_t count, bint final) noexcept nogil
    cdef int _room(self, uint32_t count) noexcept nogil
    cdef int _poll_send_locked(self) noexcept nogil
    cdef inline void _stash(self, uint64_t wr_id, int status, int opcode) noexcept nogil
    cdef int _drain_recv(self) noexcept nogil
    cdef bint _woken(self) noexcept nogil
    cdef int _looked(self, int r) noexcept nogil
    cdef int _settle(self) noexcept nogil
    cdef void _offer(self) noexcept nogil
