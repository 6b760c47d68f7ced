from cpython.ref cimport PyObject

cdef object take_lease(object cache, object buf, bint closed)
cdef int end_lease(object lease) except -1
cdef void end_owned(PyObject *lease) noexcept
