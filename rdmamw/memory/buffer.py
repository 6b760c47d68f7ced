"""Where a buffer's memory lives and which object owns it.

The registration cache and the pools key registrations by the object that *owns* the
memory (the end of a numpy ``.base`` / ``memoryview.obj`` chain), not by the view the
user passed: every slice of one array then hits one registration, and the owner is
the object whose death frees the memory."""

from __future__ import annotations

import sys
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


#: DLPack device types (dlpack.h DLDeviceType) whose memory the host can address
_DLPACK_HOST = {1: "cpu", 3: "cuda_host", 11: "rocm_host"}
_DLPACK_NAMES = {2: "cuda", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
                 12: "ext_dev", 13: "cuda_managed", 14: "oneapi", 15: "webgpu",
                 16: "hexagon", 17: "maia"}


def host_view(obj: Any) -> np.ndarray:
    """A numpy array over the host memory of ``obj``, an object without the buffer
    protocol that the channel was given (send_batch, send, recv_into, post_recv):
    a CPU torch tensor (its ``.numpy()`` view, whose base is the tensor, so the
    registration cache keys on the tensor's storage as for ``t.numpy()``), or any
    object exporting ``__dlpack__`` for host memory (``numpy.from_dlpack``). No copy.

    ``TypeError`` naming the device for device memory (a torch tensor not on the CPU,
    a DLPack device other than host memory, ``__cuda_array_interface__``), for a
    sparse tensor, and for anything else."""
    name = type(obj).__name__
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise TypeError(f"a {obj.device} tensor is device memory; the channel moves "
                            f"host memory only (copy it with .cpu())")
        if obj.layout != torch.strided:
            raise TypeError(f"a {obj.layout} tensor has no single range of memory "
                            f"(.to_dense() first)")
        t = obj.detach()
        try:
            return t.numpy()
        except TypeError:               # a dtype numpy lacks (bfloat16, ...): its bytes
            return t.view(torch.uint8).numpy() if t.is_contiguous() else t.numpy()
    if hasattr(obj, "__cuda_array_interface__"):
        raise TypeError(f"{name} is CUDA device memory (__cuda_array_interface__); the "
                        f"channel moves host memory only")
    device = getattr(obj, "__dlpack_device__", None)
    if device is None or not hasattr(obj, "__dlpack__"):
        raise TypeError(f"{name} has neither the buffer protocol nor __dlpack__")
    kind, index = device()
    kind = int(kind)
    if kind not in _DLPACK_HOST:
        raise TypeError(f"{name} is {_DLPACK_NAMES.get(kind, f'DLPack device type {kind}')}"
                        f":{index} device memory; the channel moves host memory only")
    return np.from_dlpack(obj)
