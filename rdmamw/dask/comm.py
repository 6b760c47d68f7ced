"""The ``rdmamw://`` comm of Dask distributed over :mod:`rdmamw.aio` (docs/dask.md).

An address is ``rdmamw://HOST:PORT``. The comm asks the provider registry
(rdmamw.providers) and names no provider: a listener there listens on
``BASE://HOST:PORT`` (the base provider, ``distributed.comm.rdmamw.base``, default
tcp: every connection proves the shared token), on a name made from the same address
for every host-local provider (``network`` false: shm, whose abstract socket's peers
the kernel vouches for, or a plug-in's) and, where one can be offered (the optional
``offer_*`` methods: verbs), on a side channel of an ephemeral port, which it *offers*
at the start of every base comm (rdmamw/dask/offer.py). A connector whose target is an
address of its own host opens the host-local names first, highest preference first;
otherwise it goes straight to the side-channel route it learned for that address,
else opens the base provider, reads the offer and moves to the offered provider when
it can reach it; the base provider whenever that fails.

One Dask message is one ``send_batch``: a header (the frames' sizes) and every
non-empty frame, each a message of its own (bytes, memoryviews, numpy and Arrow
buffers go as they are: no copy into one buffer). The reader receives the header, then
each frame with ``recv_into`` into a buffer of exactly its size (frames above the
eager limit are READ into it by rendezvous)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import struct
import weakref
from typing import Any

import dask
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import (
    BaseListener,
    Comm,
    CommClosedError,
    Connector,
    FatalCommClosedError,
)
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import ensure_ip, ensure_memoryview, get_ip

from rdmamw import auth, config
from rdmamw import channel as _sync
from rdmamw import errors as _errors
from rdmamw import providers as _registry
from rdmamw.aio import Channel, Listener, open_channel
from rdmamw.dask import offer as _offer
from rdmamw.memory import pool as _pool

log = logging.getLogger("rdmamw.dask")

SCHEME = "rdmamw"
PREFIX = SCHEME + "://"
#: magic, frame count, piece size; then one "<Q" per frame
_HEADER = struct.Struct("<4sIQ")
_MAGIC = b"RDK2"
#: the channel errors that mean the comm is over: the peer closed or died, this side
#: closed, the transport failed
_GONE = (_errors.ChannelClosed, _errors.PeerLost, _errors.ProtocolError, ConnectionError)
#: the smallest piece a frame is cut into (the largest message a peer may announce and
#: still be a Dask peer, as large as a comm's default slot): a frame goes as one view per
#: piece, so a peer taking 1-byte messages would make a 1 MiB frame a million views
#: (~320 MiB); from this size up the views cost under 0.5 % of the frame
MIN_PIECE = 64 << 10


def _too_small(ch: Channel) -> str | None:
    """Why ``ch`` cannot carry a comm (the largest message its peer takes is below
    MIN_PIECE: a legal channel option, absurd for the comm's framing), or None."""
    piece = ch.sync.peer_max_message_size or ch.sync.max_message_size
    if piece < MIN_PIECE:
        return (f"the peer's max_message_size ({piece} bytes) is below the {MIN_PIECE} "
                f"an rdmamw:// comm needs (RDMAMW_MAX_MESSAGE_SIZE)")
    return None


#: how long a new comm waits for the largest message its peer takes: the peer writes it
#: as it sets up its side of the channel, which may end after this side's open()
ANNOUNCE_WAIT = 5.0


async def _announced(ch: Channel, wait: float = ANNOUNCE_WAIT) -> None:
    """Until the peer of the new ``ch`` has announced its largest message (at most
    ``wait`` s: a peer that has not by then is judged by this side's own limit), so
    that _too_small() judges what the peer said, not the 0 of "not yet"."""
    loop = asyncio.get_running_loop()
    end, nap = loop.time() + wait, 0.001
    while not ch.sync.peer_max_message_size and loop.time() < end:
        await asyncio.sleep(nap)
        nap = min(2 * nap, 0.02)


def _memory() -> int:
    """The most a message's frames may add up to: this host's memory (a header that
    announces more is lying; its frames are never allocated)."""
    import psutil
    return int(psutil.virtual_memory().total)


class TokenRequired(_errors.ConfigError):
    """An rdmamw:// listener on an address other hosts can reach needs an explicit
    shared token (RDMAMW_TOKEN, or rdmamw.auth.set_token): the per-user token file is
    for one host."""


def _settings() -> dict[str, Any]:
    """The ring of each comm's channel (``distributed.comm.rdmamw.slots`` /
    ``slot-size`` in Dask's config; smaller than a plain channel's, since Dask opens
    many comms per pair of processes)."""
    slots = dask.config.get("distributed.comm.rdmamw.slots", default=32)
    size = dask.config.get("distributed.comm.rdmamw.slot-size", default="64 KiB")
    return {"slots": int(slots), "slot_size": dask.utils.parse_bytes(size)}


def _base() -> str:
    """``distributed.comm.rdmamw.base`` (default tcp): the network provider the Dask
    address names, which reaches every host; the others are found from it."""
    return str(dask.config.get("distributed.comm.rdmamw.base", default="tcp"))


def _use_local() -> bool:
    """``distributed.comm.rdmamw.shm`` (default True): whether a peer of this host is
    reached over the host-local providers (shm, a plug-in's); False sends everything
    over the network ones."""
    return bool(dask.config.get("distributed.comm.rdmamw.shm", default=True))


def _use_offers() -> bool:
    """``distributed.comm.rdmamw.verbs`` (default True): whether a listener offers a
    side channel (verbs) and a connector takes such offers; False keeps every comm
    that is not host-local on the base provider."""
    return bool(dask.config.get("distributed.comm.rdmamw.verbs", default=True))


def _local_providers() -> list[Any]:
    """The registered host-local providers (addresses are names), highest preference
    first: a connector to its own host tries them in this order."""
    got = [p for p in _registry.providers() if not p.network]
    return sorted(got, key=lambda p: -p.preference)


def _is_local_provider(scheme: str) -> bool:
    """Whether a channel of ``scheme`` joins two processes of one host."""
    return not _registry.provider(scheme).network


def _offer_timeout() -> float:
    """How long a connector waits for the listener's offer (it is the listener's first
    message, sent as it accepts): ``distributed.comm.timeouts.connect``."""
    t = dask.config.get("distributed.comm.timeouts.connect", default=30)
    return float(dask.utils.parse_timedelta(t, default="seconds"))


def _side_timeout() -> float:
    """One side-channel attempt's bound (connect and handshake: on verbs a device to
    open, a queue pair to set up on both sides): longer than the base provider's, at
    most 5 s; when it passes the comm stays on the base provider."""
    return min(5.0, max(_connect_timeout(), _offer_timeout() / 10))


def _connect_timeout() -> float:
    """One tcp attempt's bound for the connect (rdmamw's open retries a refused
    connect until it; the handshake has at least 1 s): short, since distributed's
    connect retries with backoff itself until ``distributed.comm.timeouts.connect``,
    and an attempt it gave up on still holds an executor thread until this passes."""
    return min(1.0, _offer_timeout())


def _shard_size() -> int:
    """The largest frame (``distributed.comm.shard``, 64 MiB, as tcp:// splits them):
    far below a channel's largest message (RDMAMW_MAX_MESSAGE_SIZE, 1 GiB)."""
    return dask.utils.parse_bytes(dask.config.get("distributed.comm.shard"))


def shm_name(host: str, port: int) -> str:
    """The name a listener at ``host:port`` also accepts on with every host-local
    provider (``*`` for a listener on every address: no other listener can hold that
    port then)."""
    return f"rdmamw-dask-{host}:{port}"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(ensure_ip(host)).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def has_token() -> bool:
    """Whether a token was given explicitly (RDMAMW_TOKEN or auth.set_token), not
    just the per-user file."""
    return bool(config.get("RDMAMW_TOKEN") or getattr(auth, "_installed", None))


_local_ips: frozenset[str] | None = None


def is_local(host: str) -> bool:
    """Whether ``host`` is an address of this host (then shm may reach it)."""
    global _local_ips
    if is_loopback(host):
        return True
    if _local_ips is None:
        import psutil
        _local_ips = frozenset(a.address.split("%")[0] for addrs in
                               psutil.net_if_addrs().values() for a in addrs)
    try:
        return ensure_ip(host) in _local_ips
    except OSError:
        return False


#: frames from this size up land in the process's buffer pool (rdmamw.memory.pool)
POOLED_FRAME = 256 << 10


def _frame_buffer(n: int) -> memoryview:
    """Where a received frame of ``n`` bytes lands. A large one takes a buffer of the
    process's pool (``rdmamw.memory.pool.allocate``), which goes back to the pool when
    the last view of the frame is collected: the next frame reuses memory already
    mapped (and, on verbs, already registered) instead of a fresh allocation whose
    page faults cost about as much as the copy itself. Small ones as tcp:// does."""
    if n < POOLED_FRAME:
        return host_array(n)
    return memoryview(_pool.allocate(n))


# ---- the comm ------------------------------------------------------------------------
class RdmamwComm(Comm):
    """One Dask comm: one rdmamw channel (:class:`rdmamw.aio.Channel`)."""

    def __init__(self, ch: Channel, local_addr: str, peer_addr: str,
                 deserialize: bool = True) -> None:
        super().__init__(deserialize=deserialize)
        self._ch: Channel | None = ch
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock()
        self._finalizer = weakref.finalize(self, _close_quietly, ch)
        self._finalizer.atexit = False

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def same_host(self) -> bool:
        ch = self._ch
        return ch is not None and _is_local_provider(ch.sync.provider)

    @property
    def extra_info(self) -> dict:
        ch = self._ch
        return {"provider": ch.sync.provider} if ch is not None else {}

    def _gone(self, e: BaseException | None = None) -> CommClosedError:
        self.abort()
        why = f"{type(e).__name__}: {e}" if e is not None else "closed"
        return CommClosedError(f"in {self!r}: {why}")

    async def read(self, deserializers: Any = None) -> Any:
        ch = self._ch
        if ch is None:
            raise CommClosedError(f"in {self!r}: closed")
        async with self._read_lock:
            try:
                frames = await self._read_frames(ch)
            except Exception as e:
                # the peer closed or died, or wrote what no rdmamw:// comm writes (a
                # header that lies about its frames, a piece of another size, sizes no
                # memory holds): Dask's one error for a comm that is over
                raise self._gone(e) from e
            except BaseException:
                # cancelled (or worse) between the header and its frames: the stream
                # cannot be resumed, as for Dask's tcp comm
                self.abort()
                raise
        try:
            return await from_frames(frames, deserialize=self.deserialize,
                                     deserializers=deserializers,
                                     allow_offload=self.allow_offload)
        except EOFError:
            self.abort()
            raise CommClosedError("aborted stream on truncated data") from None

    @staticmethod
    async def _read_frames(ch: Channel) -> list:
        m = await ch.recv()
        try:
            with memoryview(m) as view:
                if len(view) < _HEADER.size:
                    raise _errors.ProtocolError("not an rdmamw:// comm header")
                magic, count, piece = _HEADER.unpack_from(view)
                if magic != _MAGIC or len(view) != _HEADER.size + 8 * count:
                    raise _errors.ProtocolError("not an rdmamw:// comm header")
                if piece < MIN_PIECE:
                    raise _errors.ProtocolError(f"a comm header with pieces of {piece} "
                                                f"bytes (at least {MIN_PIECE})")
                sizes = struct.unpack_from(f"<{count}Q", view, _HEADER.size)
        finally:
            m.release()
        if sum(sizes) > _memory():
            raise _errors.ProtocolError(f"a comm header announcing {sum(sizes)} bytes of "
                                        f"frames, more than this host's memory")
        frames = []
        for n in sizes:
            buf = _frame_buffer(n)
            for at in range(0, n, piece):
                want = min(piece, n - at)
                got = await ch.recv_into(buf[at:at + want])
                if got != want:
                    raise _errors.ProtocolError(f"a piece of {got} bytes where the "
                                                f"header said {want}")
            frames.append(buf)
        return frames

    async def write(self, msg: Any, serializers: Any = None, on_error: str = "message"
                    ) -> int:
        if self._ch is None:
            raise CommClosedError(f"in {self!r}: closed")
        frames = await to_frames(
            msg, allow_offload=self.allow_offload, serializers=serializers,
            on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info,
                     **self.handshake_options},
            frame_split_size=_shard_size())
        views = [f if isinstance(f, bytes) else ensure_memoryview(f) for f in frames]
        sizes = [v.nbytes if isinstance(v, memoryview) else len(v) for v in views]
        async with self._write_lock:
            ch = self._ch
            if ch is None:
                raise CommClosedError(f"in {self!r}: closed")
            # a frame above the largest message the peer takes goes in pieces (views)
            piece = ch.sync.peer_max_message_size or ch.sync.max_message_size
            if piece < MIN_PIECE:       # refused at connect; a bare channel's comm here
                self.abort()
                raise CommClosedError(f"in {self!r}: {_too_small(ch)}")
            header = _HEADER.pack(_MAGIC, len(sizes), piece) + \
                struct.pack(f"<{len(sizes)}Q", *sizes)
            batch = [header]
            for v, n in zip(views, sizes, strict=True):
                if n <= piece:
                    if n:
                        batch.append(v)
                else:
                    mv = memoryview(v)
                    batch.extend(mv[at:at + piece] for at in range(0, n, piece))
            try:
                await ch.send_batch(batch)
            except _GONE as e:
                raise self._gone(e) from e
            except BaseException:
                self.abort()        # part of a message may have gone: no resuming
                raise
        return sum(sizes) + _HEADER.size + 8 * len(sizes)

    async def close(self) -> None:
        # a write returns once its messages are done, so nothing is left to flush
        async with self._write_lock:
            self.abort()

    def abort(self) -> None:
        ch, self._ch = self._ch, None
        if ch is not None:
            self._finalizer.detach()
            _close_quietly(ch)

    def closed(self) -> bool:
        ch = self._ch
        if ch is not None and ch.closed:
            self._ch = None
            self._finalizer.detach()
        return self._ch is None


