"""Bootstrap: ``rdmamw.init()`` learns this process's rank from the launcher, meets
every other rank through the store on rank 0 and keeps their endpoint descriptors,
so ``Channel.open(rank)`` can connect by rank with the best provider: ``verbs`` when
both ends have a usable device, ``shm`` when the peer shares this host (same kernel
and network namespace), else ``tcp``; ``RDMAMW_PROVIDER`` forces one.

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
from rdmamw.bootstrap import store
from rdmamw.bootstrap.env import LaunchInfo, detect
from rdmamw.errors import ProviderUnavailable, RdmamwError, setup_errors
from rdmamw.providers import PROVIDERS, Connected, provider

log = logging.getLogger("rdmamw.bootstrap")


def host_key() -> str:
    """Equal for two processes exactly when shm works between them: same kernel boot
    and same network namespace (shm:// names are abstract sockets, per namespace)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"


@dataclass
class World:
    """This process's place in the job, after :func:`init`."""

    rank: int
    world_size: int
    launcher: str
    job: str
    peers: dict[int, dict]
    _tcp: Any = None                     # our tcp listener (lower rank of a pair accepts)
    _stash: dict[int, list[Connected]] = field(default_factory=dict)
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
        forced = config.get("RDMAMW_PROVIDER")
        if forced:
            return forced, "forced by RDMAMW_PROVIDER"
        me, other = self.peers[self.rank], self.peers[rank]
        if "verbs" in PROVIDERS and me.get("verbs") and other.get("verbs"):
            return "verbs", "both ranks have a usable RDMA device"
        if me.get("host") == other.get("host"):
            return "shm", "same host (kernel and network namespace)"
        return "tcp", (f"different hosts ({me.get('hostname')} / {other.get('hostname')}) "
                       f"and no RDMA device on both")

    def accept_tcp(self, rank: int, timeout: float) -> Connected:
        """The next tcp connection from ``rank``; others that arrive meanwhile wait in
        a stash for their own ``Channel.open``."""
        with self._accept_lock:
            while not self._stash.get(rank):
                conn = self._tcp.accept(timeout)
                if conn.peer_rank is None or conn.peer_rank not in self.peers:
                    log.warning("rdmamw: dropped a tcp channel from unknown rank %s",
                                conn.peer_rank)
                    conn.transport.close()
                    continue
                self._stash.setdefault(conn.peer_rank, []).append(conn)
            return self._stash[rank].pop(0)

    def close(self) -> None:
        if self._owner != _fork.pid():
            return              # a fork child: the listener and stash are the parent's
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None
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


def _descriptor(ip: str, ring: tuple[int, int]) -> tuple[dict, Any]:
    tcp = provider("tcp").listen(f"{ip}:0", slots=ring[0], slot_size=ring[1])
    desc = {"host": host_key(), "hostname": socket.gethostname(), "pid": os.getpid(),
            "tcp": tcp.address, "verbs": False}
    return desc, tcp


def _rendezvous(info: LaunchInfo, timeout: float, ring: tuple[int, int]) -> World:
    if info.rank == 0:
        sock = store.listen(info.master_addr, info.master_port)
        tcp = None
        try:
            desc, tcp = _descriptor(sock.getsockname()[0], ring)
            ranges = {}
            if info.role is not None:        # ps-lite: servers first, then workers
                servers = int(os.environ.get("DMLC_NUM_SERVER", 0))
                ranges = {"server": range(1, 1 + servers),
                          "worker": range(1 + servers, info.world_size)}
            desc["rank"] = 0
            table, job = store.serve(sock, info.world_size, desc, timeout, ranges)
        except BaseException:
            if tcp is not None:
                tcp.close()
            raise
        finally:
            sock.close()
        return World(0, info.world_size, info.launcher, job, table, tcp)
    made: list[Any] = []

    def make_desc(ip: str) -> dict:
        desc, tcp = _descriptor(ip, ring)
        made.append(tcp)
        return desc

    try:
        table, job, rank = store.join(info.master_addr, info.master_port, info.rank,
                                      info.role, make_desc, info.world_size, timeout)
    except BaseException:
        for tcp in made:
            tcp.close()
        raise
    return World(rank, info.world_size, info.launcher, job, table, made[-1])


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
    if scheme == "tcp":
        if lower:
            return w.accept_tcp(rank, timeout)
        return mod.connect(w.peers[rank]["tcp"].partition("://")[2], mode=mode,
                           timeout=timeout, slots=slots, slot_size=slot_size, rank=w.rank)
    if scheme == "shm":
        name = f"rdmamw-{w.job}-{min(rank, w.rank)}-{max(rank, w.rank)}"
        if lower:
            lst = mod.listen(name, slots=slots, slot_size=slot_size)
            try:
                return lst.accept(timeout)
            finally:
                lst.close()
        return mod.connect(name, mode=mode, timeout=timeout, slots=slots, slot_size=slot_size)
    raise ProviderUnavailable(f"provider {scheme!r} cannot open channels by rank yet")


__all__ = ["LaunchInfo", "World", "auth", "connect_rank", "detect", "finalize", "init",
           "world"]
