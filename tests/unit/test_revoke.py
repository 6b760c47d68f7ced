"""The revoke notice (rdmamw/collectives/revoke.py): a round trip, and whatever a
hostile peer writes is data, a checked notice, or ProtocolError, never anything else."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdmamw.collectives import revoke
from rdmamw.errors import PeerLost, ProtocolError, Timeout


@pytest.mark.parametrize("kind", [revoke.LOST, revoke.NO_PROGRESS, revoke.WAITING,
                                  revoke.LEFT])
def test_a_notice_round_trips(kind):
    buf = revoke.notice(kind, 3, 1, 77)
    assert len(buf) == revoke.NOTICE_LEN
    assert revoke.parse(buf, 4) == (kind, 3, 1, 77)
    assert revoke.parse(memoryview(bytearray(buf)), 4) == (kind, 3, 1, 77)


def test_the_errors_name_the_rank_and_who_saw_it():
    lost = revoke.error((revoke.LOST, 2, 3, 9), me=0, timeout=5.0)
    assert isinstance(lost, PeerLost) and lost.rank == 2
    assert str(lost) == "collective #9: rank 2 was lost (rank 3 saw it)"
    late = revoke.error((revoke.NO_PROGRESS, 2, 0, 9), me=0, timeout=5.0)
    assert isinstance(late, Timeout) and late.rank == 2
    assert str(late) == ("collective #9: rank 2 made no progress within the 5 s deadline "
                         "(this rank saw it)")
    left = revoke.error((revoke.LEFT, 1, 1, 9), me=0, timeout=5.0)
    assert isinstance(left, PeerLost) and left.rank == 1
    assert str(left) == "rank 1 closed the communicator (after collective #9)"


def test_a_goodbye_names_the_rank_that_left_and_only_a_goodbye_does():
    class Msg(bytes):
        released = False

        def release(self):
            self.released = True
    bye = Msg(revoke.notice(revoke.LEFT, 2, 2, 5))
    assert revoke.left(bye, 4) == 2 and bye.released
    for other in (revoke.notice(revoke.LOST, 2, 1, 5), b"data", revoke.MAGIC + b"\xff" * 48):
        assert revoke.left(Msg(other), 4) is None


@pytest.mark.parametrize("fields", [(4, 1, 1), (0, 4, 1), (0, 1, 4), (0, -1, 1),
                                    (1, 0, -5), (255, 0, 0)])
def test_a_notice_whose_fields_are_not_the_jobs_is_a_protocol_error(fields):
    kind, culprit, reporter = fields
    buf = revoke._FIELDS.pack(revoke.MAGIC, kind, culprit, reporter, 0).ljust(64, b"\0")
    with pytest.raises(ProtocolError, match="malformed revoke notice"):
        revoke.parse(buf, 4)


@given(st.binary(max_size=200))
def test_any_bytes_are_data_or_a_checked_notice(data):
    try:
        info = revoke.parse(data, 8)
    except ProtocolError:
        assert data.startswith(revoke.MAGIC) and len(data) == revoke.NOTICE_LEN
        return
    if info is not None:
        kind, culprit, reporter, _ = info
        assert kind in (revoke.LOST, revoke.NO_PROGRESS, revoke.WAITING, revoke.LEFT)
        assert 0 <= culprit < 8 and 0 <= reporter < 8


@given(st.binary(min_size=48, max_size=48))
def test_any_tail_behind_the_magic_is_checked(tail):
    data = revoke.MAGIC + tail
    try:
        info = revoke.parse(data, 8)
    except ProtocolError:
        return
    assert info is not None and 0 <= info[1] < 8 and 0 <= info[2] < 8


class _Ch:
    """A channel whose sends fill up: what send_all does with a full ring."""

    def __init__(self, room: int) -> None:
        self.room, self.got = room, []

    def send_batch(self, msgs, timeout=None):
        if self.room == 0:
            raise Timeout("ring full", sent=0)
        self.room -= 1
        self.got += msgs


def test_send_all_never_waits_for_a_full_ring_longer_than_its_bound():
    import time
    ok, full = _Ch(1), _Ch(0)
    t0 = time.monotonic()
    revoke.send_all([full, ok], b"n")
    assert ok.got == [b"n"] and full.got == []
    assert time.monotonic() - t0 < revoke.SEND_WAIT + 0.2


class _Comm:
    """What Waits reads of a Communicator: rank 0 of 3, in collective ``seq``, waiting
    on rank 1 while rank 2's channel holds ``msgs``."""

    def __init__(self, seq: int, msgs: list) -> None:
        import collections

        class Quiet:
            def recv_batch(self, n, timeout=None):
                return []

        class Holding:
            def recv_batch(self, n, timeout=None):
                out, msgs[:] = list(msgs), []
                return out
        self.rank, self.size, self.members, self.seq, self.timeout = 0, 3, [0, 1, 2], seq, 5.0
        self._chans = {1: Quiet(), 2: Holding()}
        self._queues = {1: collections.deque(), 2: collections.deque()}


