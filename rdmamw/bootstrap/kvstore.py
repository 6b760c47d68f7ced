"""Join a job through a key-value store somebody else runs, instead of rdmamw's own
bootstrap store on rank 0: ``torch.distributed``'s Store (TCPStore, FileStore,
HashStore, PrefixStore), so a process group meets once, through torch's store.

The store needs ``set(key, bytes)``, ``get(key) -> bytes`` and ``check([key]) ->
bool``. Each rank puts its endpoint descriptor under ``PREFIX/desc/RANK`` and rank 0
a fresh job id under ``PREFIX/job``; then every rank polls for the others' keys (a
deadline, sleeping between polls) and builds the same :class:`World` that
:func:`rdmamw.init` would. A rank that never comes makes every rank raise a Timeout
that names it. Every descriptor read is checked like a join of the bootstrap store."""

from __future__ import annotations

import secrets
import time
from typing import Any, Protocol

import msgpack

from rdmamw import config
from rdmamw.bootstrap import World, _descriptor, _Listeners, choice, ranklist
from rdmamw.bootstrap.store import parse_join
from rdmamw.errors import ProtocolError, Timeout

POLL_MIN, POLL_MAX = 0.001, 0.05


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


def join(kv: KV, rank: int, size: int, timeout: float, ip: str, prefix: str = "rdmamw",
         ring: tuple[int, int] | None = None, launcher: str = "store") -> World:
    """This rank's :class:`World` of ``size`` ranks met through ``kv`` (see module doc)."""
    what = f"joining {size} ranks through the store"
    deadline = time.monotonic() + timeout
    made = _Listeners()
    try:
        desc = _descriptor(ip, ring or (config.get("RDMAMW_SLOTS"),
                                        config.get("RDMAMW_SLOT_SIZE")), made)
        desc["rank"] = rank
        if rank == 0:
            kv.set(f"{prefix}/job", secrets.token_hex(6).encode())
        kv.set(f"{prefix}/desc/{rank}", msgpack.packb(desc))
        keys = {r: f"{prefix}/desc/{r}" for r in range(size)}
        _await(kv, {0: f"{prefix}/job", **keys}, deadline, what, size, timeout)
        table = {}
        for r, k in keys.items():
            try:
                got_rank, _, d = parse_join({"rank": r, "desc": msgpack.unpackb(kv.get(k))})
            except (ProtocolError, ValueError, TypeError, msgpack.UnpackException) as e:
                raise ProtocolError(f"{what}: rank {r}'s descriptor is malformed: {e}") from e
            d["rank"] = got_rank
            table[r] = d
        job = kv.get(f"{prefix}/job").decode("ascii", "replace")
        made.set_job(job)
        choice.check_forced(table)
    except BaseException:
        made.close()
        raise
    made.world = World(rank, size, launcher, job, table, dict(made))
    return made.world
