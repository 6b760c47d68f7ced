"""Bootstrap: ``rdmamw.init()`` learns this process's rank from the launcher, meets
every other rank through the store on rank 0 and keeps their endpoint descriptors,
so ``Channel.open(rank)`` can connect by rank with the best provider. The providers
choose (rdmamw/bootstrap/choice.py): each registered provider answers whether it can
connect two ranks from their descriptors and how much it wants to, and the highest
answer wins; ``RDMAMW_PROVIDER`` forces one. The bootstrap names no provider: it asks
the registry (rdmamw/providers/__init__.py) for every one's descriptor part, listener
and connection by rank.

Of each pair, the lower rank accepts and the higher rank connects, so both sides of
a pair call ``Channel.open(other_rank)``. Those channels prove the job as well as the
token (rdmamw.auth.job_key of the id rank 0 hands out), so a rank of another job, or
of an earlier run of this one, never gets in. A rank may hold at most
``STASH_PER_PEER`` channels a peer opened and nobody asked for yet; more are dropped."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdmamw import _fork, _host, auth, config, observe
from rdmamw.bootstrap import choice, ifname, rejoin, store
from rdmamw.bootstrap.env import LaunchInfo, detect
from rdmamw.errors import (
    PeerLost,
    ProtocolError,
    ProviderUnavailable,
    RdmamwError,
    Timeout,
    setup_errors,
)
from rdmamw.listener import HandshakeListener, handshake_timeout
from rdmamw.providers import Connected, provider, providers
from rdmamw.providers.base import Advert, RankPair

log = logging.getLogger("rdmamw.bootstrap")
#: channels from one peer (per provider) that wait for their Channel.open
STASH_PER_PEER = 32
#: the longest an accept holds the listener while it waits (see World.accept)
ACCEPT_SLICE = 0.05


@dataclass
class World:
    """This process's place in the job, after :func:`init`."""

    rank: int
    world_size: int
    launcher: str
    job: str
    peers: dict[int, dict[str, Any]]
    #: our listeners by provider (those that advertised one): the lower rank of a pair
    #: accepts on them
    _listeners: dict[str, Any] = field(default_factory=dict)
    _stash: dict[tuple[str, int], list[Connected]] = field(default_factory=dict)
    _accept_lock: threading.Lock = field(default_factory=threading.Lock)
    _owner: int = field(default_factory=_fork.pid)     # a fork child is not this rank
    #: how to reach rank 0's store: (address, port, launcher job id)
    _store: tuple[str, int, str | None] | None = None
    #: rank 0: its store, serving re-joins and lookups (rdmamw/bootstrap/rejoin.py)
    _keeper: rejoin.Keeper | None = None

    def gen(self, rank: int) -> int:
        """The generation of ``rank``'s process: 0, +1 at each re-join (0 for a rank
        the table does not hold: nothing of it can be accepted anyway)."""
        return int(self.peers.get(rank, {}).get("gen", 0))

    def depart(self, ranks: set[int]) -> None:
        """``ranks`` are out of the job (a shrink dropped them): on rank 0, each may
        now re-join (rdmamw/bootstrap/rejoin.py)."""
        if self._keeper is not None:
            self._keeper.depart(ranks)

    def refresh(self, ranks: set[int], end: float) -> None:
        """Wait (by ``end``, time.monotonic()) until each of ``ranks`` re-joined rank
        0's store, then take their new descriptors: channels to them from now on meet
        their new processes; those of the old ones are dropped."""
        known = {r: self.gen(r) for r in ranks}
        table = rejoin.wait_for(self._lookup(end), set(ranks), known, end)
        with self._accept_lock:
            for r in ranks:
                self.peers[r] = table[r]
                for key in [k for k in self._stash if k[1] == r]:
                    self._drop_stash(key)

    def _lookup(self, end: float) -> Callable[[], dict[int, dict[str, Any]]]:
        """What gives the job's current table (for :meth:`refresh`, by ``end``)."""
        if self._keeper is not None:
            return self._keeper.current
        if self._store is not None:
            host, port, launcher_job = self._store

            def get() -> dict[int, dict[str, Any]]:
                left = max(0.5, end - time.monotonic())
                try:
                    return store.lookup(host, port, self.world_size, left, launcher_job)[0]
                except (Timeout, PeerLost) as e:
                    raise PeerLost(f"grow: rank 0's bootstrap store is gone ({e}): a job "
                                   f"that lost rank 0 cannot take ranks back") from None
            return get
        raise RdmamwError("grow: this World has no bootstrap store to ask")

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

    def descriptors(self, rank: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(my descriptor, ``rank``'s): what a provider's listener judges an opener by;
        ProtocolError for a rank that is not a peer."""
        if rank is None or rank not in self.peers or rank == self.rank:
            raise ProtocolError(f"a connection by rank from rank {rank}, which is not a "
                                f"peer of rank {self.rank}")
        return self.peers[self.rank], self.peers[rank]

    def accept(self, scheme: str, rank: int, timeout: float) -> Connected:
        """The next ``scheme`` connection from ``rank``; others that arrive meanwhile
        wait in a stash for their own ``Channel.open``. Threads accepting from several
        ranks at once (a shrink opens its channels that way) take turns of
        ACCEPT_SLICE: one waiting for a rank that never comes holds up no other.
        It takes only a connection of the rank's process (generation) it began with,
        and gives up once that process was replaced (a re-join: an open to a lost rank
        left running never takes its replacement's connection)."""
        lst = self._listeners.get(scheme)
        if lst is None:
            raise ProviderUnavailable(f"rank {self.rank} has no {scheme} listener")
        end = time.monotonic() + timeout
        gen = self.gen(rank)
        while True:
            with self._accept_lock:
                if self.gen(rank) != gen:
                    raise PeerLost(f"rank {rank} re-joined (generation {self.gen(rank)}) "
                                   f"while a channel to its generation {gen} was opened")
                self._drop_stash((scheme, rank))
                stash = self._stash.get((scheme, rank), [])
                mine = next((c for c in stash if c.peer_gen == gen), None)
                if mine is not None:
                    stash.remove(mine)
                    return mine
                left = end - time.monotonic()
                try:
                    conn = lst.accept(max(0.0, min(left, ACCEPT_SLICE)))
                except Timeout:
                    if left <= ACCEPT_SLICE:
                        raise
                    conn = None
                if conn is not None:
                    self._keep(scheme, conn)
            if conn is None:
                time.sleep(0.001)       # the others' turn (a lock released is not given)

    def _drop_stash(self, key: tuple[str, int]) -> None:
        """Close the stashed connections of ``key`` from an earlier generation of their
        rank than the table's (a later one waits for the table to catch up)."""
        kept = []
        for c in self._stash.get(key, []):
            if c.peer_gen < self.gen(key[1]):
                log.warning("rdmamw: dropped a %s channel from generation %d of rank %d "
                            "(the job's is %d)", key[0], c.peer_gen, key[1], self.gen(key[1]))
                c.transport.close()
            else:
                kept.append(c)
        if key in self._stash:
            self._stash[key] = kept

    def _keep(self, scheme: str, conn: Connected) -> None:
        """A connection accepted, into the stash of the rank it came from (dropped if
        that is no peer, or an earlier generation of it, or if the stash is full)."""
        if conn.peer_rank is None or conn.peer_rank not in self.peers:
            log.warning("rdmamw: dropped a %s channel from unknown rank %s",
                        scheme, conn.peer_rank)
            conn.transport.close()
            return
        if conn.peer_gen < self.gen(conn.peer_rank):
            log.warning("rdmamw: dropped a %s channel from generation %d of rank %d: it "
                        "re-joined since (generation %d)", scheme, conn.peer_gen,
                        conn.peer_rank, self.gen(conn.peer_rank))
            conn.transport.close()
            return
        stash = self._stash.setdefault((scheme, conn.peer_rank), [])
        if len(stash) >= STASH_PER_PEER:
            log.warning("rdmamw: dropped a %s channel from rank %d: %d of its "
                        "channels already wait for a Channel.open(%d)", scheme,
                        conn.peer_rank, len(stash), conn.peer_rank)
            conn.transport.close()
            return
        stash.append(conn)

    def close(self) -> None:
        if self._owner != _fork.pid():
            return              # a fork child: the listeners and stash are the parent's
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
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
    """Join the job: read rank / world size / bootstrap address from the launcher's
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
            _world = joined = _join(info, t, ring)
    observe.begin()         # RDMAMW_METRICS_PORT's endpoint (rdmamw/observe.py)
    return joined


class _Listeners(dict[str, Any]):
    """This rank's listeners while it joins; a listener that must judge who connects
    asks the World (made after the table comes) for the two descriptors."""

    world: World | None = None

    def __init__(self) -> None:
        super().__init__()
        self._job: str | None = None
        self._known = threading.Event()

    def set_job(self, job: str) -> None:
        """The job's id is known: connections by rank prove it from now on."""
        self._job = job
        self._known.set()

    def key(self) -> bytes:
        """The key our listeners check openers' proofs with (the job's), waiting for the
        job's id while the table is on its way."""
        if not self._known.wait(handshake_timeout()):
            raise ProtocolError("a connection by rank before the job's id is known")
        assert self._job is not None
        return auth.job_key(self._job)

    def peers(self, rank: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.world is None:
            raise ProtocolError("a connection by rank before the job's table is known")
        return self.world.descriptors(rank)

    def close(self) -> None:
        for lst in self.values():
            lst.close()


def _descriptor(ip: str, ring: tuple[int, int], made: _Listeners) -> dict[str, Any]:
    """This rank's descriptor (docs/protocol.md): who and where it is, and each
    provider's part under its scheme; their listeners go into ``made``."""
    ip = ifname.selected_address() or ip
    desc: dict[str, Any] = {"host": _host.host_key(), "hostname": socket.gethostname(),
                            "pid": os.getpid(), "proc": _host.process_key(),
                            "forced": config.get("RDMAMW_PROVIDER")}
    advert = Advert(ip, ring[0], ring[1], made.peers)
    for p in providers():
        try:
            part, lst = p.advertise(advert)
        except ProviderUnavailable as e:
            log.info("%s: not advertised: %s", p.scheme, e)
            part, lst = {"why": str(e)}, None
        if part is not None:
            desc[p.scheme] = part
        if lst is not None:
            made[p.scheme] = lst
            if isinstance(lst, HandshakeListener):
                lst.key = made.key
    return desc


def _join(info: LaunchInfo, timeout: float, ring: tuple[int, int]) -> World:
    made = _Listeners()
    keeper = None
    try:
        if info.rank == 0:
            joins = store.Joins(store.listen(info.master_addr, info.master_port))
            try:
                desc = _descriptor(joins.host, ring, made)
                desc["rank"] = 0        # ps-lite: info.ranges has servers, then workers
                job = store.new_job()
                made.set_job(job)       # before the table goes out: peers may open at once
                table, job = store.collect(joins, info.world_size, desc, timeout,
                                           info.ranges, info.job_id, job)
            except BaseException:
                joins.close()
                raise
            # the store goes on serving re-joins and lookups (rdmamw/bootstrap/rejoin.py)
            keeper = rejoin.Keeper(joins, table, job, info.job_id, info.world_size)
            rank = 0
        else:
            def make_desc(ip: str) -> dict[str, Any]:
                made.close()
                made.clear()
                return _descriptor(ip, ring, made)

            table, job, rank = store.join(info.master_addr, info.master_port, info.rank,
                                          info.role, make_desc, info.world_size, timeout,
                                          ifname.selected_address(), info.job_id)
            made.set_job(job)
        choice.check_forced(table)
    except BaseException:
        made.close()
        raise
    made.world = World(rank, info.world_size, info.launcher, job, table, dict(made),
                       _store=(info.master_addr, info.master_port, info.job_id),
                       _keeper=keeper)
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
    if scheme in w.peers[rank]:         # a table not from our store: check it here too
        provider(scheme).check_entry(w.peers[rank][scheme])
    log.info("rank %d -> rank %d: %s provider (%s)", w.rank, rank, scheme, why)
    pair = RankPair(w.job, w.rank, rank, w.peers[w.rank], w.peers[rank],
                    lambda t: w.accept(scheme, rank, t),
                    lambda: _host.ended(w.peers[w.rank], w.peers.get(rank, {})))
    with auth.keyed(auth.job_key(w.job)):   # we prove the job, not just the token
        return provider(scheme).connect_rank(pair, mode=mode, timeout=timeout, slots=slots,
                                             slot_size=slot_size)


__all__ = ["LaunchInfo", "World", "auth", "connect_rank", "detect", "finalize", "init",
           "world"]