def test_a_goodbye_after_the_running_collective_waits_for_the_next_one():
    """Rank 2 finished collective #7 and closed while this member is still in #7
    (waiting on a slower rank 1): no failure of #7; the goodbye stays queued ahead of
    nothing, and the next collective's take from rank 2 raises it, naming rank 2."""
    from rdmamw.collectives.waits import Waits
    data, bye = b"x" * 64, revoke.notice(revoke.LEFT, 2, 2, 7)
    comm = _Comm(7, [data, bye])
    w = Waits(comm)
    w.watch(1)
    assert list(comm._queues[2]) == [data, bye]
    comm.seq = 8                                    # the next collective takes them
    assert w.notice(comm._queues[2][0], 2) is False
    with pytest.raises(PeerLost, match=r"rank 2 closed the communicator \(after "
                                       r"collective #7\)") as e:
        w.notice(comm._queues[2][1], 2)
    assert e.value.rank == 2


@pytest.mark.parametrize("done", [5, 6])
def test_a_goodbye_before_the_end_of_the_running_collective_fails_it(done):
    """A rank that left before it finished #7 (or a later member's look): raised."""
    from rdmamw.collectives.waits import Waits
    comm = _Comm(7, [revoke.notice(revoke.LEFT, 2, 2, done)])
    with pytest.raises(PeerLost, match="rank 2 closed") as e:
        Waits(comm).watch(1)
    assert e.value.rank == 2 and not comm._queues[2]


class _Silent:
    """The channel to a rank that says nothing, or its ``answer`` ``at`` s after the
    first look."""

    def __init__(self, answer: bytes | None = None, at: float = 0.0) -> None:
        self.first, self.answer, self.at = None, answer, at

    def recv_batch(self, n, timeout=None):
        self.first = self.first or time.monotonic()
        if self.answer is not None and time.monotonic() - self.first >= self.at:
            class M(bytes):
                def release(self):
                    pass
            return [M(self.answer)]
        time.sleep(min(timeout, 0.005))
        raise Timeout("nothing")


def test_a_silent_rank_seen_stopped_is_named_after_one_grace():
    asked = []
    t0 = time.monotonic()
    got = revoke.wait_for(_Silent(), 4, 0.02, stopped=lambda: asked.append(1) or True)
    assert got is None and asked == [1] and time.monotonic() - t0 < 1.0


def test_a_silent_rank_seen_running_gets_more_graces_up_to_the_bound():
    asked = []
    got = revoke.wait_for(_Silent(), 4, 0.01, stopped=lambda: asked.append(1) or False)
    assert got is None and len(asked) == revoke.MAX_GRACES - 1


def test_a_slow_rank_that_answers_in_its_extra_grace_names_the_culprit():
    """A rank starved of CPU answers after its grace: its answer, not its silence."""
    final = revoke.notice(revoke.NO_PROGRESS, 3, 1, 4)
    got = revoke.wait_for(_Silent(final, at=0.5), 4, 0.1, stopped=lambda: False)
    assert got == (revoke.NO_PROGRESS, 3, 1, 4)
    # where nothing tells (another host), its silence after the grace names it
    assert revoke.wait_for(_Silent(final, at=0.5), 4, 0.1, stopped=lambda: None) is None


# ---- the shrink's agreement messages (rdmamw/collectives/survivors.py) ------------------

def test_a_shrink_message_round_trips_and_a_hostile_one_is_a_protocol_error():
    import msgpack

    from rdmamw.collectives import survivors as shrink
    members = {0, 1, 3}
    assert shrink._parse(msgpack.packb([shrink.MAGIC, shrink.SET, [3, 1], [[0, 120]]]),
                         members) == (shrink.SET, {1, 3}, [(0, 120)])
    assert shrink._parse(msgpack.packb([shrink.MAGIC, shrink.DECIDED, [], []]),
                         members) == (shrink.DECIDED, set(), [])
    for bad in ([shrink.MAGIC, shrink.SET, [2], []], [shrink.MAGIC, "0", [], []],
                ["other", 1, [], []], [shrink.MAGIC, 1, [True], []],
                [shrink.MAGIC, 1, 5, []], [shrink.MAGIC, 1, []], [shrink.MAGIC, 2, [], []],
                [shrink.MAGIC, True, [], []], [shrink.MAGIC, 0, [], [[2, 0]]],
                [shrink.MAGIC, 0, [], 1], [shrink.MAGIC, 0, [], [None]],
                [shrink.MAGIC, 0, [], [0]], [shrink.MAGIC, 0, [], [[0, -1]]],
                [shrink.MAGIC, 0, [], [[0, 1.5]]], [shrink.MAGIC, 0, [], [[0, 1, 2]]]):
        with pytest.raises(ProtocolError, match="shrink: a malformed message"):
            shrink._parse(msgpack.packb(bad), members)


@given(st.binary(max_size=100))
def test_any_bytes_as_a_shrink_message_parse_or_are_a_protocol_error(data):
    from rdmamw.collectives import survivors as shrink
    try:
        kind, failed, linked = shrink._parse(data, {0, 1, 2})
    except ProtocolError:
        return
    assert kind in (shrink.SET, shrink.DECIDED) and failed <= {0, 1, 2}
    assert all(q in {0, 1, 2} and ms >= 0 for q, ms in linked)
