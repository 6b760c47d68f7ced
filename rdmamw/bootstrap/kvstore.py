"""Join a job through a key-value store somebody else runs, instead of rdmamw's own
bootstrap store on rank 0: ``torch.distributed``'s Store (TCPStore, FileStore,
HashStore, PrefixStore), so a process group meets once, through torch's store.

The store needs ``set(key, bytes)``, ``get(key) -> bytes`` and ``check([key]) ->
bool``. Each rank puts its endpoint descriptor under ``PREFIX/desc/RANK`` and rank 0
a fresh job id under ``PREFIX/job``; then every rank polls for the others' keys (a
deadline, sleeping between polls) and builds the same :class:`World` that
:func:`rdmamw.init` would. A rank that never comes makes every rank raise a Timeout
that names it. Every descriptor read is checked like a join of the bootstrap store.

The store then serves the job as rank 0's bootstrap store does after its table went
out (rdmamw/bootstrap/rejoin.py), so that a lost rank's replacement process can take
its place: a shrink that drops rank r writes ``PREFIX/gone/r`` (the generation it
dropped); :func:`rejoin` waits for that, then publishes the new process's descriptor
with the next generation under ``PREFIX/desc/r``, where the members' grow
(:meth:`StoreWorld.refresh`) reads it. A second process with the rank of a live
member never replaces it (it waits for the ``gone`` key, by its deadline)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from rdmamw import config
from rdmamw.bootstrap import World, _descriptor, _Listeners, choice, ranklist
from rdmamw.bootstrap.store import parse_join
from rdmamw.errors import ProtocolError, Timeout

POLL_MIN, POLL_MAX = 0.001, 0.05
#: seconds a shrink waits for the store to take its note for re-joins
DEPART_WAIT = 2.0
log = logging.getLogger("rdmamw.bootstrap")


class KV(Protocol):
    def set(self, key: str, value: bytes) -> Any: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def _await(kv: KV, keys: dict[int, str], deadline: float, what: str, size: int,
           timeout: float) -> None:
    """Poll until every key exists; Timeout naming the ranks whose keys are missing."""
    pause, left = POLL_MIN, dict(keys)
    while left:
        left = {r: k for r, k in left.items() if not kv.check([k])}
        if not left:
            return
        if time.monotonic() >= deadline:
            raise Timeout(f"{what}: ranks {ranklist.compact(left)} of {size} never "
                          f"published their endpoints in the store within {timeout:g} s "
                          f"({len(left)} ranks: not started, crashed, or started with "
                          f"another world size?)")
        time.sleep(pause)
        pause = min(POLL_MAX, pause * 2)


@dataclass
class StoreWorld(World):
    """A :class:`World` met through a store: the store also takes re-joins (see the
    module doc)."""

    _kv: Any = None
    _prefix: str = "rdmamw"

    def depart(self, ranks: set[int]) -> None:
        """Note in the store that ``ranks`` may re-join; best effort, within
        :data:`DEPART_WAIT`: the store's host may be the rank that was lost (torch's
        store lives on rank 0), or stopped, and the shrink that calls this goes on
        without it (a warning says re-joins through the store are then impossible)."""
        keys = [(f"{self._prefix}/gone/{r}", str(self.gen(r)).encode())
                for r in sorted(set(ranks) - {self.rank})]
        if not keys:
            return
        failed: list[BaseException] = []

        def note() -> None:
            try:
                for k, v in keys:
                    self._kv.set(k, v)
            except Exception as e:  # noqa: BLE001 - whatever the store raises
                failed.append(e)
        t = threading.Thread(target=note, name="rdmamw-store-depart", daemon=True)
        t.start()
        t.join(DEPART_WAIT)
        if failed or t.is_alive():
            why = repr(failed[0]) if failed else f"no answer in {DEPART_WAIT:g} s"
            log.warning("the store could not take the note that ranks %s may re-join "
                         "(%s): a replacement cannot re-join through it", sorted(ranks), why)

    def _lookup(self, end: float) -> Callable[[], dict[int, dict[str, Any]]]:
        return lambda: _table(self._kv, self._prefix, self.world_size,
                              f"joining {self.world_size} ranks through the store")


def _table(kv: KV, prefix: str, size: int, what: str) -> dict[int, dict[str, Any]]:
    """Every rank's descriptor in the store, each checked."""
    table = {}
    for r in range(size):
        try:
            raw = msgpack.unpackb(kv.get(f"{prefix}/desc/{r}"))
            got_rank, _, d = parse_join({"rank": r, "desc": raw})
            gen = d.get("gen", 0)
            if type(gen) is not int or not 0 <= gen < 1 << 31:
                raise ProtocolError(f"generation {gen!r}")
        except (ProtocolError, ValueError, TypeError, msgpack.UnpackException) as e:
            raise ProtocolError(f"{what}: rank {r}'s descriptor is malformed: {e}") from e
        d["rank"] = got_rank
        table[r] = d
    return table


