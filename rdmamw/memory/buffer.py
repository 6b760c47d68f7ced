"""Where a buffer's memory lives and which object owns it.

The registration cache and the pools key registrations by the object that *owns* the
memory (the end of a numpy ``.base`` / ``memoryview.obj`` chain), not by the view the
user passed: every slice of one array then hits one registration, and the owner is
the object whose death frees the memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from rdmamw.errors import RegistrationError
from rdmamw.memory._span import span as _span


def span(buf: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous buffer (anything with the buffer protocol).

    Raises :class:`RegistrationError` for a non-contiguous buffer: it is not one range
    of memory, so it cannot be registered or sent without a copy."""
    try:
        return _span(buf)
    except (BufferError, ValueError) as e:
        raise RegistrationError(f"buffer is not contiguous ({e}); copy it with "
                                "numpy.ascontiguousarray first") from e
    except TypeError as e:
        raise RegistrationError(f"{type(buf).__name__} does not support the buffer "
                                "protocol") from e


def owner(buf: Any) -> Any:
    """The object that owns ``buf``'s memory: follow ``ndarray.base`` and
    ``memoryview.obj`` to the end; for a torch tensor (seen through ``.numpy()``) its
    storage, which is what holds the memory."""
    obj = buf
    while True:
        if isinstance(obj, memoryview):
            nxt = obj.obj
        elif isinstance(obj, np.ndarray):
            nxt = obj.base
        else:
            storage = getattr(obj, "untyped_storage", None)
            return storage() if callable(storage) else obj
        if nxt is None:
            return obj
        obj = nxt


def by_identity(root: Any) -> bool:
    """Whether ``root`` is the one object owning its memory (so it can be told apart by
    ``is``). False for a torch storage: every ``untyped_storage()`` call makes a new
    wrapper around the same memory, so it is recognised by address and length, and
    the cache keeps the wrapper (and so the memory) alive instead."""
    return not _is_storage(root)


def _is_storage(obj: Any) -> bool:
    return (not isinstance(obj, (np.ndarray, memoryview, bytes, bytearray))
            and callable(getattr(obj, "data_ptr", None))
            and callable(getattr(obj, "nbytes", None)))


def owner_span(root: Any, buf: Any) -> tuple[int, int]:
    """The range the owner holds: its own buffer, a torch storage's range, or (for an
    owner without the buffer protocol) the range of the view the user passed."""
    if isinstance(root, np.ndarray):
        return span(root)
    if _is_storage(root):
        return root.data_ptr(), root.nbytes()
    try:
        return span(root)
    except RegistrationError:
        return span(buf)
