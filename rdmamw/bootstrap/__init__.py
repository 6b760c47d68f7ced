"""Bootstrap: ``rdmamw.init()`` learns this process's rank from the launcher, meets
every other rank through the store on rank 0 and keeps their endpoint descriptors,
so ``Channel.open(rank)`` can connect by rank with the best provider. The providers
choose (rdmamw/bootstrap/choice.py): ``shm`` when the peer shares this host (same
kernel and network namespace), ``verbs`` across hosts on a common RDMA fabric, else
``tcp``; ``RDMAMW_PROVIDER`` forces one.

Of each pair, the lower rank accepts and the higher rank connects, so both sides of
a pair call ``Channel.open(other_rank)``."""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from rdmamw import _fork, auth, config
from rdmamw.bootstrap import choice, ifname, store
from rdmamw.bootstrap.env import LaunchInfo, detect
from rdmamw.errors import ProtocolError, ProviderUnavailable, RdmamwError, setup_errors
from rdmamw.providers import Connected, provider, verbs_rank
from rdmamw.providers.shm import host_key

log = logging.getLogger("rdmamw.bootstrap")


@dataclass
class World:
    """This process's place in the job, after :func:`init`."""

    rank: int
    world_size: int
    launcher: str
    job: str
    peers: dict[int, dict]
    #: our listeners by provider (tcp; verbs when we have a usable port): the lower
    #: rank of a pair accepts on them
    _listeners: dict[str, Any] = field(default_factory=dict)
    _stash: dict[tuple[str, int], list[Connected]] = field(default_factory=dict)
    _accept_lock: threading.Lock = field(default_factory=threading.Lock)
    _owner: int = field(default_factory=_fork.pid)     # a fork child is not this rank

    def provider_for(self, rank: int) -> str:
        """The transport a channel to ``rank`` uses (the same choice on both sides)."""
        return self.provider_choice(rank)[0]

    def provider_choice(self, rank: int) -> tuple[str, str]:
        """(the transport for ``rank``, why it was chosen)."""
        if rank not in self.peers or rank == self.rank:
            raise ValueError(f"rank {rank} is not a peer (world of {self.world_size}, "
                             f"I am {self.rank})")
        me = self.peers[self.rank]
        if me.get("forced"):
            return me["forced"], "forced by RDMAMW_PROVIDER"
        return choice.choose(me, self.peers[rank])

    def verbs_pin(self, rank: int | None) -> Any:
        """The port a verbs channel with ``rank`` uses here and the GID that rank's
        handshake must show (from the two descriptors); ProtocolError if none."""
        from rdmamw.providers.verbs import Pin
        if rank is None or rank not in self.peers or rank == self.rank:
            raise ProtocolError(f"a verbs connection by rank from rank {rank}, which is "
                                f"not a peer of rank {self.rank}")
        lower, higher = sorted((self.rank, rank))
        got = verbs_rank.pair(self.peers[lower], self.peers[higher])
        if isinstance(got, str):
            raise ProtocolError(f"no verbs channel between rank {self.rank} and rank "
                                f"{rank}: {got}")
        mine, theirs = got if self.rank == lower else got[::-1]
        return Pin(mine.dev, mine.port, mine.gid_index, theirs.gid)

    def accept(self, scheme: str, rank: int, timeout: float) -> Connected:
        """The next ``scheme`` connection from ``rank``; others that arrive meanwhile
        wait in a stash for their own ``Channel.open``."""
        lst = self._listeners.get(scheme)
        if lst is None:
            raise ProviderUnavailable(f"rank {self.rank} has no {scheme} listener")
        with self._accept_lock:
            while not self._stash.get((scheme, rank)):
                conn = lst.accept(timeout)
                if conn.peer_rank is None or conn.peer_rank not in self.peers:
                    log.warning("rdmamw: dropped a %s channel from unknown rank %s",
                                scheme, conn.peer_rank)
                    conn.transport.close()
                    continue
                self._stash.setdefault((scheme, conn.peer_rank), []).append(conn)
            return self._stash[(scheme, rank)].pop(0)

    def close(self) -> None:
        if self._owner != _fork.pid():
            return              # a fork child: the listeners and stash are the parent's
        for lst in self._listeners.values():
            lst.close()
        self._listeners.clear()
        for conns in self._stash.values():
            for c in conns:
                c.transport.close()
        self._stash.clear()


_world: World | None = None
_lock = threading.Lock()


def init(timeout: float | None = None, *, slots: int | None = None,
         slot_size: int | None = None) -> World:
    """Join the job: read rank / world size / rendezvous from the launcher's
    environment, exchange descriptors through rank 0 (within ``timeout`` s, default
    ``RDMAMW_INIT_TIMEOUT`` or 60) and return the :class:`World`. Idempotent."""
    global _world
    with _lock:
        if _world is not None:
            return _world
        info = detect()
        t = config.get("RDMAMW_INIT_TIMEOUT") if timeout is None else float(timeout)
        ring = (slots or config.get("RDMAMW_SLOTS"),
                slot_size or config.get("RDMAMW_SLOT_SIZE"))
        with setup_errors("rdmamw.init()"):
            _world = _rendezvous(info, t, ring)
        return _world


