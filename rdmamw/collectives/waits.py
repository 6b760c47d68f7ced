"""A collective's waits: its deadline, the watch over every channel while it waits on
one, and what a failure on a channel means (the rank it names). One per
:class:`~rdmamw.collectives.comm.Communicator`, which owns the channels; this owns the
deadline and the WAITING state of rdmamw.collectives.revoke.

Why the watch: a rank blocked on a healthy neighbour (that neighbour waits in turn) is
told of a failure on *another* of its channels: a revoke notice lands in that
channel's ring, not in the one it waits on. A wait (a receive, a handle's, or a send
that waits for room in a full ring: its peer stopped, or blocked in turn) is
therefore cut in slices of :data:`WATCH` (a send goes on with what its slice left,
``Timeout.sent``); between slices every other channel's arrivals are taken (data goes to
the communicator's per-peer queue, where the collective takes it in order as it
would have from the channel), so a final notice is raised within a slice of its
arrival and a WAITING one is answered at once. Waits that end within a slice (all of
them while nothing fails) cost nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rdmamw import _host, observe
from rdmamw.channel import Channel, Message
from rdmamw.collectives import revoke
from rdmamw.errors import ChannelClosed, PeerLost, ProtocolError, RdmamwError, Timeout

log = logging.getLogger("rdmamw.collectives")
#: a wait longer than this warns halfway that the rank it waits for makes no progress
WARN_AFTER = 2.0
#: seconds a wait runs before it looks at the other channels (a notice's hop)
WATCH = 0.1
#: batches taken from another channel per look (a ring's worth of small messages)
WATCH_BATCHES = 16

#: the channel operations a schedule (rdmamw/steps.py) yields as ``(kind, peer, arg)``;
#: the driver sends back: SEND (arg: messages) the send's handle (slots taken, maybe not
#: done), RECV the next messages (a list of one), INTO (arg: a buffer) the bytes received
#: into it, WAIT (arg: a handle) None once it is done. A failure is thrown into it.
SEND, RECV, INTO, WAIT = range(4)


class Waits:
    """The deadline of the collective running on ``comm`` (a Communicator: its
    channels, queues, rank, size, seq and timeout are read here) and the waits it
    makes."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        #: time.monotonic() deadline of the collective running now (0: none runs)
        self.deadline = 0.0
        #: the running collective's timeout (what its errors and graces are made of)
        self.timeout = comm.timeout
        self.said_waiting = -1          # the collective we said WAITING in
        #: peer -> the collective it said WAITING in (it is alive, and waits in turn)
        self.waiting: dict[int, int] = {}

    def left(self) -> float:
        """Seconds to the running collective's deadline (``timeout`` outside one)."""
        if not self.deadline:
            t: float = self.comm.timeout
            return t
        return max(1e-3, self.deadline - time.monotonic())

    def begin(self, timeout: float | None) -> None:
        """Start one collective's deadline (``timeout`` or the communicator's)."""
        t = self.comm.timeout if timeout is None else timeout
        if not t > 0:
            raise ValueError(f"timeout must be > 0 seconds, not {timeout!r}")
        self.deadline = time.monotonic() + t
        self.timeout = t

    def now(self, kind: int, peer: int, arg: Any) -> Any:
        """Perform one step with a blocking call, by the collective's deadline, watching
        the other channels while it waits (:data:`WATCH`; a wait past WARN_AFTER warns
        halfway); a failure names the rank that failed (:meth:`failure`). While a
        timeline is recorded (rdmamw.trace), each step is a span of it."""
        tr = observe.tracer
        if tr is None:
            return self._now(kind, peer, arg)
        t0 = tr.clock()
        out = self._now(kind, peer, arg)
        tr.step(kind, self.comm.members[peer], arg, out, self.comm.seq, t0)
        return out

    def _now(self, kind: int, peer: int, arg: Any) -> Any:
        try:
            ch = self.comm._chans[peer]
            t = self.left()
            if kind == SEND:
                try:
                    return ch.send_batch(arg, timeout=t if t < WATCH else WATCH)
                except Timeout as e:
                    if t <= WATCH:
                        raise
                    return self._watched(_Sending(ch, arg[e.sent:]), peer, t)
            try:
                return _wait(ch, kind, arg, t if t < WATCH else WATCH)
            except Timeout:
                if t <= WATCH:
                    raise
            return self._watched(lambda s: _wait(ch, kind, arg, s), peer, t)
        except RdmamwError as e:
            raise self.failure(e, peer) from e

    def _watched(self, wait: Callable[[float], Any], peer: int, t: float) -> Any:
        """The rest of a wait of ``t`` s on ``peer`` that outlasted its first slice:
        ``wait(s)`` (a slice of ``s`` s: Timeout if it did not end) until it ends."""
        warn = t / 2 if t > WARN_AFTER else None
        started = self.deadline - t
        me = threading.get_ident()
        observe.waits[me] = (self.comm.members[peer], started)    # (health answers)
        try:
            while True:
                self.watch(peer)
                now = time.monotonic()
                if warn is not None and now - started >= warn:
                    log.warning("collective #%d: rank %d has made no progress for %.1f s "
                                "(rank %d waits for it)", self.comm.seq, peer, warn,
                                self.comm.rank)
                    warn = None
                left = self.deadline - now
                if left <= 0:
                    raise Timeout(f"no progress in {t:g} s")
                try:
                    return wait(min(left, WATCH))
                except Timeout:
                    if left <= WATCH:
                        raise
        finally:
            observe.waits.pop(me, None)

    def watch(self, peer: int) -> None:
        """Take what arrived on every channel but ``peer``'s: data into its queue, a
        WAITING notice answered, a final one raised (naming the rank it names). A
        channel whose peer is gone is left alone: its close is seen when the collective
        waits on it (a revoke's notice is delivered before the close)."""
        comm = self.comm
        for p, c in comm._chans.items():
            if p == peer:
                continue
            q = comm._queues[p]
            for _ in range(WATCH_BATCHES):
                try:
                    got = c.recv_batch(64, timeout=0)
                except (Timeout, ChannelClosed, PeerLost):
                    break       # (Timeout: a rendezvous READ in flight, finished later)
                if not got:
                    break
                for i, m in enumerate(got):
                    try:
                        if len(m) == revoke.NOTICE_LEN and self.notice(m, p, peer, True):
                            continue        # a WAITING one, taken
                    except RdmamwError:
                        q.extend(got[i + 1:])   # (released with the queue, at the close)
                        raise
                    q.append(m)

    def failure(self, e: BaseException, peer: int) -> BaseException:
        """What a step's failure on the channel to ``peer`` means for the collective:
        a notice found behind the peer's close names the rank that failed; else the
        peer itself was lost (PeerLost), left (ChannelClosed) or made no progress by
        the deadline (Timeout), with ``.rank`` set."""
        comm = self.comm
        if isinstance(e, Timeout) and getattr(e, "rank", None) is None:
            ch = comm._chans.get(peer)
            # say whom we wait for, then give it the grace to say whom it waits for
            self.say_waiting(peer)
            try:
                info = revoke.wait_for(ch, comm.size, min(revoke.GRACE, self.timeout / 10),
                                       self.waiting.get(peer) == comm.seq,
                                       lambda: self.watch(peer), WATCH,
                                       lambda: self.stopped(peer)) \
                    if ch is not None else None
            except RdmamwError as found:    # a notice on another channel names the rank
                return found
            if info is not None:
                return revoke.error(info, comm.rank, self.timeout)
            late = Timeout(f"collective #{comm.seq}: rank {peer} made no progress within "
                           f"the {self.timeout:g} s deadline (rank {comm.rank} waited for "
                           f"it)")
            late.rank = peer
            return late
        if isinstance(e, (PeerLost, ChannelClosed)) and getattr(e, "rank", None) is None:
            ch = comm._chans.get(peer)
            info = revoke.find(comm._queues.get(peer, ()), ch, comm.size) if ch else None
            if info is not None:
                return revoke.error(info, comm.rank, self.timeout)
            named = PeerLost(f"rank {peer}: {e}")
            named.rank = peer
            return named
        return e

    def stopped(self, peer: int) -> bool | None:
        """Whether ``peer``'s process is stopped (None: cannot tell from here)."""
        peers = self.comm.world.peers
        return _host.stopped(peers.get(self.comm.world.rank, {}),
                             peers.get(self.comm.members[peer], {}))

    def notice(self, buf: Any, peer: int, waits_for: int | None = None,
               watching: bool = False) -> bool:
        """Whether ``buf`` (from ``peer``) is a WAITING notice: a member past its
        deadline says whom it waits for; taken, and passed on once per collective
        (naming ``waits_for``, the rank we wait for, default ``peer``: who waits for us
        gives us time to name the culprit). Raise what a final one says; False for
        data. A notice that is a Message is released. ``watching`` (a look at a channel
        we do not wait on): a goodbye from a rank that finished the running collective
        is no failure of it (a slower member is still in it): False, kept queued, it
        is raised when the next collective takes from that rank."""
        comm = self.comm
        try:
            info = revoke.parse(buf, comm.size)
        except ProtocolError:
            if isinstance(buf, Message):
                buf.release()
            raise
        if info is None or (watching and info[0] == revoke.LEFT and info[3] >= comm.seq):
            return False
        if isinstance(buf, Message):
            buf.release()
        if info[0] == revoke.WAITING:
            self.waiting[peer] = comm.seq
            self.say_waiting(peer if waits_for is None else waits_for)
            return True
        raise revoke.error(info, comm.rank, self.timeout)

    def say_waiting(self, peer: int) -> None:
        """Tell every channel that we wait for ``peer`` (once per collective): ``peer``
        too, in one try (it may be the one that stopped, its ring full), so that if it
        is alive but waits in turn it says so (:meth:`watch`) and we give it time."""
        comm = self.comm
        if self.said_waiting != comm.seq:
            self.said_waiting = comm.seq
            buf = revoke.notice(revoke.WAITING, peer, comm.rank, comm.seq)
            revoke.send_all([c for p, c in comm._chans.items() if p != peer], buf)
            ch = comm._chans.get(peer)
            if ch is not None:
                try:
                    ch.send_batch([buf], timeout=0)
                except RdmamwError:
                    pass


class _Sending:
    """A send's messages not yet accepted, sent a slice at a time (a slice's Timeout
    says how many went: the rest goes next). Its result is the last part's handle,
    which covers the earlier parts: a channel's sends complete in order (a handle is
    done once the transport completed its chain or a later one and the receiver
    returned the done bits up to its last rendezvous message, both counted in order)."""

    __slots__ = ("ch", "msgs")

    def __init__(self, ch: Channel, msgs: Any) -> None:
        self.ch, self.msgs = ch, msgs

    def __call__(self, t: float) -> Any:
        try:
            return self.ch.send_batch(self.msgs, timeout=t)
        except Timeout as e:
            self.msgs = self.msgs[e.sent:]
            raise


def _wait(ch: Channel, kind: int, arg: Any, t: float) -> Any:
    if kind == RECV:
        got = ch.recv_batch(1, timeout=t)
        if not got:
            raise Timeout(f"nothing arrived in {t:g} s")
        return got
    if kind == INTO:
        return ch.recv_into(arg, timeout=t)
    return arg.wait(t)
