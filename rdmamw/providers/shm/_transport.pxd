# The shm provider's data path on a ShmEndpoint (_endpoint.pxd).
from libc.stdint cimport uint16_t, uint32_t, uint64_t

from rdmamw.transport._base cimport rm_wr
from rdmamw.providers.shm._endpoint cimport ShmEndpoint, rm_xent


cdef class ShmTransport(ShmEndpoint):
    cdef int _post_exposed(self, rm_wr *wrs, uint32_t n) noexcept nogil
    cdef int _post(self, rm_wr *wrs, uint32_t n) noexcept nogil
    cdef bint _in_run(self, rm_wr *wr, uint16_t opcode) noexcept nogil
    cdef int _region_run(self, rm_wr *wrs, uint32_t *at, uint32_t n) noexcept nogil
    cdef int _check_exposed(self, rm_wr *wr, rm_xent *xe) noexcept nogil
    cdef int _exposed(self, rm_wr *wr) noexcept nogil
    cdef int _assisted(self, rm_wr *wr) noexcept nogil
    cdef int _assisted_one(self, rm_wr *wr) noexcept nogil