class _Listeners(dict):
    """This rank's listeners while it joins; the verbs one asks the World (made after
    the table comes) which port and GID each opener's rank gets."""

    world: World | None = None

    def pin(self, rank: int | None) -> Any:
        if self.world is None:
            raise ProtocolError("a verbs connection before the job's table is known")
        return self.world.verbs_pin(rank)

    def close(self) -> None:
        for lst in self.values():
            lst.close()


def _descriptor(ip: str, ring: tuple[int, int], made: _Listeners) -> dict:
    """This rank's descriptor (docs/protocol.md); its listeners go into ``made``."""
    ip = ifname.selected_address() or ip
    tcp = provider("tcp").listen(f"{ip}:0", slots=ring[0], slot_size=ring[1])
    made["tcp"] = tcp
    desc = {"host": host_key(), "hostname": socket.gethostname(), "pid": os.getpid(),
            "tcp": tcp.address, "forced": config.get("RDMAMW_PROVIDER")}
    try:
        desc["verbs"], lst = verbs_rank.advertise(ip, ring[0], ring[1], made.pin,
                                                  provider("verbs").listen)
    except ProviderUnavailable as e:
        desc["verbs"], lst = {"why": str(e)}, None
    if lst is not None:
        made["verbs"] = lst
    return desc


def _rendezvous(info: LaunchInfo, timeout: float, ring: tuple[int, int]) -> World:
    made = _Listeners()
    try:
        if info.rank == 0:
            sock = store.listen(info.master_addr, info.master_port)
            try:
                desc = _descriptor(sock.getsockname()[0], ring, made)
                ranges = {}
                if info.role is not None:        # ps-lite: servers first, then workers
                    servers = int(os.environ.get("DMLC_NUM_SERVER", 0))
                    ranges = {"server": range(1, 1 + servers),
                              "worker": range(1 + servers, info.world_size)}
                desc["rank"] = 0
                table, job = store.serve(sock, info.world_size, desc, timeout, ranges)
            finally:
                sock.close()
            rank = 0
        else:
            def make_desc(ip: str) -> dict:
                made.close()
                made.clear()
                return _descriptor(ip, ring, made)

            table, job, rank = store.join(info.master_addr, info.master_port, info.rank,
                                          info.role, make_desc, info.world_size, timeout,
                                          ifname.selected_address())
        choice.check_forced(table)
    except BaseException:
        made.close()
        raise
    made.world = World(rank, info.world_size, info.launcher, job, table, dict(made))
    return made.world


def world() -> World:
    """The World of :func:`init`, or a clear error."""
    if _world is None:
        raise RdmamwError("call rdmamw.init() before opening a channel by rank")
    return _world


def finalize() -> None:
    """Close the listener init() opened; channels already open stay open."""
    global _world
    with _lock:
        if _world is not None:
            _world.close()
            _world = None


def connect_rank(rank: int, *, mode: str, timeout: float, slots: int,
                 slot_size: int, in_world: World | None = None) -> Connected:
    """A connected transport to ``rank`` of ``in_world`` (default: :func:`init`'s); the
    lower rank of the pair accepts."""
    w = in_world or world()
    if w._owner != _fork.pid():
        _fork.refuse(f"job membership (rank {w.rank})", w._owner)
    scheme, why = w.provider_choice(rank)
    log.info("rank %d -> rank %d: %s provider (%s)", w.rank, rank, scheme, why)
    mod = provider(scheme)
    lower = w.rank < rank
    if scheme == "shm":
        name = f"rdmamw-{w.job}-{min(rank, w.rank)}-{max(rank, w.rank)}"
        if lower:
            lst = mod.listen(name, slots=slots, slot_size=slot_size)
            try:
                return lst.accept(timeout)
            finally:
                lst.close()
        return mod.connect(name, mode=mode, timeout=timeout, slots=slots, slot_size=slot_size)
    if lower:
        return w.accept(scheme, rank, timeout)
    ring = {"mode": mode, "timeout": timeout, "slots": slots, "slot_size": slot_size,
            "rank": w.rank}
    if scheme == "tcp":
        return mod.connect(w.peers[rank]["tcp"].partition("://")[2], **ring)
    if scheme == "verbs":
        addr, _ports = verbs_rank.parse(w.peers[rank])      # type: ignore[misc]
        return mod.connect(addr.partition("://")[2], pin=w.verbs_pin(rank), **ring)
    raise ProviderUnavailable(f"provider {scheme!r} cannot open channels by rank")


__all__ = ["LaunchInfo", "World", "auth", "connect_rank", "detect", "finalize", "init",
           "world"]
