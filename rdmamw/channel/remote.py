"""Remote memory on a channel (docs/remote-memory.md): expose a buffer to the peer and
read or write the peer's exposed buffers, one-sided and batched, and run atomics on
their words.

The owner's side: :meth:`RemoteMemory.expose` returns a :class:`Region`, whose
``ref`` (a :class:`RegionRef`, picklable, ``bytes(ref)`` and back) the peer is given by
any means; ``region.revoke()`` ends the exposure before it returns. The peer's side:
``read`` / ``write`` / ``batch`` (one chain, one doorbell; its atomics among its reads
and writes), ``gather`` / ``scatter`` (many pieces of one region given as arrays,
checked in C), ``fetch_add`` / ``compare_swap`` where the provider can do them. What the
engine's unit does (rdmamw/channel/_remote.pyx) is posting; everything a caller can get
wrong is checked here first, and the provider checks each request against the owner's
exposure again."""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import numpy as np

from rdmamw import _fork
from rdmamw.channel._remote import (
    ONE_CHECKED,
    OP_CMP_SWAP,
    OP_FETCH_ADD,
    OP_GATHER,
    OP_READ,
    OP_SCATTER,
    OP_WRITE,
    RemoteOps,
    pieces,
)
from rdmamw.errors import (
    AccessDenied,
    ChannelClosed,
    ForeignReference,
    OutOfRange,
    PeerLost,
    ProviderUnavailable,
    RegionRevoked,
    RemoteAccessError,
    Timeout,
)
from rdmamw.memory.buffer import host_view
from rdmamw.memory.sharedmem import file_of

#: access letters -> bits of a reference (R read, W write, A atomics)
R, W, A = 1, 2, 4
ACCESS = {"r": R, "w": W, "rw": R | W, "atomic": R | W | A}
#: the transport's expose() access bits (rdmamw/transport/_base.pxd RM_ACCESS_*)
_TP_READ, _TP_WRITE, _TP_ATOMIC = 1, 2, 4
#: transport return codes (rdmamw/transport/_base.pxd)
_ERR_BOUNDS, _ERR_PEER_LOST, _ERR_CLOSED = -1, -2, -3
_ERR_UNSUPPORTED, _ERR_AGAIN, _ERR_LATE = -5, -6, -7

#: reference wire format: magic, version, access, reserved, channel, key, tag, base,
#: length, check (the first 8 bytes of BLAKE2b of the 40 bytes before it)
_REF = struct.Struct("<4sBBHQIIQQ")
_MAGIC = b"RMRF"
_VERSION = 1
REF_BYTES = _REF.size + 8
#: an atomic's operands, and its result in the first (native order: the NIC's)
_WORDS = struct.Struct("=QQ")
#: an operation of a chain (RemoteOps.post): kind (OP_*), local buffer, offset in it,
#: length (an atomic's: 8, its local range _WORDS.size), key, tag, remote address; a
#: gather's / scatter's: its Pieces, 0, the span of its pieces, key, tag, the span's start
Op = tuple[int, Any, int, int, int, int, int]
#: the kinds that change the owner's memory (a gather reads, as a read)
_WRITES = (OP_WRITE, OP_SCATTER, OP_FETCH_ADD, OP_CMP_SWAP)
#: held while a channel's atomic state (its lock and operand buffer) is made; the
#: atomics of a channel take turns on that buffer (each waits for its answer anyway),
#: those of different channels do not wait for each other
_ATOMIC_LOCK = threading.Lock()


@_fork.at_child
def _new_atomic_lock() -> None:
    global _ATOMIC_LOCK
    _ATOMIC_LOCK = threading.Lock()     # a thread of the parent may have held it


def _check_word(head: bytes) -> bytes:
    return hashlib.blake2b(head, digest_size=8).digest()


