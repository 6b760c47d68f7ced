"""Registration cache: register a large user buffer once, not per send.

Registering memory (``ibv_reg_mr``: pin the pages, build the NIC's translation) costs
more than moving a few megabytes, so a buffer is registered on its first use and the
registration is reused for every later send from it, or from any slice of it.

Keys and safety. A registration belongs to the object that *owns* the memory
(:func:`rdmamw.memory.buffer.owner`: a numpy array's ``.base`` chain, a memoryview's
exporter, a torch tensor) and covers the owner's whole range. A hit needs the same
owner object, still alive, still at the same address and length; so a handle is never
handed out for memory that was freed or moved:

* owners that support weak references (numpy arrays, mmap): the cache
  holds a weak reference with a callback; when the owner is freed its entry is
  invalidated at once and deregistered (numpy calls the callback *before* it frees the
  data). The cache does not keep such buffers alive.
* owners without weak references (``bytes``, ``bytearray``) and torch storages (a new
  wrapper object per call, so recognised by address and length): the cache keeps a
  strong reference until the entry is evicted, so the memory cannot be freed under
  it. The trade-off: such a buffer stays in memory while cached (at most
  ``max_bytes`` of them); ``clear()`` or a smaller ``RDMAMW_REGCACHE_BYTES`` lets go.
* an owner whose memory moved (``ndarray.resize``, a grown ``bytearray``) no longer
  matches the entry's range: the old registration is dropped and a new one made.

While a :class:`Lease` is held (a send or READ in flight) its entry is never evicted
and the leased buffer is kept exported, so it can be neither freed nor resized.

Bounded by bytes: idle entries are evicted least-recently-used first to keep the
registered bytes under ``max_bytes`` (``RDMAMW_REGCACHE_BYTES``, default 1 GiB); only
entries in use may take it over (the channel layer also keeps each cache within a
quarter of the provider's pinned budget). An owner larger than ``max_bytes`` is not
cached: only the part a use needs is registered, for that use (not the whole owner each
time). ``max_bytes=0`` disables caching (register per use). A registration the
provider refuses for its budget (RegistrationError) is tried once more after the
cache's own idle entries went."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from rdmamw import _fork, config
from rdmamw.errors import RegistrationError
from rdmamw.memory.buffer import by_identity, owner, owner_span, span

MAX_BYTES_ENV = "RDMAMW_REGCACHE_BYTES"

Register = Callable[[int, int], Any]
Deregister = Callable[[Any], None]


def default_max_bytes() -> int:
    """``$RDMAMW_REGCACHE_BYTES`` ("512M", "2G", bytes) or 1 GiB."""
    return config.get(MAX_BYTES_ENV)


class _Entry:
    __slots__ = ("addr", "length", "handle", "ref", "strong", "inuse", "dead", "cached",
                 "key", "__weakref__")

    def __init__(self, addr: int, length: int, handle: Any, cached: bool) -> None:
        self.addr, self.length, self.handle = addr, length, handle
        self.ref: weakref.ref | None = None
        self.strong: Any = None
        self.inuse = 0
        self.dead = False
        self.cached = cached
        self.key: Any = 0

    def alive_owner(self) -> Any:
        return self.strong if self.ref is None else self.ref()


class Lease:
    """One use of a registration: ``handle`` (the provider's), ``addr``/``length`` of
    the leased buffer and its ``offset`` inside the registered range. Release it when
    the transfer completed (``with`` does); until then the buffer stays exported."""

    __slots__ = ("handle", "addr", "length", "offset", "_entry", "_cache", "_hold")

    def __init__(self, cache: RegCache, entry: _Entry, addr: int, length: int,
                 hold: memoryview) -> None:
        self.handle = entry.handle
        self.addr, self.length = addr, length
        self.offset = addr - entry.addr
        self._entry: _Entry | None = entry
        self._cache = cache
        self._hold = hold

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            raise RegistrationError("lease released twice")
        hold, self._hold = self._hold, None
        self._cache._release(entry)
        hold.release()

    @property
    def released(self) -> bool:
        return self._entry is None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_entry", None) is not None:
            try:
                self.release()
            except RegistrationError:       # the cache went first (a collected cycle)
                pass

    def __repr__(self) -> str:
        return (f"<Lease handle={self.handle!r} addr={self.addr:#x} length={self.length}"
                f"{' released' if self._entry is None else ''}>")


class RegCache:
    """Address range -> registration handle, LRU-bounded by bytes; see the module doc.

    ``register(addr, length) -> handle`` and ``deregister(handle)`` come from the
    provider (``ibv_reg_mr`` / ``ibv_dereg_mr`` on verbs; cheap bookkeeping on shm)."""

    def __init__(self, register: Register, deregister: Deregister,
                 max_bytes: int | None = None, shared: bool = False) -> None:
        self._register, self._deregister = register, deregister
        #: used by every channel of a protection domain the process shares (verbs with
        #: memory windows): a channel's close leaves it alone
        self.shared = shared
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        if self.max_bytes < 0:
            raise RegistrationError(f"max_bytes must be >= 0, not {max_bytes}")
        # id(owner), or (addr, length) for owners kept by address -> entry; LRU first
        self._table: OrderedDict[Any, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._guard = _Guard(self)
        self._owner: int | None = None          # the thread holding _lock
        # work found while this thread held the lock (a weakref callback or a lease's
        # __del__ run by the garbage collector inside our own critical section):
        # ("freed" | "release", entry), done before the lock is let go
        self._pending: deque[tuple[str, _Entry]] = deque()
        self._cached_bytes = 0
        self._closed = False
        self.registrations = self.deregistrations = 0
        self.hits = self.misses = self.evictions = self.invalidations = 0
        self.uncached = 0
        self.bytes_pinned = 0
        _caches.add(self)

    # ---- use ---------------------------------------------------------------------

    def acquire(self, buf: Any, exact: bool = False) -> Lease:
        """A lease on a registration covering ``buf`` (registering its owner on a
        miss; with ``exact``, ``buf``'s own range and nothing around it: a remote
        region whose registration is what the device checks a peer's access against).
        Raises :class:`RegistrationError` for a non-contiguous or empty buffer and
        whatever ``register`` raises (nothing is cached then)."""
        addr, length = span(buf)
        if length == 0:
            raise RegistrationError("cannot register an empty buffer")
        root = owner(buf)
        raddr, rlen = owner_span(root, buf)
        if exact or not (raddr <= addr and addr + length <= raddr + rlen):
            root, raddr, rlen = buf, addr, length       # the view itself (or defensive)
        ident = by_identity(root)
        whole = rlen <= self.max_bytes
        if not whole:           # too big to cache: register only the part used, this once
            raddr, rlen = addr, length
        hold = memoryview(buf)
        with self._guard:
            if self._closed:
                hold.release()
                raise RegistrationError("the registration cache is closed")
            key = id(root) if ident else (raddr, rlen)
            e = self._table.get(key)
            if (e is not None and not e.dead and e.addr == raddr and e.length == rlen
                    and (e.alive_owner() is root if ident else e.strong is not None)):
                self.hits += 1
                self._table.move_to_end(key)
            else:
                if e is not None:                       # moved, resized or freed
                    self.invalidations += 1
                    self._drop(e)
                self.misses += 1
                e = self._new_entry(root, raddr, rlen, key, ident, whole)
            e.inuse += 1
        return Lease(self, e, addr, length, hold)

    def find(self, addr: int, length: int) -> Any | None:
        """The handle of a live registration containing ``[addr, addr+length)``, if any
        (for checking descriptors; it does not count as a hit)."""
        with self._guard:
            for e in self._table.values():
                if (not e.dead and e.addr <= addr and addr + length <= e.addr + e.length
                        and self._fresh(e)):
                    return e.handle
        return None

    @staticmethod
    def _fresh(e: _Entry) -> bool:
        """The owner is alive and still holds exactly the registered range."""
        root = e.alive_owner()
        if root is None:
            return False
        try:
            return owner_span(root, root) == (e.addr, e.length)
        except RegistrationError:
            return False

    def invalidate(self, buf: Any) -> bool:
        """Drop the registration of ``buf``'s owner now (the user is about to reuse
        the memory in a way the cache cannot see, e.g. remap it). True if one existed."""
        root = owner(buf)
        ident = by_identity(root)
        key = id(root) if ident else owner_span(root, buf)
        with self._guard:
            e = self._table.get(key)
            if e is None or (ident and e.alive_owner() is not root):
                return False
            self.invalidations += 1
            self._drop(e)
            return True

    def clear(self) -> None:
        """Deregister every idle entry (entries in use go when their lease is released)."""
        with self._guard:
            for e in list(self._table.values()):
                self._drop(e)

    def close(self) -> None:
        """Clear and refuse further use (the provider's protection domain goes next);
        nothing for a shared cache (its domain stays, other channels use it)."""
        if self.shared:
            return
        self.clear()
        with self._guard:
            self._closed = True

    def stats(self) -> dict[str, int]:
        """The counters (``bytes_pinned``: bytes registered now, cached or in use)."""
        with self._guard:
            return {
                "registrations": self.registrations,
                "deregistrations": self.deregistrations,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "invalidations": self.invalidations,
                "uncached": self.uncached,
                "entries": len(self._table),
                "bytes_pinned": self.bytes_pinned,
                "max_bytes": self.max_bytes,
            }

    def entries(self) -> list[tuple[int, int, bool]]:
        """``(addr, length, in_use)`` of the live cached entries, least recently used
        first (tests and debugging)."""
        with self._guard:
            return [(e.addr, e.length, e.inuse > 0) for e in self._table.values()]

    def __len__(self) -> int:
        return len(self._table)

    # ---- internals (called with the lock held) ---------------------------------------

    def _new_entry(self, root: Any, addr: int, length: int, key: Any, ident: bool,
                   cache: bool = True) -> _Entry:
        cached = cache and length <= self.max_bytes
        if cached:
            self._evict_for(length)
        try:
            handle = self._register(addr, length)
        except RegistrationError:
            # the provider's budget is full: our own idle entries go first, then once
            # more (entries in use stay; another cache's are its own to let go)
            if not self._evict_idle(length):
                raise
            handle = self._register(addr, length)
        self.registrations += 1
        self.bytes_pinned += length
        e = _Entry(addr, length, handle, cached)
        if not cached:
            self.uncached += 1
            return e
        try:
            if not ident:
                raise TypeError("kept by address: hold it")
            e.ref = weakref.ref(root, _freed_callback(self, e))
        except TypeError:
            e.strong = root
        e.key = key
        self._table[e.key] = e
        self._cached_bytes += length
        return e

    def _evict_for(self, length: int) -> None:
        """Evict idle entries, least recently used first, until ``length`` more fits."""
        if self._cached_bytes + length <= self.max_bytes:
            return
        for e in list(self._table.values()):
            if e.inuse == 0:
                self.evictions += 1
                self._drop(e)
                if self._cached_bytes + length <= self.max_bytes:
                    return

    def _evict_idle(self, need: int) -> int:
        """Evict idle entries, least recently used first, until ``need`` bytes are
        deregistered or none is idle; the bytes deregistered."""
        before = self.bytes_pinned
        for e in list(self._table.values()):
            if before - self.bytes_pinned >= need:
                break
            if e.inuse == 0:
                self.evictions += 1
                self._drop(e)
        return before - self.bytes_pinned

    def _drop(self, e: _Entry) -> None:
        """Take ``e`` out of the table; deregister it unless a lease still uses it."""
        if e.cached and self._table.get(e.key) is e:
            del self._table[e.key]
            self._cached_bytes -= e.length
        e.dead = True
        e.strong = e.ref = None
        if e.inuse == 0:
            self._dereg(e)

    def _dereg(self, e: _Entry) -> None:
        if e.handle is None:
            return
        handle, e.handle = e.handle, None
        self.bytes_pinned -= e.length
        self.deregistrations += 1
        self._deregister(handle)

    def _release(self, e: _Entry) -> None:
        if e.inuse <= 0:
            raise RegistrationError("lease released twice")
        if self._owner == threading.get_ident():    # collected inside our own call
            self._pending.append(("release", e))
            return
        with self._guard:
            self._release_now(e)

    def _release_now(self, e: _Entry) -> None:
        e.inuse -= 1
        if e.inuse == 0:
            if e.dead or not e.cached:
                self._dereg(e)
            elif self._cached_bytes > self.max_bytes:
                self._evict_for(0)

    def _drain(self) -> None:
        while self._pending:
            what, e = self._pending.popleft()
            if what == "release":
                self._release_now(e)
            elif self._table.get(e.key) is e:
                self.invalidations += 1
                self._drop(e)

    def _on_freed(self, e: _Entry) -> None:
        """The owner of ``e`` is being freed: never hand ``e`` out again, and drop it
        (at once, or before the lock is let go if this thread holds it)."""
        if e.dead:
            return
        e.dead = True
        self._pending.append(("freed", e))
        if self._owner != threading.get_ident():
            with self._guard:
                pass


class _Guard:
    """The cache's lock: remembers its holder, and does the deferred work (see
    ``_pending``) on the way in and out."""

    __slots__ = ("c",)

    def __init__(self, cache: RegCache) -> None:
        self.c = weakref.ref(cache)         # no cycle: the cache dies by refcount

    def __enter__(self) -> None:
        c = self.c()
        if c is None:                       # only while the collector tears a cycle down
            raise RegistrationError("the registration cache is gone")
        c._lock.acquire()
        c._owner = threading.get_ident()
        c._drain()

    def __exit__(self, *exc: Any) -> None:
        c = self.c()
        try:
            c._drain()
        finally:
            c._owner = None
            c._lock.release()


#: every live cache, so a fork child can give each a fresh lock
_caches: weakref.WeakSet[RegCache] = weakref.WeakSet()


@_fork.at_child
def _unlock_in_child() -> None:
    """A thread of the parent may have held a cache's lock at the fork; that thread
    does not exist in the child, so a lease collected there would wait for it forever.
    (The registrations themselves stay the parent's: the transport of an inherited
    channel deregisters nothing in a child.)"""
    for cache in list(_caches):
        cache._lock = threading.Lock()
        cache._owner = None


def _freed_callback(cache: RegCache, e: _Entry) -> Callable[[Any], None]:
    """A weakref callback that does not keep the cache alive."""
    cref = weakref.ref(cache)

    def freed(_ref: Any) -> None:
        c = cref()
        if c is not None:
            c._on_freed(e)
        else:
            e.dead = True
    return freed

