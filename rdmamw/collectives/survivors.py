"""Going on without a lost rank: the survivors agree on who they are and get a
communicator of their own (as ULFM's ``MPIX_Comm_shrink``, NCCL's ``ncclCommShrink``).

Every survivor calls :meth:`Communicator.shrink` on the broken communicator, which
runs :func:`agree`. Members start from different sets of failed ranks: each from the
ranks *it* saw fail, and a rank that fell behind (or a neighbour that waited on one)
may be suspected by some members only. So:

* each member opens a small channel to *every* other member at once (a thread per
  peer: a peer that never answers, dead, stopped, or one that suspects us and opens
  nothing, holds up only its own channel, never the others);
* it sends each its set of failed ranks whenever that set grows, and takes the union
  of every set it receives. A member that receives a set naming itself has been
  counted out: it raises :class:`~rdmamw.errors.Excluded` at once rather than wait
  (a suspicion is never dropped, so every member excludes the same ranks);
* the *coordinator*, the smallest world rank nobody counts as failed, decides once
  every other member it counts alive has sent it the very set it holds: it sends
  DECIDED with that set to every channel, and every member that receives a DECIDED
  passes it on to its own channels before it returns, so one member that got it is
  enough. A member that has sent nothing by :data:`PATIENCE` of the time is counted
  as failed (it is stopped, or too far behind: the coordinator too); a coordinator
  that fails is replaced by the next smallest;
* before it returns, a member waits (by the deadline) for its channels to the other
  survivors to open, so that no late open of this agreement can pair with a channel
  the new communicator opens.

Every survivor decides the set of one coordinator. A coordinator that dies while
its DECIDED goes out can leave a member that saw no copy of it to decide with the
next one (it then counts the dead one out too): the next collective on the new
communicator fails, naming it, and a second shrink settles it. The deadline bounds
it all: a member that cannot reach agreement by then raises Timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack

from rdmamw.channel import Channel
from rdmamw.errors import ChannelClosed, Excluded, PeerLost, ProtocolError, RdmamwError, Timeout

MAGIC = "rdmamw-shrink-2"
SET, DECIDED = 0, 1
#: the agreement's channels: a few small messages each way
SLOTS, SLOT_SIZE = 16, 4096
#: the part of the time a coordinator waits for every member it counts alive to send
#: its set; who has not by then is counted as failed
PATIENCE = 0.5
#: how long the loop sleeps when nothing happened (doubling from POLL_MIN)
POLL_MIN, POLL_MAX = 0.0005, 0.01


class _Opener(threading.Thread):
    """Opens the agreement's channel to one peer by ``end``; a channel that opens
    after :meth:`drop` is closed at once."""

    def __init__(self, world: Any, peer: int, end: float) -> None:
        super().__init__(name=f"rdmamw-shrink-open-{peer}", daemon=True)
        self.world, self.peer, self.end = world, peer, end
        self.channel: Channel | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._dropped = False
        self.start()

    def run(self) -> None:
        try:
            ch = Channel.open(self.peer, timeout=max(1e-3, self.end - time.monotonic()),
                              world=self.world, slots=SLOTS, slot_size=SLOT_SIZE,
                              rendezvous="off")
        except BaseException as e:  # noqa: BLE001 - the agreement reads it
            self.error = e
            return
        with self._lock:
            if not self._dropped:
                self.channel = ch
                return
        ch.close()

    def take(self) -> Channel | None:
        with self._lock:
            return self.channel

    def drop(self) -> Channel | None:
        """No more use for the channel: it, if open (the caller closes it)."""
        with self._lock:
            self._dropped = True
            ch, self.channel = self.channel, None
            return ch


class _Agreement:
    """One member's side of :func:`agree`."""

    def __init__(self, world: Any, members: list[int], failed: set[int], end: float) -> None:
        self.me, self.members, self.end = world.rank, set(members), end
        self.start = time.monotonic()
        self.failed = (set(failed) & self.members) - {self.me}
        self.openers = {r: _Opener(world, r, end) for r in sorted(self.members - {self.me})}
        self.chans: dict[int, Channel] = {}
        self.sent: dict[int, frozenset[int]] = {}       # the set each peer last got
        self.heard: dict[int, frozenset[int]] = {}      # the set each peer last sent

    def alive(self) -> set[int]:
        return self.members - self.failed

    def run(self) -> list[int]:
        pause = POLL_MIN
        while True:
            busy = self._connect()
            self._tell()
            decided = self._take()
            if decided is None:
                decided = self._decide()
            if decided is not None:
                self._await_survivors(decided)
                return sorted(self.members - decided)
            if time.monotonic() >= self.end:
                waiting = sorted(r for r in self.alive() - {self.me}
                                 if self.heard.get(r) != frozenset(self.failed))
                raise Timeout(f"shrink: no agreement by the deadline (failed: "
                              f"{sorted(self.failed)}; waiting for ranks {waiting})")
            pause = POLL_MIN if busy else min(POLL_MAX, pause * 2)
            time.sleep(pause)

    def _connect(self) -> bool:
        """Take the channels that opened; a peer whose open failed has failed."""
        new = False
        for r, op in self.openers.items():
            if r in self.chans:
                continue
            ch = op.take()
            if ch is not None:
                self.chans[r], new = ch, True
            elif op.error is not None and r not in self.failed and not op.is_alive():
                self.failed.add(r)
                new = True
        return new

    def _tell(self) -> None:
        """Our set to every channel that has not got it (a suspect too: so it learns)."""
        mine = frozenset(self.failed)
        msg = None
        for r, ch in list(self.chans.items()):
            if self.sent.get(r) == mine:
                continue
            msg = msg or msgpack.packb([MAGIC, SET, sorted(mine)])
            try:
                ch.send(msg, timeout=0)
            except Timeout as e:
                if not e.sent:
                    continue            # its ring is full: again next turn
            except RdmamwError:
                self.failed.add(r)
                continue
            self.sent[r] = mine

    def _take(self) -> frozenset[int] | None:
        """What arrived: sets (their union is ours), a DECIDED (returned, after it was
        passed on). Excluded if one names this rank."""
        for r, ch in list(self.chans.items()):
            try:
                got = ch.recv_batch(16, timeout=0)
            except (ChannelClosed, PeerLost, ProtocolError):
                self.failed.add(r)      # (a member that decided says so before it closes)
                del self.chans[r]
                continue
            except Timeout:
                continue
            for m in got:
                try:
                    kind, theirs = _parse(bytes(m), self.members)
                finally:
                    m.release()
                if self.me in theirs:
                    raise Excluded(f"shrink: rank {r} counts this rank ({self.me}) as "
                                   f"failed (ranks {sorted(theirs)}): it is not among the "
                                   f"survivors")
                if kind == DECIDED:
                    self._pass_on(theirs, r)
                    return theirs
                self.heard[r] = theirs
                self.failed |= theirs
        return None

    def _decide(self) -> frozenset[int] | None:
        """As the coordinator: the set, once every member alive sent it. Past PATIENCE
        (every member) the members alive that sent nothing are counted as failed first
        (the coordinator too: the others would wait for it)."""
        alive = self.alive()
        if time.monotonic() - self.start > PATIENCE * (self.end - self.start):
            late = {r for r in alive - {self.me} if r not in self.heard}
            if late:
                self.failed |= late
                return None             # (told first, decided in a later turn)
        if min(alive) != self.me:
            return None
        mine = frozenset(self.failed)
        if all(self.heard.get(r) == mine for r in alive - {self.me}):
            self._pass_on(mine, None)
            return mine
        return None

    def _pass_on(self, decided: frozenset[int], frm: int | None) -> None:
        msg = msgpack.packb([MAGIC, DECIDED, sorted(decided)])
        for r, ch in self.chans.items():
            if r != frm:
                try:
                    ch.send(msg, timeout=0)
                except RdmamwError:
                    pass

    def _await_survivors(self, decided: frozenset[int]) -> None:
        """The channels to the other survivors open (by the deadline), so that none
        of this agreement's opens is left to pair with the new communicator's."""
        for r, op in self.openers.items():
            if r not in decided and r not in self.chans:
                op.join(max(0.0, self.end - time.monotonic()))

    def close(self) -> None:
        """Close every channel (on a thread: a tcp close may wait for the peer) and
        drop the opens still under way."""
        chans = list(self.chans.values())
        for op in self.openers.values():
            ch = op.drop()
            if ch is not None and ch not in chans:
                chans.append(ch)
        self.chans.clear()

        def close_all() -> None:
            for ch in chans:
                ch.close()
        threading.Thread(target=close_all, name="rdmamw-shrink-close", daemon=True).start()


def agree(world: Any, members: list[int], failed: set[int], end: float) -> list[int]:
    """The survivors among ``members`` (world ranks), agreed with every one of them by
    ``end`` (time.monotonic()), starting from the ranks this one saw fail. Excluded if
    the others count this rank as failed; Timeout if no agreement came by ``end``."""
    a = _Agreement(world, members, failed, end)
    try:
        return a.run()
    finally:
        a.close()


def _parse(raw: bytes, members: set[int]) -> tuple[int, frozenset[int]]:
    """A peer's ``(kind, failed)``, each field read once and checked."""
    try:
        magic, kind, failed = msgpack.unpackb(raw)
    except Exception as e:  # noqa: BLE001 - anything malformed is the same error
        raise ProtocolError(f"shrink: a malformed message ({len(raw)} bytes)") from e
    if magic != MAGIC or type(kind) is not int or kind not in (SET, DECIDED) \
            or type(failed) is not list \
            or not all(type(r) is int and r in members for r in failed):
        raise ProtocolError(f"shrink: a malformed message {raw!r:.80}")
    return kind, frozenset(failed)