# ---- connecting --------------------------------------------------------------------
async def _open(address: str, timeout: float) -> Channel:
    """A comm's channel: :func:`rdmamw.aio.open_channel` (cancellation-safe) with the
    comm's ring."""
    return await open_channel(address, timeout, **_settings())


def _close_quietly(ch: Channel) -> None:
    """Close a comm's channel found unreferenced (from whatever thread collects it)."""
    try:
        ch.close()
    except _errors.WrongLoop:
        ch.sync.close()


#: Dask address -> the side-channel route learned from its listener's offer
#: (process-wide)
_routes = _offer.Routes()


async def _read_offer(ch: Channel, what: str) -> _offer.Offer:
    """The listener's offer, the first message of a base or side-channel comm; a comm whose
    offer is malformed is no rdmamw:// comm of this version: FatalCommClosedError
    (retrying cannot help). Closes ``ch`` on any failure (cancellation too)."""
    try:
        try:
            m = await asyncio.wait_for(ch.recv(), _offer_timeout())
        except (TimeoutError, *_GONE) as e:
            raise CommClosedError(f"{what}: no offer from the listener "
                                  f"({type(e).__name__}: {e})") from e
        try:
            with memoryview(m) as view:
                data = bytes(view[:_offer.MAX_OFFER + 1])
        finally:
            m.release()
        try:
            return _offer.decode(data)
        except _errors.ProtocolError as e:
            raise FatalCommClosedError(f"{what}: {e}") from e
    except BaseException:
        _close_quietly(ch)
        raise


