"""Revoking a communicator: one member's failure reaches every member, named.

A member that sees a peer lost, or waits for one past the collective's deadline, sends
a *notice* on each of its channels before it closes them: the rank that failed and
how (lost, or no progress). A member that receives a notice (in place of the data it
waited for), or finds one behind the close of the channel it waited on, raises the
same error naming the same rank, and passes the notice on to its own channels in turn.
Every member is linked to the others through the channels collectives opened (the
header round's dissemination peers at least), so the notice reaches all of them
within a few hops, whether or not they talked to the failed rank (as ULFM's
``MPIX_Comm_revoke`` and NCCL's abort do).

A rank that stopped (SIGSTOP, a debugger) makes no progress but is not lost; every
member waiting on it, directly or through others, reaches its deadline at about the
same moment. To name the stopped rank rather than a neighbour that waits too, a member
at its deadline first says *whom it waits for* (a WAITING notice) on its channels, then
gives the rank it waited for :data:`GRACE` seconds to answer: a WAITING notice from it
means it is alive and waits in turn (then twice the grace from then on, up to
:data:`MAX_GRACES` times: its own grace runs first), a final notice names the
culprit, silence names the rank it waited for. A member that receives a WAITING notice
from the rank it waits for says WAITING in turn, before its own deadline, so that who
waits for it extends its grace too.

A member that closes the communicator says goodbye with a LEFT notice naming itself
and the last collective it finished: a member entering a later collective (or in one
the leaver had not finished) takes it as it takes any final notice, and raises
``PeerLost`` naming the rank that left, not a protocol error on a message "where a
header was due". A member still in the collective the leaver finished goes on (the
leaver's part of it is done): it meets the goodbye when it next takes from that rank.

A notice is a message of :data:`NOTICE_LEN` bytes that starts with :data:`MAGIC`; its
fields are read once into locals and checked (a rank of the job) before they are used.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

from rdmamw.errors import ChannelClosed, PeerLost, ProtocolError, RdmamwError, Timeout

MAGIC = b"rdmamw-revoke-1\0"
_FIELDS = struct.Struct("<16sBxxxiiQ")      # magic, kind, culprit, reporter, collective
NOTICE_LEN = 64
LOST, NO_PROGRESS, WAITING, LEFT = 0, 1, 2, 3
#: how long a notice's send may wait for room in a full ring (the peer it goes to may
#: be the one that failed: it must not hold the revoke up)
SEND_WAIT = 0.5
#: messages looked through for a notice behind a peer's close (a ring's worth)
DRAIN_MAX = 4096
#: past its deadline, how long a member waits for the peer it waited on to say whom it
#: waits for (at most a tenth of the deadline), and how many times in a row
GRACE = 1.0
MAX_GRACES = 8


def notice(kind: int, culprit: int, reporter: int, seq: int) -> bytes:
    return _FIELDS.pack(MAGIC, kind, culprit, reporter, seq).ljust(NOTICE_LEN, b"\0")


def parse(buf: Any, size: int) -> tuple[int, int, int, int] | None:
    """``(kind, culprit, reporter, seq)`` if ``buf`` is a notice, else None;
    ProtocolError for a notice whose fields are not a job's."""
    mv = memoryview(buf)
    if mv.nbytes != NOTICE_LEN or mv[:16].tobytes() != MAGIC:
        return None
    _, kind, culprit, reporter, seq = _FIELDS.unpack(mv[:_FIELDS.size].tobytes())
    if kind not in (LOST, NO_PROGRESS, WAITING, LEFT) or not (
            0 <= culprit < size and 0 <= reporter < size):
        raise ProtocolError(f"a malformed revoke notice (kind {kind}, rank {culprit}, "
                            f"reporter {reporter})")
    return kind, culprit, reporter, seq


