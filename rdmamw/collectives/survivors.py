"""Going on without a lost rank: the survivors agree on who they are and get a
communicator of their own (as ULFM's ``MPIX_Comm_shrink``, NCCL's ``ncclCommShrink``).

Every survivor calls :meth:`Communicator.shrink` on the broken communicator, which
runs :func:`agree`. Each starts from the
ranks it saw fail and opens a small channel to every other member it believes alive
(ascending world rank, as :meth:`Communicator.ensure` does: no deadlock). Then rounds:
each sends its set of failed ranks to all of them and takes theirs; a member it cannot
reach, or that sends nothing by the deadline, has failed too. The set is the union of
what it got. A round in which every member sent the very set this one holds, and none
failed, decides it: the survivors, in world-rank order, are the new communicator's
ranks 0, 1, ...

Everyone who decides in the same round decides the same set (they all took the same
sets). A member dying *during* the deciding round can leave the others split (some
saw its last message, some did not); the next collective on the new communicator then
fails, naming it, and a second shrink settles it. The deadline bounds it all: a
member that cannot reach agreement by then raises Timeout.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from rdmamw.channel import Channel
from rdmamw.errors import ProtocolError, RdmamwError, Timeout

MAGIC = "rdmamw-shrink-1"
#: the agreement's channels: a few small messages each way
SLOTS, SLOT_SIZE = 4, 4096


def agree(world: Any, members: list[int], failed: set[int], end: float) -> list[int]:
    """The survivors among ``members`` (world ranks), agreed with every one of them by
    ``end`` (time.monotonic()), starting from the ranks this one saw fail."""
    me, members_set, failed = world.rank, set(members), set(failed)
    chans: dict[int, Channel] = {}
    try:
        for r in sorted(members_set - failed - {me}):
            try:
                chans[r] = Channel.open(r, timeout=_left(end), world=world,
                                        slots=SLOTS, slot_size=SLOT_SIZE, rendezvous="off")
            except RdmamwError:
                failed.add(r)
        for rnd in range(1, len(members) + 2):
            mine = sorted(failed)
            sent = msgpack.packb([MAGIC, rnd, mine])
            peers = [r for r in sorted(chans) if r not in failed]
            for r in peers:
                try:
                    chans[r].send(sent, timeout=_left(end))
                except RdmamwError:
                    failed.add(r)
            theirs = []
            for r in peers:
                if r in failed:
                    continue
                got = _take(chans[r], rnd, members_set, end, r)
                if got is None:
                    failed.add(r)
                else:
                    theirs.append(got)
            if sorted(failed) == mine and all(t == mine for t in theirs):
                return sorted(members_set - failed)
            for t in theirs:
                failed.update(t)
            failed.discard(me)
        raise RdmamwError(f"shrink: no agreement after {len(members) + 1} rounds")
    finally:
        for ch in chans.values():
            ch.close()


def _take(ch: Channel, rnd: int, members: set[int], end: float,
          peer: int) -> list[int] | None:
    """The peer's set of round ``rnd`` (None: it failed). A peer cannot be a round
    ahead: it needs ours of this round to finish it, and sent its own first."""
    while True:
        try:
            m = ch.recv(timeout=_left(end))
        except Timeout:
            if time.monotonic() >= end:
                raise Timeout(f"shrink: rank {peer} said nothing by the deadline") from None
            return None
        except RdmamwError:
            return None
        try:
            got = _parse(bytes(m), members)
        finally:
            m.release()
        if got[0] != rnd:
            raise ProtocolError(f"shrink: rank {peer} sent round {got[0]} in round {rnd}")
        return got[1]


def _parse(raw: bytes, members: set[int]) -> tuple[int, list[int]]:
    """A peer's ``(round, failed)``, each field read once and checked."""
    try:
        magic, rnd, failed = msgpack.unpackb(raw)
    except Exception as e:  # noqa: BLE001 - anything malformed is the same error
        raise ProtocolError(f"shrink: a malformed message ({len(raw)} bytes)") from e
    if magic != MAGIC or type(rnd) is not int or type(failed) is not list or not all(
            type(r) is int and r in members for r in failed):
        raise ProtocolError(f"shrink: a malformed message {raw!r:.80}")
    return rnd, sorted(failed)


def _left(end: float) -> float:
    return max(1e-3, end - time.monotonic())