async def _side(address: str, ident: bytes, target: str) -> Channel | None:
    """A side channel at ``address`` whose listener shows offer id ``ident``, or None
    (logged at debug: the caller carries on over the base provider)."""
    try:
        ch = await _open(address, _side_timeout())
    except Exception as e:      # whatever the provider raised (cancellation goes through)
        log.debug("side channel to %s (%s) failed, %s instead: %s", target, address,
                  _base(), e)
        return None
    try:
        got = await _read_offer(ch, address)
    except CommClosedError as e:
        log.debug("side channel to %s (%s): %s; %s instead", target, address, e, _base())
        return None
    if got.id != ident:
        log.debug("side channel to %s (%s) reached another listener; %s instead", target,
                  address, _base())
        _close_quietly(ch)
        return None
    return ch


async def _base_or_side(ip: str, target: str) -> Channel:
    """The base provider, then the listener's offer; the side channel it names when
    this process can reach it (the base one is closed then), else the base one."""
    try:
        ch = await _open(f"{_base()}://{target}", _connect_timeout())
    except _errors.PeerNotFound as e:
        raise OSError(errno.ECONNREFUSED, str(e)) from e      # Dask retries
    except (_errors.RdmamwError, OSError) as e:
        raise CommClosedError(f"connecting to {PREFIX}{target}: "
                              f"{type(e).__name__}: {e}") from e
    got = await _read_offer(ch, PREFIX + target)
    _offer.COUNTS["offers"] += 1
    if got.scheme is None or not _use_offers() or _routes.blocked(target):
        return ch
    try:
        loop = asyncio.get_running_loop()
        try:
            address, why = await loop.run_in_executor(None, _offer.route, ip, got)
        except Exception as e:          # a bad setting (RDMAMW_VERBS_FABRIC): not that
            address, why = None, f"{type(e).__name__}: {e}"
        v = None
        if address is None:
            log.debug("%s offers %s; staying on %s: %s", PREFIX + target, got.scheme,
                      _base(), why)
        else:
            v = await _side(address, got.id, target)
    except BaseException:
        _close_quietly(ch)
        raise
    if v is None:
        _routes.failed(target)      # the base for a while: no attempt per comm
        return ch
    _routes.remember(target, address, got.id)
    _close_quietly(ch)
    return v