@dataclass(frozen=True)
class RegionRef:
    """A reference to a region a peer exposed: small, picklable, and ``bytes(ref)`` /
    :meth:`from_bytes` for any transport (a message, a Dask task, a Ray object).

    ``channel`` is the identity of the owner's endpoint, ``key`` and ``tag`` the
    exposure (its slot and generation), ``base`` and ``length`` its bytes in the owner,
    ``access`` R/W/A bits. It grants nothing by itself: the owner's exposure does."""

    channel: int
    key: int
    tag: int
    base: int
    length: int
    access: int

    def __bytes__(self) -> bytes:
        head = _REF.pack(_MAGIC, _VERSION, self.access, 0, self.channel, self.key,
                         self.tag, self.base, self.length)
        return head + _check_word(head)

    @classmethod
    def from_bytes(cls, data: Any) -> RegionRef:
        """Decode ``bytes(ref)``; RemoteAccessError for anything that is not one."""
        try:
            raw = bytes(memoryview(data))
        except TypeError as e:
            raise RemoteAccessError(f"a region reference is bytes, not "
                                    f"{type(data).__name__}") from e
        if len(raw) != REF_BYTES:
            raise RemoteAccessError(f"a region reference is {REF_BYTES} bytes, not "
                                    f"{len(raw)}")
        head = raw[:_REF.size]
        magic, version, access, reserved, channel, key, tag, base, length = \
            _REF.unpack(head)
        if magic != _MAGIC or version != _VERSION:
            raise RemoteAccessError("not a region reference (magic or version)")
        if raw[_REF.size:] != _check_word(head):
            raise RemoteAccessError("a damaged region reference (check word)")
        if reserved or access & ~(R | W | A) or not access or not length or not tag \
                or base + length > 1 << 64:
            raise RemoteAccessError("a region reference with impossible fields")
        return cls(channel, key, tag, base, length, access)


class Region:
    """A buffer exposed to the peer of one channel; ``ref`` is what the peer needs.
    The exposure holds the buffer (its memory stays valid even if the caller drops
    it) until :meth:`revoke` or the channel closes."""

    def __init__(self, ops: RemoteOps, ref: RegionRef) -> None:
        self._ops = ops
        self.ref = ref
        self.revoked = False

    def revoke(self) -> None:
        """End the exposure: when this returns, no byte of the region moves any more
        (an access the peer had in progress has ended) and a later access fails on the
        peer with RegionRevoked. Timeout when a peer stopped in the middle of an access
        (its process is frozen): the buffer then stays held as long as the channel."""
        if self.revoked:
            return
        self.revoked = True
        rc = self._ops.unexpose(self.ref.key)
        if rc == _ERR_AGAIN:
            raise Timeout("revoke: the peer stopped in the middle of an access to the "
                          "region; it is withdrawn, and its buffer stays held by the "
                          "channel")

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.revoke()

    def __repr__(self) -> str:
        state = "revoked" if self.revoked else "exposed"
        return f"<Region {self.ref.length} B {_access_name(self.ref.access)} {state}>"


class Done:
    """The handle of a one-sided operation or batch. On providers that move the bytes
    inside the call (shm) it is done when returned; ``wait()`` / ``done()`` / ``await``
    are the same on every provider."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None

    def __await__(self) -> Any:
        return iter(())


#: the handle of a single read or write (it moved its bytes inside the call)
DONE = Done(1)


class Posted(Done):
    """The handle of a batch (``post()``, ``readv``, ``writev``): ``values`` holds
    the old values of its atomics in the order they were added (empty without any);
    ``wait()`` and ``await`` give them too."""

    __slots__ = ("values",)

    def __init__(self, count: int, values: tuple[int, ...] = ()) -> None:
        super().__init__(count)
        self.values = values

    def wait(self, timeout: float | None = None) -> tuple[int, ...]:  # type: ignore[override]
        return self.values

    def __await__(self) -> Any:
        return self.values
        yield       # a generator: awaiting it gives the values at once


class Fetched(Done):
    """The handle of an atomic: ``wait()`` (and ``await``) give the word's value
    before the operation, also in ``value``."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        super().__init__(1)
        self.value = value

    def wait(self, timeout: float | None = None) -> int:  # type: ignore[override]
        return self.value

    def __await__(self) -> Any:
        return self.value
        yield       # a generator: awaiting it gives the value at once


def _no_atomics(provider: str) -> str:
    """Why ``provider`` has no atomics on exposed memory (ProviderUnavailable's text)."""
    if provider == "shm":
        return ("atomics on exposed memory: not on this shm channel (the peer maps the "
                "owner's shared memory with pidfd_getfd, which needs a pidfd of the peer "
                "and cross-memory attach both ways: ptrace rules, RDMAMW_SHM_CMA)")
    return f"atomics on exposed memory: not on the {provider} provider"


