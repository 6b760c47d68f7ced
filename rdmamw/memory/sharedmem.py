"""Shared memory a peer process can map: what the shm provider's atomics need.

``shared(nbytes)`` returns a numpy uint8 array backed by a sealed memfd mapped
``MAP_SHARED`` (page-aligned, zeroed). Exposed with access "atomic" on shm, the peer
maps the same pages and its ``fetch_add`` / ``compare_swap`` are CPU atomics on them
(docs/remote-memory.md, "shm atomics"); on tcp and verbs it is ordinary memory. The
memfd is closed when the last view of the array is gone (an exposure holds one)."""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

from rdmamw.memory.buffer import span

#: what the peer checks before it maps a region's memfd: it cannot shrink under it
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_lock = threading.Lock()
#: the live segments, by base address: (base, size, fd), sorted
_segments: list[tuple[int, int, int]] = []


def shared(nbytes: int) -> np.ndarray:
    """A zeroed ``nbytes``-byte uint8 array in memory a peer can map (a sealed memfd,
    rounded up to whole pages), for regions exposed "atomic" on shm; view it as
    ``.view(np.uint64)`` for the words."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, not {nbytes}")
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    fd = os.memfd_create("rdmamw-shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    arr = np.frombuffer(mm, np.uint8, nbytes)
    base = span(arr)[0]
    with _lock:
        bisect.insort(_segments, (base, size, fd))
    weakref.finalize(mm, _drop, base, size, fd)
    return arr


def _drop(base: int, size: int, fd: int) -> None:
    with _lock:
        _segments.remove((base, size, fd))
    os.close(fd)


def file_of(buf: Any) -> tuple[int, int] | None:
    """``(fd, offset)``: the memfd of this process holding all of ``buf``, and where
    ``buf`` starts in it; None when ``buf`` is not memory from :func:`shared`."""
    addr, n = span(buf)
    with _lock:
        i = bisect.bisect_right(_segments, (addr, 1 << 64, 1 << 31)) - 1
        if i < 0:
            return None
        base, size, fd = _segments[i]
    if addr + n > base + size:
        return None
    return fd, addr - base