class RdmamwConnector(Connector):
    async def connect(self, address: str, deserialize: bool = True,
                      **connection_args: Any) -> RdmamwComm:
        host, port = parse_host_port(address)
        ip = ensure_ip(host)
        where = unparse_host_port(ip, port)
        ch = None
        if _use_local() and is_local(ip):
            ch = await _open_local(ip, port, address)
        if ch is None and _use_offers():
            known = _routes.direct(where)
            if known is not None:
                ch = await _side(*known, where)
                if ch is None:          # the listener moved or verbs broke: ask again
                    _routes.forget(where)
                else:
                    _offer.COUNTS["direct"] += 1
        if ch is None:
            ch = await _base_or_side(ip, where)
        await _announced(ch)
        why = _too_small(ch)
        if why is not None:             # retrying cannot help
            _close_quietly(ch)
            raise FatalCommClosedError(f"connecting to {PREFIX}{where}: {why}")
        local = PREFIX + unparse_host_port(ip if _is_local_provider(ch.sync.provider)
                                           else get_ip(ip), 0)
        return RdmamwComm(ch, local, PREFIX + where, deserialize)


async def _open_local(ip: str, port: int, address: str) -> Channel | None:
    """A channel to the listener at ``ip:port`` of this host over the first host-local
    provider whose name answers (highest preference first), or None."""
    for p in _local_providers():
        for name in (shm_name(ip, port), shm_name("*", port)):
            try:
                return await _open(f"{p.scheme}://{name}", 0.0)
            except _errors.PeerNotFound:
                continue
            except (_errors.RdmamwError, OSError) as e:
                log.debug("%s to %s failed (%s); trying the next", p.scheme, address, e)
                break
    return None


