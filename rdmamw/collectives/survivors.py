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
* every member sends each peer its set again every :data:`PATIENCE` /
  :data:`KEEPALIVES` of the time (a keep-alive), with the ranks it heard from lately.
  A member that nobody heard from for :data:`PATIENCE` of the time, directly or
  through a member that hears it, is counted as failed (it is stopped, or never
  came); one that is slow but alive keeps saying so, and is never counted out;
* the *coordinator*, the smallest world rank nobody counts as failed, decides once
  every other member it counts alive has sent it the very set it holds: it sends
  DECIDED with that set to every channel, and every member that receives a DECIDED
  passes it on to its channels (those to survivors that open later too, before it
  returns), so one member that got it is enough; a coordinator that fails is
  replaced by the next smallest;
* a member takes no set from a member it counts as failed, and no DECIDED from one
  that a set of its own already named. A set is thus a promise: whoever sent one
  naming the coordinator will not take its decision. (A send that fails does not
  count the peer out: what it sent before it closed, a DECIDED, is read first.)
  So when a coordinator dies while its DECIDED goes out, the members that got a copy
  before they named it pass it on, the others wait for their sets (or their copies)
  and take it; if none got one, all of them count it out and the next decides:
  every survivor ends with the same members. (One that
  died after its decision went out is among them, as in ULFM: the next collective
  names it, and a second shrink drops it.)
* before it returns, a member waits (by the deadline) for its channels to the other
  survivors to open, so that no late open of this agreement can pair with a channel
  the new communicator opens.

The deadline bounds it all: a member that cannot reach agreement by then raises
Timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack

from rdmamw.channel import Channel
from rdmamw.errors import ChannelClosed, Excluded, PeerLost, ProtocolError, RdmamwError, Timeout

