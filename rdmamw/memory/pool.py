"""Buffer pools: memory registered once, handed out by size class, per thread.

Medium messages are copied into registered buffers, and a large message received
without a destination of the user's (``recv_batch``) needs somewhere to land; both take
a buffer from a pool instead of allocating and registering one per message.

* **Tiers**: buffers come in a few size classes (64 KiB ... 64 MiB by default); a
  request takes the smallest tier that holds it, so a buffer is reused for any size
  in its class.
* **Shards**: each thread takes from its own shard (assigned round-robin on first use),
  with its own lock, so threads do not contend; a buffer goes back to the shard it came
  from, whichever thread releases it.
* **Bounded**: a shard holds at most ``max_bytes / shards`` (``RDMAMW_POOL_BYTES``,
  default 256 MiB, ``RDMAMW_POOL_SHARDS``, default the CPU count up to 8). When a tier is
  empty and the shard is full, idle buffers of other tiers are freed first; if that is
  not enough (or the request is larger than every tier) the buffer is a one-off
  ("overflow"): registered for this use and freed on release. Acquiring never blocks
  and never fails for lack of pool space.

Buffers are page-aligned (4K aliasing: docs/design.md). ``register(addr, length)`` /
``deregister(handle)`` are the provider's; each pooled buffer is registered once."""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from rdmamw import _fork, config
from rdmamw.errors import ConfigError, RegistrationError

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_TIERS = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
POOL_BYTES_ENV = "RDMAMW_POOL_BYTES"
POOL_SHARDS_ENV = "RDMAMW_POOL_SHARDS"
PAGE = 4096


def _no_register(addr: int, length: int) -> None:
    return None