# ---- listening ---------------------------------------------------------------------
class RdmamwListener(BaseListener):
    prefix = PREFIX
    def __init__(self, address: str, comm_handler: Any, deserialize: bool = True,
                 allow_offload: bool = True, default_host: str | None = None,
                 **connection_args: Any) -> None:
        super().__init__()
        self.ip, self.port = parse_host_port(address, 0)
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self._listeners: list[Listener] = []
        self._accepting: set[asyncio.Task] = set()   # the accept loops (stop ends them)
        self._handlers: set[asyncio.Task] = set()    # comms handed out: theirs to close
        self._bound: tuple[str, int] | None = None
        #: the first message of every base and side-channel comm (offer.py)
        self._offer = _offer.Offer(_offer.new_id())
        self._offer_bytes = _offer.encode(self._offer)

    async def start(self) -> None:
        if not is_loopback(self.ip) and not has_token():
            raise TokenRequired(
                f"refusing to listen on {PREFIX}{unparse_host_port(self.ip, self.port)}: "
                f"an address other hosts can reach needs a shared token; set "
                f"RDMAMW_TOKEN to the same secret in every process of the cluster "
                f"(docs/dask.md), or listen on 127.0.0.1")
        ring = _settings()
        base = Listener(_sync.listen(f"{_base()}://{unparse_host_port(self.ip, self.port)}",
                                     **ring))
        self._listeners.append(base)
        self._bound = parse_host_port(base.address.partition("://")[2])
        host = "*" if _is_wildcard(self.ip) else ensure_ip(self.ip)
        for p in _local_providers():
            try:
                self._listeners.append(Listener(
                    _sync.listen(f"{p.scheme}://{shm_name(host, self._bound[1])}", **ring)))
            except (_errors.RdmamwError, OSError) as e:   # the base alone still serves
                log.warning("%s: no %s listener (%s); local peers use %s",
                            self.listen_address, p.scheme, e, _base())
        if _use_offers():
            await self._listen_side(ring)
        for lst in self._listeners:
            _keep(self._accepting, self._accept_loop(lst))

    async def _listen_side(self, ring: dict) -> None:
        """The side channel (the first provider that can be offered here) on the base
        listener's host, and the offer naming it; the base alone when none is usable
        here (logged, never an error)."""
        host = "0.0.0.0" if self.ip == "" else self.ip
        loop = asyncio.get_running_loop()
        try:
            lst, offer = await loop.run_in_executor(None, _offer.listen, host, ring,
                                                    self._offer.id, _base())
        except Exception as e:          # a bad setting (RDMAMW_VERBS_FABRIC): the base only
            log.info("%s: no side channel (%s: %s); other hosts use %s",
                     self.listen_address, type(e).__name__, e, _base())
            return
        if lst is None:
            return
        if not self._listeners:         # stopped meanwhile
            lst.close()
            return
        self._listeners.append(Listener(lst))
        self._offer, self._offer_bytes = offer, _offer.encode(offer)
        log.info("%s offers %s", self.listen_address, lst.address)

    async def _accept_loop(self, lst: Listener) -> None:
        while True:
            try:
                ch = await lst.accept()
            except asyncio.CancelledError:
                raise
            except Exception as e:        # a peer that failed its handshake: next
                if not self._listeners:
                    return
                log.info("%s refused a peer: %s", self.listen_address, e)
                continue
            _keep(self._handlers, self._handle(ch))

    async def _handle(self, ch: Channel) -> None:
        offered = not _is_local_provider(ch.sync.provider)
        if offered:
            peer = PREFIX + ch.peer.partition("://")[2]
        else:
            peer = PREFIX + unparse_host_port(self.contact_host, 0)
        comm = RdmamwComm(ch, self.contact_address, peer, self.deserialize)
        comm.allow_offload = self.allow_offload
        if not self._listeners:         # stopped meanwhile
            comm.abort()
            return
        await _announced(ch)
        why = _too_small(ch)
        if why is not None:
            log.info("%s refused a peer from %s: %s", self.listen_address, peer, why)
            comm.abort()
            return
        try:
            if offered:                 # before Dask's handshake (offer.py)
                try:
                    await ch.send(self._offer_bytes)
                except _GONE as e:
                    raise comm._gone(e) from e
            await self.on_connection(comm)
        except CommClosedError:
            # a connector that took the offer hangs up its base comm here
            moved = ch.sync.provider == _base() and self._offer.scheme is not None
            log.log(logging.DEBUG if moved else logging.INFO,
                    "connection from %s closed before its handshake", peer)
            return
        await self.comm_handler(comm)

    def stop(self) -> None:
        lsts, self._listeners = self._listeners, []
        for lst in lsts:
            with contextlib.suppress(Exception):
                lst.close()
        for task in list(self._accepting):
            task.cancel()
        self.abort_handshaking_comms()

    def get_host_port(self) -> tuple[str, int]:
        if self._bound is None:
            raise ValueError("invalid operation on a listener that has not started")
        return self._bound

    @property
    def listen_address(self) -> str:
        return PREFIX + unparse_host_port(*self.get_host_port())

    @property
    def contact_host(self) -> str:
        return ensure_concrete_host(self.get_host_port()[0], default_host=self.default_host)

    @property
    def contact_address(self) -> str:
        return PREFIX + unparse_host_port(self.contact_host, self.get_host_port()[1])


def _keep(tasks: set[asyncio.Task], coro: Any) -> None:
    """Run ``coro`` as a task held in ``tasks`` until it ends."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


class RdmamwBackend(Backend):
    """``rdmamw://HOST:PORT`` for distributed's comm registry."""

    def get_connector(self) -> RdmamwConnector:
        return RdmamwConnector()

    def get_listener(self, loc: str, handle_comm: Any, deserialize: bool,
                     **connection_args: Any) -> RdmamwListener:
        return RdmamwListener(loc, handle_comm, deserialize, **connection_args)

    def get_address_host(self, loc: str) -> str:
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc: str) -> tuple[str, int]:
        return parse_host_port(loc)

    def resolve_address(self, loc: str) -> str:
        host, port = parse_host_port(loc)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc: str) -> str:
        host, _port = parse_host_port(loc)
        return unparse_host_port(get_ip(ensure_ip(host)), None)
