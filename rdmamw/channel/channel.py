"""The public Channel and Listener: a thin Pythonic layer over the Cython engine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from rdmamw import _fork, auth, config, observe
from rdmamw.channel import rendezvous as _rendezvous
from rdmamw.channel.address import split_address
from rdmamw.channel.remote import RemoteMemory
from rdmamw.engine import Engine, _many
from rdmamw.engine._messages import set_host_view
from rdmamw.errors import ConfigError, ProviderUnavailable, Timeout, setup_errors
from rdmamw.memory.buffer import host_view
from rdmamw.memory.counters import channel_stats
from rdmamw.memory.regcache import RegCache, default_max_bytes
from rdmamw.providers import Connected, provider
from rdmamw.transport import layout
from rdmamw.vocabulary import AUTO, BATCHED, OFF, RNDV_TRANSFERS, check_mode

WIRE_MAX_MESSAGE = (1 << 32) - 1    # a rendezvous descriptor's length field


def ring_options(slots: int | None, slot_size: int | None, spin_us: float | None
                 ) -> tuple[int, int, float]:
    """The ring this endpoint receives on and its spin time: the arguments, else
    RDMAMW_SLOTS / RDMAMW_SLOT_SIZE / RDMAMW_SPIN_US (default 128 slots of 64 KiB: 8 MiB
    per endpoint, eager messages up to 64 KiB, a batch of 256 x 8 B in one slot)."""
    return (config.get("RDMAMW_SLOTS") if slots is None else slots,
            config.get("RDMAMW_SLOT_SIZE") if slot_size is None else slot_size,
            config.get("RDMAMW_SPIN_US") if spin_us is None else spin_us)


def message_limit(value: int | str | None = None) -> int:
    """The largest message a channel takes: ``value`` (the keyword), else
    RDMAMW_MAX_MESSAGE_SIZE, else 1 GiB; sizes above the wire's 4 GiB - 1 mean the
    wire's limit. ConfigError for anything that is not a positive byte size."""
    if value is None:
        limit: int = config.get("RDMAMW_MAX_MESSAGE_SIZE")
        return min(limit, WIRE_MAX_MESSAGE)
    n = config.parse_bytes(value, "max_message_size")
    if n < 1:
        raise ConfigError(f"max_message_size: {value!r} must be at least 1 byte")
    return min(n, WIRE_MAX_MESSAGE)


log = logging.getLogger("rdmamw.channel")
#: the provider label of a connect by rank that failed before its provider was known
UNKNOWN = "unknown"

# CPU tensors and DLPack host arrays go to the engine as arrays over their memory
set_host_view(host_view)


