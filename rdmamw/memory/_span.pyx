# The address and length of any contiguous buffer, without building numpy objects:
# the registration cache asks this on every large send (rdmamw/memory/buffer.py).
from cpython.buffer cimport PyBUF_ANY_CONTIGUOUS, PyBuffer_Release, PyObject_GetBuffer


def span(obj):
    """``(address, nbytes)`` of ``obj``'s buffer; BufferError if it is not contiguous,
    TypeError if it has no buffer protocol."""
    cdef Py_buffer view
    PyObject_GetBuffer(obj, &view, PyBUF_ANY_CONTIGUOUS)
    try:
        return <size_t>view.buf, view.len
    finally:
        PyBuffer_Release(&view)