def error(info: tuple[int, int, int, int], me: int, timeout: float) -> RdmamwError:
    """The error a notice means, naming the rank that failed."""
    kind, culprit, reporter, seq = info
    seen = f"rank {reporter} saw it" if reporter != me else "this rank saw it"
    if kind == NO_PROGRESS:
        e: RdmamwError = Timeout(f"collective #{seq}: rank {culprit} made no progress "
                                 f"within the {timeout:g} s deadline ({seen})")
    elif kind == LEFT and reporter == culprit:
        e = PeerLost(f"rank {culprit} closed the communicator (after collective #{seq})")
    else:
        e = PeerLost(f"collective #{seq}: rank {culprit} was lost ({seen})")
    e.rank, e.reporter = culprit, reporter      # type: ignore[attr-defined]
    return e


def send_all(channels: Iterable[Any], payload: bytes) -> None:
    """The notice on each channel, all of them tried in turn without waiting, again
    while a ring is full, for SEND_WAIT in all (best effort: a member whose channel
    stays full or is gone learns from the close, or from another member)."""
    pending, end = list(channels), time.monotonic() + SEND_WAIT
    while pending:
        full = []
        for ch in pending:
            try:
                ch.send_batch([payload], timeout=0)
            except Timeout as e:
                if not e.sent:
                    full.append(ch)
            except RdmamwError:
                pass
        if not full or time.monotonic() >= end:
            return
        pending = full
        time.sleep(0.001)


def find(queued: Any, ch: Any, size: int) -> tuple[int, int, int, int] | None:
    """A notice among the messages already taken from a peer (``queued``) or left in
    its channel behind its close; each message looked at is released."""
    found = None
    while queued:
        found = found or _final(_taken(queued.popleft(), size))
    for _ in range(DRAIN_MAX):
        try:
            got = ch.recv_batch(64, timeout=0)
        except (ChannelClosed, PeerLost, Timeout, ProtocolError):
            break
        if not got:
            break
        for m in got:
            found = found or _final(_taken(m, size))
    return found


def _final(info: tuple[int, int, int, int] | None) -> tuple[int, int, int, int] | None:
    return None if info is None or info[0] == WAITING else info


def wait_for(ch: Any, size: int, grace: float, waiting: bool = False,
             look: Callable[[], None] | None = None, every: float = 0.1,
             stopped: Callable[[], bool | None] | None = None
             ) -> tuple[int, int, int, int] | None:
    """A final notice from ``ch`` (the rank this member waited for when its deadline
    came), given ``grace`` seconds, twice that after each WAITING notice from it (up
    to MAX_GRACES; ``waiting``: it said WAITING already); None: it said nothing (it is
    the one that made no progress). Messages that are not notices are dropped: the
    collective has failed. ``look``, called every ``every`` s, looks at the member's
    other channels (it raises what a notice found there says). ``stopped`` says
    whether that rank's process is stopped (rdmamw._host.stopped: None, cannot tell):
    one that said nothing but is seen running is slow, not frozen (a CPU starved by
    other work answers late), and gets twice the grace again, within MAX_GRACES."""
    end, graces = time.monotonic() + (2 * grace if waiting else grace), 1
    while True:
        left = end - time.monotonic()
        if left <= 0:
            if stopped is None or graces >= MAX_GRACES or stopped() is not False:
                return None
            end, graces = time.monotonic() + 2 * grace, graces + 1
            continue
        if look is not None:
            look()
            left = min(left, every)
        try:
            got = ch.recv_batch(64, timeout=left)
        except Timeout:
            continue
        except (ChannelClosed, PeerLost, ProtocolError):
            return find((), ch, size)
        for m in got:
            info = _taken(m, size)
            if info is None:
                continue
            if info[0] != WAITING:
                return info
            if graces < MAX_GRACES:      # alive, and waits in turn: its answer comes
                # after its own grace (which began as it said so) and passes on at once
                end, graces = time.monotonic() + 2 * grace, graces + 1


def left(m: Any, size: int) -> int | None:
    """The rank a LEFT notice names (its goodbye), else None; ``m`` is released."""
    info = _taken(m, size)
    return info[1] if info is not None and info[0] == LEFT else None


def _taken(m: Any, size: int) -> tuple[int, int, int, int] | None:
    try:
        return parse(m, size)
    except ProtocolError:
        return None
    finally:
        m.release()