MAGIC = "rdmamw-shrink-3"
SET, DECIDED = 0, 1
#: the agreement's channels: a few small messages each way
SLOTS, SLOT_SIZE = 16, 4096
#: the part of the time a member may say nothing (directly, or through a member that
#: hears it) before the others count it as failed
PATIENCE = 0.5
#: keep-alives a member sends each peer within that silence (its set, again)
KEEPALIVES = 8
#: how long a decision's send to a survivor may wait for room in its ring
SEND_WAIT = 0.5
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
        #: how long a member may say nothing before it is counted as failed
        self.silence = PATIENCE * max(0.0, end - self.start)
        #: how often each peer gets our set even when it did not grow (the keep-alive)
        self.every = max(POLL_MAX, self.silence / KEEPALIVES)
        self.failed = (set(failed) & self.members) - {self.me}
        self.openers = {r: _Opener(world, r, end) for r in sorted(self.members - {self.me})}
        self.chans: dict[int, Channel] = {}
        self.sent: dict[int, frozenset[int]] = {}       # the set each peer last got
        self.told: dict[int, float] = {}                # and when
        self.heard: dict[int, frozenset[int]] = {}      # the set each peer last sent
        #: the last sign of life of each peer: a message from it, or a member that
        #: heard from it lately saying so (the agreement's start for the others)
        self.seen = {r: self.start for r in self.openers}
        self.direct: dict[int, float] = {}             # the last message from each peer
        self.gone: set[int] = set()                     # peers whose channel failed

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
            busy = self._count_silent() or busy
            pause = POLL_MIN if busy else min(POLL_MAX, pause * 2)
            time.sleep(pause)

    def _connect(self) -> bool:
        """Take the channels that opened; a peer whose open failed has failed."""
        new = False
        for r, op in self.openers.items():
            if r in self.chans or r in self.gone:
                continue
            ch = op.take()
            if ch is not None:
                self.chans[r], new = ch, True
            elif op.error is not None and r not in self.failed and not op.is_alive():
                self.failed.add(r)
                new = True
        return new

    def _tell(self) -> None:
        """Our set (and whom we hear from) to every channel that has not got it, or
        not for :attr:`every` seconds (a suspect too: so it learns)."""
        mine, now = frozenset(self.failed), time.monotonic()
        msg = None
        for r, ch in list(self.chans.items()):
            if self.sent.get(r) == mine and now - self.told.get(r, 0.0) < self.every:
                continue
            if msg is None:
                linked = sorted([q, int((now - t) * 1000)] for q, t in self.direct.items()
                                if now - t < self.silence)
                msg = msgpack.packb([MAGIC, SET, sorted(mine), linked])
            try:
                ch.send(msg, timeout=0)
            except Timeout as e:
                if not e.sent:
                    continue            # its ring is full: again next turn
            except RdmamwError:
                continue                # (what it sent before, a DECIDED, is read first)
            self.sent[r], self.told[r] = mine, now

    def _take(self) -> frozenset[int] | None:
        """What arrived: sets (their union is ours), a DECIDED (returned, after it was
        passed on). Excluded if one names this rank. A member counted as failed is
        not listened to, nor its decision taken once a set naming it went out: that
        set promised whoever got it that none would be."""
        for r, ch in list(self.chans.items()):
            try:
                got = ch.recv_batch(16, timeout=0)
            except (ChannelClosed, PeerLost, ProtocolError):
                self.failed.add(r)      # (a member that decided says so before it closes)
                del self.chans[r]
                self.gone.add(r)
                continue
            except Timeout:
                continue
            now = time.monotonic()
            for m in got:
                try:
                    kind, theirs, linked = _parse(bytes(m), self.members)
                finally:
                    m.release()
                if self.me in theirs:
                    raise Excluded(f"shrink: rank {r} counts this rank ({self.me}) as "
                                   f"failed (ranks {sorted(theirs)}): it is not among the "
                                   f"survivors")
                if r in self.failed and (kind == SET or self._promised(r)):
                    continue
                self.seen[r] = self.direct[r] = now
                for q, ms in linked:        # (heard ``ms`` before the sender wrote)
                    if q in self.seen:
                        self.seen[q] = max(self.seen[q], now - ms / 1000)
                if kind == DECIDED:
                    self._pass_on(theirs, r)
                    return theirs
                self.heard[r] = theirs
                self.failed |= theirs
        return None

    def _promised(self, r: int) -> bool:
        """Whether a set naming ``r`` went out (then a decision of its is not taken)."""
        return any(r in sent for sent in self.sent.values())

    def _count_silent(self) -> bool:
        """Count out the members nobody heard from for :attr:`silence` (stopped, or
        never came); a member slow but alive keeps saying so, directly or through
        another member that hears it."""
        now = time.monotonic()
        late = {r for r in self.alive() - {self.me} if now - self.seen[r] > self.silence}
        self.failed |= late
        return bool(late)

    def _decide(self) -> frozenset[int] | None:
        """As the coordinator (the smallest member alive): the set, once every member
        alive sent it."""
        alive = self.alive()
        if min(alive) != self.me:
            return None
        mine = frozenset(self.failed)
        if all(self.heard.get(r) == mine for r in alive - {self.me}):
            self._pass_on(mine, None)
            return mine
        return None

    def _pass_on(self, decided: frozenset[int], frm: int | None) -> None:
        """The decision to every channel but ``frm``'s: to the survivors waiting for
        room (a dropped copy could leave one deciding without it), to the others
        without (they are out)."""
        msg = msgpack.packb([MAGIC, DECIDED, sorted(decided), []])
        for r, ch in self.chans.items():
            if r != frm:
                self._send(ch, msg, r not in decided)

    def _send(self, ch: Channel, msg: bytes, wait: bool) -> None:
        left = min(SEND_WAIT, self.end - time.monotonic()) if wait else 0.0
        try:
            ch.send(msg, timeout=max(0.0, left))
        except RdmamwError:
            pass

    def _await_survivors(self, decided: frozenset[int]) -> None:
        """The channels to the other survivors open (by the deadline), each given the
        decision as it does (a survivor that did not hear it from anyone else decides
        as we did), so that none of this agreement's opens is left to pair with the
        new communicator's."""
        msg = msgpack.packb([MAGIC, DECIDED, sorted(decided), []])
        pending = {r: op for r, op in self.openers.items()
                   if r not in decided and r not in self.chans and r not in self.gone}
        while pending and time.monotonic() < self.end:
            for r, op in list(pending.items()):
                ch = op.take()
                if ch is not None:
                    self.chans[r] = ch
                    self._send(ch, msg, True)
                if ch is not None or not op.is_alive():
                    del pending[r]
            if pending:
                time.sleep(POLL_MAX)

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


def _parse(raw: bytes, members: set[int]) -> tuple[int, frozenset[int], list[tuple[int, int]]]:
    """A peer's ``(kind, failed, linked)``: ``linked`` the members it heard from
    lately, each with how many ms before; each field read once and checked."""
    try:
        magic, kind, failed, linked = msgpack.unpackb(raw)
    except Exception as e:  # noqa: BLE001 - anything malformed is the same error
        raise ProtocolError(f"shrink: a malformed message ({len(raw)} bytes)") from e
    if magic != MAGIC or type(kind) is not int or kind not in (SET, DECIDED) \
            or not _ranks(failed, members) or type(linked) is not list \
            or not all(type(e) is list and len(e) == 2 and _ranks(e[:1], members)
                       and type(e[1]) is int and 0 <= e[1] < 1 << 31 for e in linked):
        raise ProtocolError(f"shrink: a malformed message {raw!r:.80}")
    return kind, frozenset(failed), [(q, ms) for q, ms in linked]


def _ranks(v: Any, members: set[int]) -> bool:
    return type(v) is list and all(type(r) is int and r in members for r in v)
