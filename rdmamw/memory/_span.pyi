"""Stub of rdmamw/memory/_span.pyx. Checked by stubtest (`make lint`)."""

from _typeshed import ReadableBuffer

def span(obj: ReadableBuffer) -> tuple[int, int]:
    """``(address, nbytes)`` of ``obj``'s buffer; BufferError if it is not contiguous,
    TypeError if it has no buffer protocol."""