def _no_deregister(handle: Any) -> None:
    return None


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose data starts on an ``align``
    boundary (its ``.base`` keeps the over-allocation alive)."""
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % align
    return raw[start:start + nbytes]


class _Block:
    __slots__ = ("array", "handle", "tier", "shard")

    def __init__(self, array: np.ndarray, handle: Any, tier: int, shard: _Shard | None):
        self.array, self.handle, self.tier, self.shard = array, handle, tier, shard


class PooledBuffer:
    """A buffer from a :class:`BufferPool`: ``view`` (a writable uint8 numpy array of
    the requested length), ``handle`` (its registration) and ``address``. Give it back
    with :meth:`release` (or ``with``); it must not be used afterwards."""

    __slots__ = ("view", "handle", "address", "_block", "_pool")

    def __init__(self, pool: BufferPool, block: _Block, nbytes: int) -> None:
        self.view = block.array[:nbytes]
        self.handle = block.handle
        self.address: int = block.array.__array_interface__["data"][0]
        self._block: _Block | None = block
        self._pool = pool

    def __len__(self) -> int:
        return len(self.view)

    @property
    def capacity(self) -> int:
        """Bytes of the underlying buffer (its tier's size)."""
        return len(self._block.array) if self._block is not None else 0

    def release(self) -> None:
        block, self._block = self._block, None
        if block is None:
            raise RegistrationError("pooled buffer released twice")
        self._pool._give_back(block)

    @property
    def released(self) -> bool:
        return self._block is None

    def __enter__(self) -> PooledBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<PooledBuffer {len(self.view)} of {self.capacity} B handle={self.handle!r}>"


class _Shard:
    def __init__(self, ntiers: int, max_bytes: int) -> None:
        # re-entrant: the garbage collector may return a buffer (allocate()'s
        # finalizer) while this thread is inside the shard; every update under the
        # lock is a single consistent step, so a nested return is harmless
        self.lock = threading.RLock()
        self.free: list[list[_Block]] = [[] for _ in range(ntiers)]
        self.max_bytes = max_bytes
        self.bytes = 0                      # pooled buffers owned by this shard
        self.idle_bytes = 0
        self.acquires = self.reuses = self.allocations = self.evictions = 0


class BufferPool:
    """Registered-once buffers in size classes, sharded per thread; see the module doc."""

    def __init__(self, tiers: tuple[int, ...] = DEFAULT_TIERS, max_bytes: int | None = None,
                 shards: int | None = None,
                 register: Callable[[int, int], Any] = _no_register,
                 deregister: Callable[[Any], None] = _no_deregister) -> None:
        if not tiers or any(t <= 0 for t in tiers) or list(tiers) != sorted(set(tiers)):
            raise ConfigError(f"tiers must be increasing positive sizes, not {tiers}")
        if max_bytes is None:
            max_bytes = config.get(POOL_BYTES_ENV)
        if shards is None:
            shards = config.get(POOL_SHARDS_ENV) or min(8, os.cpu_count() or 1)
        if shards < 1:
            raise ConfigError(f"shards must be >= 1, not {shards}")
        self.tiers = tuple(int(t) for t in tiers)
        self.max_bytes = int(max_bytes)
        self._register, self._deregister = register, deregister
        #: whether buffers are really registered (the default pool's are not: each
        #: transport makes a destination visible itself), so counted as pinned
        self.registering = register is not _no_register
        self._shards = [_Shard(len(self.tiers), self.max_bytes // shards) for _ in range(shards)]
        self._local = threading.local()
        self._next_shard = itertools.count()
        self._lock = threading.RLock()      # the counters only (re-entrant: see _Shard)
        self.overflows = 0
        self.registrations = self.deregistrations = 0
        self._closed = False
        _pools.add(self)

    # ---- use ---------------------------------------------------------------------

    def tier_for(self, nbytes: int) -> int | None:
        """Index of the smallest tier holding ``nbytes``, None above the largest."""
        for i, size in enumerate(self.tiers):
            if nbytes <= size:
                return i
        return None

    def acquire(self, nbytes: int) -> PooledBuffer:
        """A registered buffer of at least ``nbytes`` (``view`` has exactly ``nbytes``)."""
        if nbytes < 0:
            raise RegistrationError(f"cannot acquire {nbytes} bytes")
        if self._closed:
            raise RegistrationError("the buffer pool is closed")
        t = self.tier_for(nbytes)
        shard = self._my_shard()
        if t is not None:
            size = self.tiers[t]
            with shard.lock:
                shard.acquires += 1
                if shard.free[t]:
                    block = shard.free[t].pop()
                    shard.idle_bytes -= size
                    shard.reuses += 1
                    return PooledBuffer(self, block, nbytes)
                if self._make_room(shard, size):
                    shard.bytes += size
                    shard.allocations += 1
                    try:
                        block = self._new_block(size, t, shard)
                    except BaseException:
                        shard.bytes -= size
                        raise
                    return PooledBuffer(self, block, nbytes)
        with self._lock:
            self.overflows += 1
        return PooledBuffer(self, self._new_block(max(nbytes, 1), -1, None), nbytes)

    def trim(self) -> int:
        """Free every idle buffer; returns the bytes freed."""
        freed = 0
        for shard in self._shards:
            with shard.lock:
                for t, free in enumerate(shard.free):
                    while free:
                        self._free_block(free.pop())
                        shard.bytes -= self.tiers[t]
                        shard.idle_bytes -= self.tiers[t]
                        freed += self.tiers[t]
        return freed

    def close(self) -> None:
        """Free the idle buffers and refuse new requests; buffers still out are freed
        when released."""
        self._closed = True
        self.trim()

    def stats(self) -> dict[str, int]:
        s = {"acquires": 0, "reuses": 0, "allocations": 0, "evictions": 0,
             "bytes_pooled": 0, "bytes_idle": 0}
        for shard in self._shards:
            with shard.lock:
                s["acquires"] += shard.acquires
                s["reuses"] += shard.reuses
                s["allocations"] += shard.allocations
                s["evictions"] += shard.evictions
                s["bytes_pooled"] += shard.bytes
                s["bytes_idle"] += shard.idle_bytes
        with self._lock:
            s.update(overflows=self.overflows, registrations=self.registrations,
                     deregistrations=self.deregistrations, shards=len(self._shards),
                     max_bytes=self.max_bytes)
        return s

    # ---- internals -------------------------------------------------------------------

    def _my_shard(self) -> _Shard:
        try:
            return self._local.shard
        except AttributeError:
            shard = self._shards[next(self._next_shard) % len(self._shards)]
            self._local.shard = shard
            return shard

    def _make_room(self, shard: _Shard, size: int) -> bool:
        """(Shard lock held.) Free idle buffers of other tiers, largest first, until
        ``size`` more fits under the shard's bound."""
        for t in range(len(self.tiers) - 1, -1, -1):
            free = shard.free[t]
            while free and shard.bytes + size > shard.max_bytes:
                self._free_block(free.pop())
                shard.bytes -= self.tiers[t]
                shard.idle_bytes -= self.tiers[t]
                shard.evictions += 1
        return shard.bytes + size <= shard.max_bytes

    def _new_block(self, size: int, tier: int, shard: _Shard | None) -> _Block:
        array = aligned_empty(size)
        handle = self._register(array.__array_interface__["data"][0], size)
        with self._lock:
            self.registrations += self.registering
        return _Block(array, handle, tier, shard)

    def _free_block(self, block: _Block) -> None:
        self._deregister(block.handle)
        with self._lock:
            self.deregistrations += self.registering

    def _give_back(self, block: _Block) -> None:
        shard = block.shard
        if shard is None:                   # an overflow buffer: one use only
            self._free_block(block)
            return
        size = self.tiers[block.tier]
        with shard.lock:
            if self._closed:
                self._free_block(block)
                shard.bytes -= size
                return
            shard.free[block.tier].append(block)
            shard.idle_bytes += size


#: every live pool, so a fork child can give each fresh locks
_pools: weakref.WeakSet[BufferPool] = weakref.WeakSet()


@_fork.at_child
def _unlock_in_child() -> None:
    """A thread of the parent may have held a pool's lock at the fork; it does not
    exist in the child, where the next acquire (or a buffer's finalizer at exit) would
    wait for it forever. The buffers themselves are the child's own copies."""
    global _default_lock
    _default_lock = threading.Lock()
    for pool in list(_pools):
        pool._lock = threading.RLock()
        for shard in pool._shards:
            shard.lock = threading.RLock()


# ---- the process-wide pool for received rendezvous messages ------------------------

_default: BufferPool | None = None
_default_lock = threading.Lock()


def default_pool() -> BufferPool:
    """The process's pool for destinations of large messages ``recv_batch`` receives
    without a posted buffer (created on first use; no registration: each transport
    makes a destination visible to its peer itself)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = BufferPool()
    return _default


def allocate(nbytes: int, pool: BufferPool | None = None) -> np.ndarray:
    """A writable uint8 array of ``nbytes`` from ``pool`` (default :func:`default_pool`).
    It goes back to the pool when the array (and every view of it) is collected, so the
    holder (a received ``Message``, a collective's result) decides when the memory is
    reusable; nothing to release."""
    pb = (pool or default_pool()).acquire(nbytes)
    # numpy points a view's .base at the first array that owns its data or whose base
    # is not an array: an array over a memoryview is such a base, so every view of
    # the result keeps the result (and so the block) alive
    out = np.frombuffer(memoryview(pb.view), np.uint8)
    weakref.finalize(out, pb.release)
    return out