class Channel(RemoteMemory, Engine):
    """A bidirectional, ordered, reliable message channel to one peer.

    Open one with :meth:`Channel.open` or :meth:`Listener.accept`. ``send_batch`` /
    ``send`` / ``recv_batch`` / ``recv`` / ``stats`` / ``close`` come from the Cython
    engine (rdmamw/engine/) and run without per-call Python overhead, as do
    ``send_many`` / ``recv_many_into`` (many small messages in one buffer, no Python
    object per message: rdmamw/engine/_many.pyx); ``expose`` / ``read`` / ``write`` /
    ``batch`` (one-sided access to exposed memory) from rdmamw/channel/remote.py."""

    peer: str
    peer_rank: int | None       # set when opened by rank (rdmamw.init)
    #: what the channel runs on: "shm", "tcp" or "verbs" (also in :meth:`stats`)
    provider: str
    #: the registration caches of a transport that registers memory (verbs): the
    #: sources of large sends (``regcache``: the peer READs them) and the buffers large
    #: messages are READ into (``regcache_dst``); None on shm and tcp, which expose
    #: memory through tables and register nothing. Attributes of the engine.
    regcache: RegCache | None
    regcache_dst: RegCache | None

    # compiled functions of the engine, bound as methods (no Python frame per call)
    send_many = _many.send_many
    recv_many_into = _many.recv_many_into

    def stats(self) -> dict[str, Any]:
        """The engine's counters plus the memory ones (rdmamw/memory/counters.py):
        ``registrations``, ``regcache_hits`` / ``_misses`` / ..., ``bytes_pinned`` of
        this channel's registration cache, ``pool_*`` of the process-wide pool that
        receives large messages without a posted destination, and ``provider``."""
        d = Engine.stats(self)
        d.update(channel_stats((self.regcache, self.regcache_dst)))
        d.update(self._remote_stats())
        d["provider"] = self.provider
        return d

    @classmethod
    def open(cls, peer: str | int, *, mode: str = BATCHED, timeout: float | None = None,
             slots: int | None = None, slot_size: int | None = None,
             spin_us: float | None = None, rendezvous: str = AUTO,
             rndv_threshold: int | None = None,
             max_message_size: int | str | None = None, world: Any = None) -> Channel:
        """Connect to ``peer`` (``"shm://NAME"``, ``"tcp://HOST:PORT"``, or after
        :func:`rdmamw.init` a rank: both ranks call ``open`` with the other's rank and
        the provider is chosen for them), retrying while nobody listens yet.

        ``mode="batched"`` is the bitmap protocol; ``mode="ack"`` the per-message
        acknowledged baseline. ``slots`` x ``slot_size`` is the ring *this* side
        receives on; the peer's ``slot_size`` is the largest eager message (defaults:
        RDMAMW_SLOTS, RDMAMW_SLOT_SIZE, RDMAMW_SPIN_US, docs/config.md).
        ``timeout=None`` means RDMAMW_OPEN_TIMEOUT (30 s) for the connection to be made.

        Larger messages go by **rendezvous** (docs/api.md): ``rendezvous="read"`` (the
        receiver READs from our buffer), ``"write"`` (we WRITE into a buffer the receiver
        posted with ``post_recv``, else it READs), ``"off"`` (eager only: larger messages
        raise MessageTooLarge) or ``"auto"`` (the tuned strategy, else read).
        ``rndv_threshold`` lowers the size above which rendezvous is used.

        ``max_message_size`` (bytes or "1G"; default RDMAMW_MAX_MESSAGE_SIZE, else
        1 GiB) is the largest message this side takes: a larger one is refused with
        MessageTooLarge, by the peer's sender once it knows the limit, else here.

        ``world``: the job a rank belongs to, default the one of :func:`rdmamw.init`
        (another comes from rdmamw.bootstrap.kvstore.join, e.g. a torch process group)."""
        check_mode(mode)
        rndv = (rendezvous, rndv_threshold, message_limit(max_message_size))
        _rendezvous.check(rendezvous, rndv_threshold)      # bad options fail first
        slots, slot_size, spin_us = ring_options(slots, slot_size, spin_us)
        t = config.get("RDMAMW_OPEN_TIMEOUT") if timeout is None else float(timeout)
        by_rank = isinstance(peer, int) and not isinstance(peer, bool)
        scheme, where = ("", "") if by_rank else split_address(str(peer))
        observe.begin()     # the first channel: RDMAMW_METRICS_PORT's endpoint
        watch = observe.connect             # None unless rdmamw.metrics records
        t0 = time.perf_counter() if watch is not None else 0.0
        try:
            if by_rank:
                from rdmamw.bootstrap import connect_rank
                with setup_errors(f"opening a channel to rank {peer}"):
                    conn = connect_rank(int(peer), mode=mode, timeout=t, slots=slots,
                                        slot_size=slot_size, in_world=world)
                conn.peer_rank = int(peer)
                scheme = conn.peer.partition("://")[0]
                how = f"opened to rank {peer} at {{peer}}"
            else:
                if provider(scheme).authenticates:   # no usable token: ConfigError now,
                    auth.token()                        # not in every handshake later
                with setup_errors(f"opening {peer}"):
                    conn = provider(scheme).connect(where, mode=mode, timeout=t,
                                                    slots=slots, slot_size=slot_size)
                how = "opened to {peer}"
            ch = _make(cls, conn, spin_us, rndv, how)
        except BaseException as e:
            if watch is not None:
                watch(scheme or UNKNOWN, "refused" if getattr(e, "error_kind", None) ==
                      "refused" else "failed", time.perf_counter() - t0)
            raise
        if watch is not None:
            watch(scheme, "opened", time.perf_counter() - t0)
        return ch

    def close(self) -> None:
        """Close this endpoint (see the engine's ``close``); logs (info) what went
        through the channel and on which provider."""
        if self.closed:
            return
        self._close_regions()       # no byte of an exposed region moves after this
        Engine.close(self)
        observe.retire(self)        # its counters stay in the metrics (rdmamw/observe.py)
        if log.isEnabledFor(logging.INFO):
            st = Engine.stats(self)
            log.info("channel to %s closed (%s): %d messages / %d bytes sent in %d batches "
                     "(%d doorbells), %d messages / %d bytes received",
                     getattr(self, "peer", "?"), getattr(self, "provider", "?"),
                     st["messages"], st["bytes"], st["batches"], st["doorbells"],
                     st["messages_received"], st["bytes_received"])

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Channel {getattr(self, 'peer', '?')} mode={self.mode} {state}>"