def _access_name(bits: int) -> str:
    return {R: "r", W: "w", R | W: "rw", R | W | A: "atomic"}.get(bits, f"0x{bits:x}")


def _as_ref(ref: Any) -> RegionRef:
    return ref if isinstance(ref, RegionRef) else RegionRef.from_bytes(ref)


def _buffer(obj: Any) -> Any:
    """``obj`` if it has the buffer protocol, else its host view (torch, DLPack)."""
    try:
        memoryview(obj)
    except TypeError:
        return host_view(obj)
    return obj


def _nbytes(obj: Any) -> int:
    return memoryview(obj).nbytes


def _int64s(values: Any, what: str) -> np.ndarray:
    """``values`` (a 1-D array or sequence of integers) as a copy of contiguous int64s
    (uint64s of 2^63 and above turn negative, which the checks refuse): the batch
    keeps what was checked, whatever the caller does with its array before the post."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"{what}: a 1-D array or sequence of integers, not "
                        f"{arr.ndim}-D {arr.dtype}")
    return np.array(arr, np.int64)


class Batch:
    """One-sided operations posted together: one chain, one doorbell
    (``ch.batch()``; then ``read`` / ``write`` / ``fetch_add`` / ``compare_swap`` any
    number of times, then ``post()``, whose handle's ``values`` are the atomics' old
    values)."""

    def __init__(self, rm: RemoteMemory) -> None:
        self._rm = rm
        self._ops: list[Op] = []
        self._refs: list[RegionRef] = []
        self._count = 0                 # operations (a gather's / scatter's: its pieces)
        self._notify: list[Any] = []
        #: the atomics' operands, _WORDS each in the order added; each's old value
        #: lands in its first word (one buffer: on verbs one lease for all of them)
        self._words = bytearray()
        #: the reference the last atomic passed the checks with (the next one on it
        #: needs only its word's checked: many atomics of a batch name one region)
        self._atomic_ref: RegionRef | None = None

    def read(self, ref: Any, into: Any, offset: int = 0) -> Batch:
        """READ ``len(into)`` bytes of the region at ``offset`` into ``into``."""
        into = _buffer(into)
        self._add(OP_READ, ref, into, offset, _nbytes(into))
        return self

    def readv(self, ranges: Iterable[tuple[Any, Any, int]]) -> Batch:
        """A READ per ``(into, ref, offset)`` of ``ranges`` (each checked as
        :meth:`read` checks it; one that is refused adds none of them)."""
        return self._vector(OP_READ, ranges)

    def writev(self, ranges: Iterable[tuple[Any, Any, int]]) -> Batch:
        """A WRITE per ``(src, ref, offset)`` of ``ranges`` (each checked as
        :meth:`write` checks it; one that is refused adds none of them)."""
        return self._vector(OP_WRITE, ranges)

    def _vector(self, kind: int, ranges: Iterable[tuple[Any, Any, int]]) -> Batch:
        at, count = len(self._ops), self._count
        try:
            for local, ref, offset in ranges:
                local = _buffer(local)
                self._add(kind, ref, local, offset, _nbytes(local))
        except BaseException:
            del self._ops[at:], self._refs[at:]
            self._count = count
            raise
        return self

    def gather(self, into: Any, ref: Any, offsets: Any, size: Any = None) -> Batch:
        """READ many pieces of one region into ``into``, one after the other from its
        first byte: piece ``i`` is at ``offsets[i]`` of the region (a 1-D integer array
        or sequence) and ``size`` bytes long (an int), or ``size[i]`` bytes (an array),
        or, without ``size``, ``len(into) // len(offsets)``; the pieces fill ``into``
        exactly (else ValueError). A READ a piece, checked in C as :meth:`read` checks
        one: a piece outside the region is OutOfRange and adds nothing."""
        return self._pieces(OP_GATHER, into, ref, offsets, size)

    def scatter(self, src: Any, ref: Any, offsets: Any, size: Any = None,
                notify: Any = None) -> Batch:
        """WRITE ``src``, cut into consecutive pieces, to many places of one region:
        piece ``i`` to ``offsets[i]`` (pieces and checks as :meth:`gather`'s);
        ``notify`` as :meth:`write`'s."""
        self._pieces(OP_SCATTER, src, ref, offsets, size)
        if notify is not None:
            self._notify.append(notify)
        return self

    def _pieces(self, kind: int, local: Any, ref: Any, offsets: Any, size: Any) -> Batch:
        local = _buffer(local)
        nbytes = _nbytes(local)
        offs = _int64s(offsets, "offsets")
        if size is None:
            lengths, each = None, nbytes // max(1, len(offs))
        elif isinstance(size, (int, np.integer)):
            lengths, each = None, int(size)
        else:
            lengths, each = _int64s(size, "size"), 0
        r = self._rm._checked(_as_ref(ref), W if kind == OP_SCATTER else R, 0, 0)
        p = pieces(local, offs, lengths, each, r.length)
        if p.bad >= 0:
            n = each if lengths is None else int(lengths[p.bad])
            if p.why == 2:
                raise ValueError(f"piece {p.bad}: {n} bytes (a piece is at least 1)")
            raise OutOfRange(f"piece {p.bad}: {n} bytes at offset {int(offs[p.bad])} of "
                             f"a region of {r.length}")
        if p.total != nbytes:
            raise ValueError(f"the pieces hold {p.total} bytes, the buffer {nbytes}")
        if p.count:
            self._ops.append((kind, p, 0, p.hi - p.lo, r.key, r.tag, r.base + p.lo))
            self._refs.append(r)
            self._count += p.count
        return self

    def write(self, src: Any, ref: Any, offset: int = 0, notify: Any = None) -> Batch:
        """WRITE ``src`` into the region at ``offset``; ``notify`` goes to the owner as a
        message once every write of the batch is visible to it."""
        src = _buffer(src)
        self._add(OP_WRITE, ref, src, offset, _nbytes(src))
        if notify is not None:
            self._notify.append(notify)
        return self

    def fetch_add(self, ref: Any, offset: int, value: int) -> Batch:
        """Add ``value`` (mod 2^64) to the aligned 64-bit word at ``offset`` atomically,
        in the chain's order (checked as :meth:`RemoteMemory.fetch_add` checks it);
        its old value is in the post's ``values``, at this atomic's place among the
        batch's atomics."""
        return self._atomic(OP_FETCH_ADD, ref, offset, value, 0)

    def compare_swap(self, ref: Any, offset: int, expected: int, desired: int) -> Batch:
        """Replace the aligned 64-bit word at ``offset`` by ``desired`` if it holds
        ``expected``, atomically, in the chain's order; its old value is in the post's
        ``values`` (``expected`` when it was replaced), as for :meth:`fetch_add`."""
        return self._atomic(OP_CMP_SWAP, ref, offset, expected, desired)

    def _atomic(self, kind: int, ref: Any, offset: int, a: int, b: int) -> Batch:
        r = self._atomic_ref
        if r is None or ref is not r or not 0 <= offset <= r.length - 8 \
                or (r.base + offset) % 8:
            r = self._atomic_ref = self._rm._checked_atomic(_as_ref(ref), offset)
        at = len(self._words)
        self._words += _WORDS.pack(a % (1 << 64), b % (1 << 64))
        self._ops.append((kind, self._words, at, 8, r.key, r.tag, r.base + offset))
        self._refs.append(r)
        self._count += 1
        return self

    def _add(self, kind: int, ref: Any, local: Any, offset: int, n: int) -> None:
        r = self._rm._checked(_as_ref(ref), W if kind == OP_WRITE else R, offset, n)
        self._ops.append((kind, local, 0, n, r.key, r.tag, r.base + offset))
        self._refs.append(r)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def post(self, timeout: float | None = None) -> Posted:
        """Post every operation as one chain, run in the order added; a refused one
        raises its typed error and, since the provider checks the whole chain first,
        nothing of the batch moved (unless the region was revoked during the chain:
        RegionRevoked, the operations before it are done, the rest are not). Timeout
        once ``timeout`` s passed (None: no deadline, the provider's peer bound): the
        chain is abandoned, its reads' destinations are not written after this returns
        (docs/remote-memory.md). The handle's ``values``: the atomics' old values."""
        ops, self._ops = self._ops, []
        refs, self._refs = self._refs, []
        notify, self._notify = self._notify, []
        words, self._words = self._words, bytearray()
        count, self._count = self._count, 0
        until = None if timeout is None else time.monotonic() + timeout
        if ops and words and self._rm._transport.registers_memory:
            words = self._rm._post_lent(ops, refs, words, timeout)
        elif ops:
            self._rm._post(ops, refs, timeout)
        for msg in notify:
            self._rm._notify(msg, None if until is None
                             else max(0.0, until - time.monotonic()))
        return Posted(count, tuple(w[0] for w in _WORDS.iter_unpack(words)) if words
                      else ())


class RemoteMemory:
    """The remote-memory methods of a Channel (mixed into rdmamw.channel.Channel)."""

    provider: str
    closed: bool
    _transport: Any
    _rmem: RemoteOps | None = None
    #: the channel's atomics take turns on the lock; the buffer holds an atomic's
    #: operands and then its result (one buffer: on verbs registered once)
    _atomic_state: tuple[threading.Lock, bytearray] | None = None
    #: batches' operand buffers on a transport that registers memory (verbs), kept for
    #: the next batches: each is registered once, not once a post
    _spare_words: list[bytearray] | None = None

    # ---- the owner ------------------------------------------------------------------

    def expose(self, buffer: Any, access: str = "rw") -> Region:
        """Let the peer of this channel, and only it, access ``buffer`` (a writable
        buffer for "w", "rw" and "atomic"; any contiguous buffer, numpy array, CPU
        tensor for "r") with ``access``; returns the Region, whose ``ref`` the peer
        needs. ProviderUnavailable where the provider cannot (docs/remote-memory.md)."""
        if access not in ACCESS:
            raise ValueError(f"access must be one of {sorted(ACCESS)}, not {access!r}")
        bits = ACCESS[access]
        ops = self._ops()
        if bits & A and not getattr(self._transport, "region_atomics", False):
            raise ProviderUnavailable(_no_atomics(self.provider))
        tp_bits = ((_TP_READ if bits & R else 0) | (_TP_WRITE if bits & W else 0)
                   | (_TP_ATOMIC if bits & A else 0))
        buffer = _buffer(buffer)
        # shm: memory from rdmamw.memory.shared() the peer maps (atomics need it; reads
        # and writes of it are copies through the peer's mapping)
        file = file_of(buffer) if self.provider == "shm" else None
        if bits & A and self.provider == "shm":
            if file is None:
                raise ProviderUnavailable(
                    "atomics on shm need the region in shared memory the peer can map: "
                    "this buffer is private memory (allocate it with "
                    "rdmamw.memory.shared(nbytes))")
        rc, key, tag, base, length = ops.expose(buffer, tp_bits, file)
        if rc == _ERR_UNSUPPORTED:
            why = (" (shm needs cross-memory attach to the peer: RDMAMW_SHM_CMA, ptrace "
                   "rules)" if self.provider == "shm" else "")
            raise ProviderUnavailable(f"the {self.provider} provider cannot expose this "
                                      f"memory to this peer{why}")
        if rc == _ERR_AGAIN:
            raise ProviderUnavailable(f"the {self.provider} exposure table is full "
                                      f"(revoke regions that are no longer needed)")
        if rc:
            raise ChannelClosed(f"expose: the channel is closed ({rc})")
        ident, _ = self._transport.region_ids()
        return Region(ops, RegionRef(ident, key, tag, base, length, bits))

    # ---- the peer -------------------------------------------------------------------

    def read(self, ref: Any, into: Any, offset: int = 0,
             timeout: float | None = None) -> Done:
        """READ ``len(into)`` bytes at ``offset`` of the peer's region ``ref`` (a
        RegionRef or its bytes) into ``into``, one-sided: no thread of the peer acts.
        Timeout once ``timeout`` s passed (None: no deadline, as a send's; the
        provider's peer bound ends the wait): ``into`` is not written after."""
        if not (type(ref) is RegionRef and self._one(False, into, ref, offset, timeout)):
            self.batch().read(ref, into, offset).post(timeout)
        return DONE

    def write(self, src: Any, ref: Any, offset: int = 0, notify: Any = None,
              timeout: float | None = None) -> Done:
        """WRITE ``src`` into the peer's region ``ref`` at ``offset``; with ``notify`` (a
        message), the peer receives it on this channel once the bytes are visible to
        it. Timeout once ``timeout`` s passed: the write may still land."""
        if not (notify is None and type(ref) is RegionRef
                and self._one(True, src, ref, offset, timeout)):
            self.batch().write(src, ref, offset, notify).post(timeout)
        return DONE

    def readv(self, ranges: Iterable[tuple[Any, Any, int]],
              timeout: float | None = None) -> Posted:
        """READ many ranges as one chain: ``(into, ref, offset)`` each, ``len(into)``
        bytes of region ``ref`` at ``offset``. Every range is checked before any is
        posted, and the provider checks the whole chain before any byte moves: a
        refused range raises its typed error and nothing of the chain moved."""
        return self.batch().readv(ranges).post(timeout)

    def writev(self, ranges: Iterable[tuple[Any, Any, int]],
               timeout: float | None = None) -> Posted:
        """WRITE many ranges as one chain: ``(src, ref, offset)`` each (see
        :meth:`readv`: a refused range, nothing of the chain moved)."""
        return self.batch().writev(ranges).post(timeout)

    def gather(self, into: Any, ref: Any, offsets: Any, size: Any = None,
               timeout: float | None = None) -> Posted:
        """READ many pieces of region ``ref`` into ``into`` as one chain: piece ``i``
        at ``offsets[i]`` (an integer array), ``size`` bytes each (or ``size[i]``;
        without it ``len(into) // len(offsets)``), one after the other in ``into``
        (:meth:`Batch.gather`). Checked in C before anything is posted; the provider
        checks the chain again: a refused piece raises and nothing moved."""
        return self.batch().gather(into, ref, offsets, size).post(timeout)

    def scatter(self, src: Any, ref: Any, offsets: Any, size: Any = None,
                notify: Any = None, timeout: float | None = None) -> Posted:
        """WRITE ``src``'s consecutive pieces to ``offsets`` of region ``ref`` as one
        chain (pieces and checks as :meth:`gather`'s; ``notify`` as :meth:`write`'s)."""
        return self.batch().scatter(src, ref, offsets, size, notify).post(timeout)

    def batch(self) -> Batch:
        """A batch of one-sided operations: one chain, one doorbell when posted."""
        return Batch(self)

    def fetch_add(self, ref: Any, offset: int, value: int,
                  timeout: float | None = None) -> Fetched:
        """Add ``value`` (mod 2^64) to the aligned 64-bit word at ``offset`` atomically;
        needs a region exposed with access "atomic". ``wait()`` gives the old value;
        ``timeout`` as :meth:`read`'s."""
        return self._atomic(_as_ref(ref), offset, False, value, 0, timeout)

    def compare_swap(self, ref: Any, offset: int, expected: int, desired: int,
                     timeout: float | None = None) -> Fetched:
        """Replace the aligned 64-bit word at ``offset`` by ``desired`` if it holds
        ``expected``, atomically; needs a region exposed with access "atomic".
        ``wait()`` gives the old value (``expected`` when it was replaced);
        ``timeout`` as :meth:`read`'s."""
        return self._atomic(_as_ref(ref), offset, True, expected, desired, timeout)

    # ---- internals ------------------------------------------------------------------

    def _ops(self) -> RemoteOps:
        ops = self._rmem
        if ops is None:
            if self.closed:
                raise ChannelClosed("remote memory: the channel is closed")
            tp = self._transport
            if not hasattr(tp, "region_ids"):
                raise ProviderUnavailable(f"remote memory is not on the {self.provider} "
                                          f"provider yet (shm, tcp and verbs only)")
            if not tp.registers_memory:
                ops = RemoteOps(tp)
            else:
                # verbs: regions and local buffers leased from the registration caches
                # (regions from the shared domain's only: one registration, N peers;
                # where the device does not check a window's bounds, soft-RoCE, of
                # exactly the region's range, not its owner's: that bounds it instead)
                local = getattr(self, "regcache_dst", None)
                if local is None:
                    raise ProviderUnavailable(f"remote memory on {self.provider} needs the "
                                              f"channel's registration caches (rendezvous "
                                              f"is off)")
                shared = tp.shared_registrations() is not None
                ops = RemoteOps(tp, getattr(self, "regcache", None) if shared else None,
                                local, exact=not tp.checks_window_bounds)
            self._rmem = ops
        return ops

    def _one(self, write: bool, local: Any, ref: RegionRef, offset: int,
             timeout: float | None) -> bool:
        """The lean path of one read or write (RemoteOps.one): True when done, False
        when the checked way must say why it is not (nothing was posted)."""
        ops = self._rmem
        if ops is None:
            return False
        rc = ops.one(write, local, ref, offset, timeout)
        if rc == ONE_CHECKED:
            return False
        if rc != 0:
            self._fail(rc, [(OP_WRITE if write else OP_READ, local, 0, _nbytes(local),
                             ref.key, ref.tag, ref.base + offset)], [ref])
        return True

    def _checked(self, ref: RegionRef, need: int, offset: int, n: int) -> RegionRef:
        """``ref`` if this channel's peer made it and it allows ``need`` on ``n`` bytes
        at ``offset`` (as far as the reference says: the provider checks the owner's
        exposure itself)."""
        self._ops()
        _, peer = self._transport.region_ids()
        if ref.channel != peer or not peer:
            raise ForeignReference("the reference names a region of another channel "
                                   "(only the peer of this channel can be accessed)")
        if not ref.access & need:
            raise AccessDenied(f"the region is exposed {_access_name(ref.access)!r}: no "
                               f"{'write' if need == W else 'read'}")
        if offset < 0 or n < 0 or offset > ref.length or n > ref.length - offset:
            raise OutOfRange(f"{n} bytes at offset {offset} of a region of {ref.length}")
        return ref

    def _checked_atomic(self, ref: RegionRef, offset: int) -> RegionRef:
        """``ref`` if an atomic on its word at ``offset`` passes what the caller can
        check (:meth:`_checked`, the "atomic" access, an aligned word, a provider with
        atomics); a single atomic's and a batch's."""
        self._checked(ref, R | W, offset, 8)
        if not ref.access & A:
            raise AccessDenied(f"the region is exposed {_access_name(ref.access)!r}: no "
                               f"atomics (expose it with access='atomic')")
        if (ref.base + offset) % 8:
            raise AccessDenied(f"an atomic needs an aligned 64-bit word; offset {offset} "
                               f"is not")
        if not getattr(self._transport, "region_atomics", False):
            raise ProviderUnavailable(_no_atomics(self.provider))
        return ref

    def _atomic(self, ref: RegionRef, offset: int, cas: bool, a: int, b: int,
                timeout: float | None) -> Fetched:
        if timeout is not None and not timeout >= 0:
            raise ValueError("timeout must be >= 0 or None")
        self._checked_atomic(ref, offset)
        ops = self._ops()
        state = self._atomic_state
        if state is None:
            with _ATOMIC_LOCK:
                state = self._atomic_state
                if state is None:
                    state = self._atomic_state = (threading.Lock(),
                                                  bytearray(_WORDS.size))
        lock, words = state
        with lock:
            _WORDS.pack_into(words, 0, a % (1 << 64), b % (1 << 64))
            rc = ops.atomic(cas, words, ref.key, ref.tag, ref.base + offset, timeout)
            old = _WORDS.unpack(words)[0]
        if rc != 0:
            self._fail(rc, [(OP_CMP_SWAP if cas else OP_FETCH_ADD, words, 0, 8, ref.key,
                             ref.tag, ref.base + offset)], [ref])
        return Fetched(old)

    def _post(self, ops: list[Op], refs: list[RegionRef],
              timeout: float | None = None) -> None:
        rc = self._ops().post(ops, timeout)
        if rc != 0:
            self._fail(rc, ops, refs)

    def _post_lent(self, ops: list[Op], refs: list[RegionRef], words: bytearray,
                   timeout: float | None) -> bytearray:
        """:meth:`_post` with the batch's operands ``words`` copied into a kept buffer
        (``_spare_words``, a power of two of at least 1 KiB), whose registration the
        next batches reuse; the operands and old values, as ``words`` would hold them.
        A buffer whose chain failed is not kept (the device may not be done with it)."""
        n = len(words)
        with _ATOMIC_LOCK:
            spare = self._spare_words or []
            buf = next((b for b in spare if len(b) >= n), None)
            if buf is not None:
                spare.remove(buf)
        if buf is None:
            buf = bytearray(max(1024, 1 << (n - 1).bit_length()))
        buf[:n] = words
        self._post([(op[0], buf, *op[2:]) if op[1] is words else op for op in ops],
                   refs, timeout)
        words = buf[:n]
        with _ATOMIC_LOCK:
            if self._spare_words is None:
                self._spare_words = []
            if len(self._spare_words) < 4:
                self._spare_words.append(buf)
        return words

    def _fail(self, rc: int, ops: list[Op], refs: list[RegionRef]) -> NoReturn:
        """Raise the typed error of the transport's code ``rc`` for the chain ``ops``."""
        if rc == _ERR_PEER_LOST:
            # verbs: also after a refused access (the connection is lost), which says so
            detail = getattr(self._transport, "error_detail", lambda: None)()
            raise PeerLost("the connection to the peer is lost (a region of a one-sided "
                           "operation in progress was not read or written whole)"
                           + (f": {detail}" if detail else ""))
        if rc == _ERR_CLOSED:
            raise ChannelClosed("the channel is closed: no one-sided operation")
        if rc == _ERR_LATE:
            raise Timeout("the peer did not end the one-sided operation within the "
                          "timeout: it was given up (a write may still land; a read's "
                          "destination is not written any more, and may hold part of "
                          "the answer)" + ("; on verbs the device was stopped: the "
                                           "connection is lost"
                                           if self.provider == "verbs" else ""))
        if rc == _ERR_UNSUPPORTED and any(op[0] in (OP_FETCH_ADD, OP_CMP_SWAP)
                                          for op in ops):
            raise ProviderUnavailable(f"atomics: the peer's end of this {self.provider} "
                                      f"channel does not serve them (an earlier rdmamw)")
        if rc != _ERR_BOUNDS:
            raise RemoteAccessError(f"the {self.provider} provider failed a one-sided "
                                    f"operation ({rc})")
        for (kind, _, _, n, key, tag, addr), ref in zip(ops, refs, strict=True):
            atomic = kind in (OP_FETCH_ADD, OP_CMP_SWAP)
            write = kind in _WRITES     # an atomic writes (tcp records it so)
            why = (self._transport.region_refusal(key, tag, addr, n, write, True)
                   if atomic and self.provider == "shm"
                   else self._transport.region_refusal(key, tag, addr, n, write))
            if why == 1:
                raise RegionRevoked("the peer does not expose this region (any more): "
                                    "revoked, closed, or never exposed")
            if why == 2:
                raise OutOfRange(f"{n} bytes at {addr - ref.base} are outside the region "
                                 f"the peer exposed")
            if why == 3:
                raise AccessDenied(f"the peer's region does not allow "
                                   f"{'atomics' if atomic else 'writes' if write else 'reads'}"
                                   + (" (exposed without 'atomic', or an unaligned word)"
                                      if atomic else ""))
            if why == 4:
                raise RegionRevoked(f"the peer's device refused the access (a remote "
                                    f"access error: revoked, forged, outside the region "
                                    f"or not allowed by it); on {self.provider} this "
                                    f"ends the connection")
        raise RegionRevoked("the peer revoked the region during the operation; what "
                            "was read is incomplete")

    def _notify(self, msg: Any, timeout: float | None = None) -> None:
        cast(Any, self).send(msg, timeout)     # the engine's (Channel's other base)

    def _close_regions(self) -> None:
        """Withdraw every region before the channel closes (no byte moves after)."""
        if self._rmem is not None:
            self._rmem.unexpose_all()

    def _remote_stats(self) -> dict[str, int]:
        ops = self._rmem
        if ops is None:
            return {"rmem_ops": 0, "rmem_chains": 0, "rmem_bytes_read": 0,
                    "rmem_bytes_written": 0, "rmem_exposed": 0}
        return {"rmem_ops": ops.ops, "rmem_chains": ops.chains,
                "rmem_bytes_read": ops.bytes_read, "rmem_bytes_written": ops.bytes_written,
                "rmem_exposed": ops.exposed}
