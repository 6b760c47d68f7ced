# The shm provider's data path on a ShmEndpoint (_endpoint.pxd).
from rdmamw.transport._base cimport rm_wr
from rdmamw.providers.shm._endpoint cimport ShmEndpoint, rm_xent


cdef class ShmTransport(ShmEndpoint):
    cdef int _check_exposed(self, rm_wr *wr, rm_xent *xe) noexcept nogil
    cdef bint _peer_exited(self) noexcept nogil
    cdef int _exposed(self, rm_wr *wr) noexcept nogil
    cdef int _assisted(self, rm_wr *wr) noexcept nogil