def _make(cls: type[Channel], conn: Connected, spin_us: float,
          rndv: tuple[str, int | None, int | None] = (AUTO, None, None),
          how: str = "opened to {peer}") -> Channel:
    """The Channel over a connected transport; logs the connection (info) once, ``how``
    with ``{peer}`` standing for the peer's address."""
    ch = cls()
    try:
        observe.begin()     # the first channel: RDMAMW_METRICS_PORT's endpoint
        scheme = conn.peer.partition("://")[0]
        strategy, threshold = _rendezvous.resolve(rndv[0], rndv[1], scheme)
        if rndv[0] in RNDV_TRANSFERS and not conn.transport.can_expose:
            raise ProviderUnavailable(f"rendezvous={rndv[0]!r}: the {scheme} provider cannot "
                                      f"expose memory to its peer (yet)")
        ch._setup(conn.transport, conn.slots, conn.slot_size, conn.peer_slots,
                  conn.peer_slot_size, conn.mode, spin_us, rendezvous=strategy,
                  rndv_threshold=threshold,
                  max_message_size=message_limit(rndv[2]))
        tp = conn.transport
        ch.allocate = _rendezvous.allocate
        if strategy != OFF and tp.registers_memory:
            # a large buffer is registered on its first send (or receive), not per
            # message
            ch.regcache, ch.regcache_dst = _registration_caches(tp, _cache_bytes(scheme))
    except BaseException:
        conn.transport.close()
        raise
    ch.peer = conn.peer
    ch._transport = tp
    ch.peer_rank = conn.peer_rank
    ch.provider = scheme
    observe.register(ch)
    log.info("channel %s: mode %s, ring %dx%d B here / %dx%d B there, rendezvous %s "
             "(threshold %s)", how.replace("{peer}", conn.peer), conn.mode, conn.slots,
             conn.slot_size, conn.peer_slots, conn.peer_slot_size, ch.rendezvous,
             ch.rndv_threshold if ch.rendezvous != OFF else "-")
    return ch


_CACHES_LOCK = threading.Lock()


@_fork.at_child
def _new_caches_lock() -> None:
    global _CACHES_LOCK
    _CACHES_LOCK = threading.Lock()   # a thread of the parent may have held it at fork


#: the share of the provider's pinned budget one registration cache may keep idle
CACHE_SHARE = 4