def join(kv: KV, rank: int, size: int, timeout: float, ip: str, prefix: str = "rdmamw",
         ring: tuple[int, int] | None = None, launcher: str = "store") -> World:
    """This rank's :class:`World` of ``size`` ranks met through ``kv`` (see module doc)."""
    return _meet(kv, rank, size, timeout, ip, prefix, ring, launcher, rejoining=False)


def rejoin(kv: KV, rank: int, size: int, timeout: float, ip: str, prefix: str = "rdmamw",
           ring: tuple[int, int] | None = None, launcher: str = "store") -> World:
    """As :func:`join`, for a new process of ``rank`` in a job that met through ``kv``
    and dropped that rank (see module doc): its World, with the next generation."""
    return _meet(kv, rank, size, timeout, ip, prefix, ring, launcher, rejoining=True)


def _generation(kv: KV, rank: int, size: int, prefix: str, deadline: float,
                timeout: float) -> int:
    """The generation a new process of ``rank`` takes: one past the dropped one's, once
    a shrink dropped it (by ``deadline``)."""
    what = f"re-joining rank {rank} of {size} through the store"
    _await(kv, {0: f"{prefix}/job", rank: f"{prefix}/desc/{rank}"}, deadline, what, size,
           timeout)
    now = int(_table(kv, prefix, size, what)[rank].get("gen", 0))
    gone, pause = f"{prefix}/gone/{rank}", POLL_MIN
    while not kv.check([gone]) or int(kv.get(gone)) < now:
        if time.monotonic() >= deadline:
            raise Timeout(f"{what}: rank {rank} is still a member of the running job "
                          f"after {timeout:g} s: its process must be lost and dropped by "
                          f"a shrink before another takes its place")
        time.sleep(pause)
        pause = min(POLL_MAX, pause * 2)
    return now + 1


def _meet(kv: KV, rank: int, size: int, timeout: float, ip: str, prefix: str,
          ring: tuple[int, int] | None, launcher: str, rejoining: bool) -> World:
    what = f"joining {size} ranks through the store"
    deadline = time.monotonic() + timeout
    made = _Listeners()
    try:
        gen = _generation(kv, rank, size, prefix, deadline, timeout) if rejoining else 0
        desc = _descriptor(ip, ring or (config.get("RDMAMW_SLOTS"),
                                        config.get("RDMAMW_SLOT_SIZE")), made)
        desc["rank"] = rank
        if gen:
            desc["gen"] = gen
        if rank == 0 and not rejoining:
            kv.set(f"{prefix}/job", secrets.token_hex(6).encode())
        kv.set(f"{prefix}/desc/{rank}", msgpack.packb(desc))
        keys = {r: f"{prefix}/desc/{r}" for r in range(size)}
        _await(kv, {0: f"{prefix}/job", **keys}, deadline, what, size, timeout)
        table = _table(kv, prefix, size, what)
        job = kv.get(f"{prefix}/job").decode("ascii", "replace")
        made.set_job(job)
        choice.check_forced(table)
    except BaseException:
        made.close()
        raise
    made.world = StoreWorld(rank, size, launcher, job, table, dict(made), _kv=kv,
                            _prefix=prefix)
    return made.world
