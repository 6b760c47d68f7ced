"""Rank 0's store after the table went out: it goes on serving, for the World's
lifetime, so that a replacement of a lost rank can join the running job (an elastic
launcher restarts it with the same RANK, job identity and token) and the survivors can
learn its new descriptor (rdmamw/collectives/grow.py).

The same listener serves (rdmamw/listener.py: silent or hostile clients delay nobody,
every request proves the token, a join of another job is refused as before). Two
requests:

* a join of a rank already in the table is a *re-join*. It is taken only once rank 0
  has counted that rank out of the job (:meth:`Keeper.depart`: a shrink rank 0 took
  part in dropped it); until then the answer is ``wait`` (the joiner asks again until
  its init deadline: a launcher may restart a rank before the survivors shrank), so a
  second process with the RANK of a live one never replaces it. A re-join replaces the
  rank's descriptor, bumps its *generation* (``gen`` in the descriptor) and answers
  with the table, as the first join did;
* a ``lookup`` answers with the current table (each descriptor with its ``gen``).

A channel by rank binds the generations of its two ranks (the shm meeting name, the
tcp opener's hello: rdmamw/bootstrap/__init__.py), so a channel of a rank's earlier
process is never taken for one of the new."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rdmamw.bootstrap import store
from rdmamw.errors import ChannelClosed, ProtocolError, Timeout

log = logging.getLogger("rdmamw.bootstrap")


class Keeper:
    """Rank 0's store after init: re-joins and lookups, on a thread of its own until
    :meth:`close`."""

    def __init__(self, joins: store.Joins, table: dict[int, dict[str, Any]], job: str,
                 launcher_job: str | None, world_size: int) -> None:
        self.joins, self.job = joins, job
        self.identity = (launcher_job, world_size)
        self.table = table
        self.departed: set[int] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name="rdmamw-store-keeper")
        self.thread.start()

    def depart(self, ranks: set[int]) -> None:
        """``ranks`` are out of the job (a shrink dropped them): each may re-join."""
        with self.lock:
            self.departed |= set(ranks) & set(self.table) - {0}

    def current(self) -> dict[int, dict[str, Any]]:
        """A copy of the table as it stands."""
        with self.lock:
            return {r: dict(d) for r, d in self.table.items()}

    def _run(self) -> None:
        while True:
            try:
                j = self.joins.accept(None)
            except ChannelClosed:
                return
            except Exception as e:  # noqa: BLE001 - the accept loop's own failures: go on
                log.warning("rdmamw: the bootstrap store: %s", e)
                continue
            try:
                self._serve(j)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                store.refuse(j, self.joins.address, str(e), False)

    def _serve(self, j: Any) -> None:
        why = store.other_job((j.job, j.size), self.identity, "rank 0")
        if why is not None:
            store.refuse(j, self.joins.address, why, True)
            return
        with self.lock:
            rank = None if j.kind == store.LOOKUP else self._rejoin(j)
            if rank is None and j.kind != store.LOOKUP:
                return
            reply: dict[str, Any] = {"ok": True, "job": self.job, "table": [
                self.table[r] for r in range(len(self.table))]}
        if rank is not None:
            reply["rank"] = rank
            log.warning("rdmamw: rank %d re-joined the job (generation %d) from %s", rank,
                        self.table[rank]["gen"], j.peer)
        store.try_send(j.conn, reply)
        j.conn.close()

    def _rejoin(self, j: Any) -> int | None:
        """The rank a re-join takes (its new descriptor in the table), or None when it
        was refused or told to wait (under ``lock``)."""
        rank: int | None = j.rank
        if rank is None or rank not in self.table:
            raise ProtocolError(f"a join of rank {rank} after the job began: only a rank "
                                f"of the table may re-join")
        if rank not in self.departed:      # (told quietly: it asks again)
            store.try_send(j.conn, {"ok": False, "wait": True, "error": (
                f"rank {rank} is still a member of the running job: its process must be "
                f"lost and dropped by a shrink before another takes its place")})
            j.conn.close()
            return None
        self.departed.discard(rank)
        j.desc["rank"] = rank
        j.desc["gen"] = self.table[rank].get("gen", 0) + 1
        self.table[rank] = j.desc
        return rank

    def close(self) -> None:
        self.joins.close()
        self.thread.join(timeout=5)


def wait_for(get: Callable[[], dict[int, dict[str, Any]]], ranks: set[int],
             known: dict[int, int], end: float,
             pause: float = 0.1) -> dict[int, dict[str, Any]]:
    """Ask ``get()`` for the table until each of ``ranks`` has a generation past
    ``known``'s (by ``end``, time.monotonic()); the table. Timeout names the ranks
    that did not re-join."""
    while True:
        table = get()
        late = sorted(r for r in ranks if table[r].get("gen", 0) <= known.get(r, 0))
        if not late:
            return table
        if time.monotonic() >= end:
            raise Timeout(f"grow: ranks {late} did not re-join the job by the deadline "
                          f"(no new process of theirs joined rank 0's store)")
        time.sleep(pause)