def _cache_bytes(scheme: str) -> int:
    """A cache's bound: RDMAMW_REGCACHE_BYTES, and no more than a quarter of the
    provider's pinned budget, so that the two caches of a domain, full of idle
    registrations, still leave half of it to rings and to transfers in use."""
    limit = default_max_bytes()
    budget = getattr(provider(scheme), "pinned_budget", None)
    return limit if budget is None else min(limit, budget() // CACHE_SHARE)


def _registration_caches(tp: Any, max_bytes: int) -> tuple[RegCache, RegCache]:
    """A channel's registration caches (large sources, READ destinations): those of
    the process's shared protection domain where the provider has one (verbs with
    memory windows: a buffer is registered once for all peers; the caches live as long
    as the process), else the channel's own (its own domain; closed with it). Each
    keeps at most ``max_bytes`` idle (_cache_bytes)."""
    owner = tp.shared_registrations() if hasattr(tp, "shared_registrations") else None
    if owner is None:
        return (RegCache(partial(tp.mr_register, remote_read=True), tp.mr_deregister,
                         max_bytes),
                RegCache(tp.mr_register, tp.mr_deregister, max_bytes))
    with _CACHES_LOCK:
        if owner.regcaches is None:
            owner.regcaches = (
                RegCache(partial(owner.mr_register, remote_read=True), owner.mr_deregister,
                         max_bytes, shared=True),
                RegCache(partial(owner.mr_register, remote_read=False),
                         owner.mr_deregister, max_bytes, shared=True))
        caches: tuple[RegCache, RegCache] = owner.regcaches
        for c in caches:            # the budget may have changed since they were made
            c.max_bytes = max_bytes
        return caches


class Listener:
    """Accepts channels at an address; see :func:`rdmamw.listen`."""

    def __init__(self, address: str, *, slots: int | None = None,
                 slot_size: int | None = None, spin_us: float | None = None,
                 rendezvous: str = AUTO, rndv_threshold: int | None = None,
                 max_message_size: int | str | None = None) -> None:
        _rendezvous.check(rendezvous, rndv_threshold)
        slots, slot_size, spin_us = ring_options(slots, slot_size, spin_us)
        layout.max_peer_ring()             # a bad RDMAMW_MAX_PEER_RING fails here
        self._rndv = (rendezvous, rndv_threshold, message_limit(max_message_size))
        scheme, where = split_address(address)
        if provider(scheme).authenticates:
            auth.token()
        observe.begin()     # RDMAMW_METRICS_PORT's endpoint, before the first accept
        with setup_errors(f"listening on {address}"):
            self._impl = provider(scheme).listen(where, slots=slots, slot_size=slot_size)
        self._owner = _fork.pid()
        self._spin_us = spin_us
        #: the address peers open; with an ephemeral port (``:0``) the one really bound
        self.address: str = self._impl.address

    def accept(self, timeout: float | None = None) -> Channel:
        """Wait for one peer (up to ``timeout`` s, None = forever) and return its Channel;
        the mode is the one the opener asked for."""
        if self._owner != _fork.pid():
            _fork.refuse("listener", self._owner)
        try:
            with setup_errors(f"accepting on {self.address}"):
                conn = self._impl.accept(timeout)
        except Timeout:
            raise
        except Exception as e:
            log.warning("%s refused a peer: %s", self.address, e)
            raise
        how = f"accepted on {self.address}"
        if conn.peer != self.address:
            how += " from {peer}"
        if conn.peer_rank is not None:
            how += f" (rank {conn.peer_rank})"
        return _make(Channel, conn, self._spin_us, self._rndv, how)

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (from another thread; it must not block) whenever a peer
        is ready to be accepted or the listener closes, until the returned function is
        called: an event loop waits for it, then calls ``accept(0)`` (rdmamw.aio)."""
        return self._impl.watch(callback)

    def close(self) -> None:
        """Stop listening. In a fork child only the child's copy of the listening
        socket is closed; the parent keeps listening."""
        if self._owner != _fork.pid():
            sock = getattr(self._impl, "_sock", None)
            if sock is not None:
                sock.close()        # the descriptor only: no shutdown, no threads
            return
        self._impl.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Listener {self.address}>"


def listen(address: str, **ring: Any) -> Listener:
    """Listen at ``address`` (``"shm://NAME"``); ``ring`` takes slots, slot_size, spin_us,
    rendezvous, rndv_threshold, max_message_size (as :meth:`Channel.open`)."""
    return Listener(address, **ring)
