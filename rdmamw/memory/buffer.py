"""Where a buffer's memory lives and which object owns it.

The registration cache and the pools key registrations by the object that *owns* the
memory (the end of a numpy ``.base`` / ``memoryview.obj`` chain), not by the view the
user passed: every slice of one array then hits one registration, and the owner is
the object whose death frees the memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from rdmamw.errors import RegistrationError


def span(buf: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous buffer (anything with the buffer protocol).

    Raises :class:`RegistrationError` for a non-contiguous buffer: it is not one range
    of memory, so it cannot be registered or sent without a copy."""
    if isinstance(buf, np.ndarray):
        if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
            raise RegistrationError("buffer is not contiguous (copy it with "
                                    "numpy.ascontiguousarray first)")
        return buf.__array_interface__["data"][0], buf.nbytes
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise RegistrationError(f"{type(buf).__name__} does not support the buffer "
                                "protocol") from e
    if not mv.contiguous:
        raise RegistrationError("buffer is not contiguous")
    if mv.nbytes == 0:
        return 0, 0
    try:
        flat = mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")
        arr = np.frombuffer(flat, np.uint8)
    except (TypeError, ValueError) as e:
        raise RegistrationError(f"cannot address this buffer: {e}") from e
    return arr.__array_interface__["data"][0], mv.nbytes


def owner(buf: Any) -> Any:
    """The object that owns ``buf``'s memory: follow ``ndarray.base`` and
    ``memoryview.obj`` to the end. A torch tensor seen through ``.numpy()`` ends at
    the tensor (it has no buffer protocol itself, but it owns the storage)."""
    obj = buf
    while True:
        if isinstance(obj, memoryview):
            nxt = obj.obj
        elif isinstance(obj, np.ndarray):
            nxt = obj.base
        else:
            return obj
        if nxt is None:
            return obj
        obj = nxt


def owner_span(root: Any, buf: Any) -> tuple[int, int]:
    """The range the owner holds: its own buffer, or (for an owner without the buffer
    protocol, e.g. a torch tensor) the range of the view the user passed."""
    storage = getattr(root, "untyped_storage", None)
    if storage is not None and callable(storage):      # torch.Tensor
        st = storage()
        return st.data_ptr(), st.nbytes()
    try:
        return span(root)
    except RegistrationError:
        return span(buf)
