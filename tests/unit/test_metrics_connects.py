"""Connects in the metrics (``rdmamw_connect_seconds{provider,outcome}``, docs/metrics.md):
each Channel.open and each handshake of a channel's listener counted once, by outcome,
with its time, while metrics record; nothing while they do not."""

from __future__ import annotations

import socket
import time

import pytest

import rdmamw
from rdmamw import bootstrap, observe
from rdmamw.errors import PeerNotFound, RdmamwError
from rdmamw.metrics import readings
from tests.support.helpers import make_pair, unique_name


@pytest.fixture
def recording(monkeypatch):
    """Metrics recording into fresh histograms, for this test only."""
    monkeypatch.setattr(readings, "_connects", readings._Recorder())
    monkeypatch.setattr(observe, "connect", readings._connected)


def counts() -> dict[tuple[str, str], int]:
    return {k: t.count for k, t in readings.read().connects.items()}


def until(want: dict, seconds: float = 10.0) -> dict:
    """The connects' counts once they equal ``want`` (a listener counts on its own
    thread), or as they are after ``seconds``."""
    end = time.monotonic() + seconds
    got = counts()
    while got != want and time.monotonic() < end:
        time.sleep(0.01)
        got = counts()
    return got


def garbage(lst) -> None:
    """A client that connects to a shm listener and says nonsense: it is dropped."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(b"\0rdmamw-shm/" + lst.address.partition("://")[2].encode())
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    s.shutdown(socket.SHUT_WR)
    s.close()


def test_opens_accepts_and_refusals_are_counted_with_their_time(recording, monkeypatch):
    t0 = time.perf_counter()
    a, b, lst = make_pair()
    took = time.perf_counter() - t0
    try:
        assert until({("shm", "opened"): 1, ("shm", "accepted"): 1}) == \
            {("shm", "opened"): 1, ("shm", "accepted"): 1}
        garbage(lst)
        with pytest.raises(PeerNotFound):
            rdmamw.Channel.open(f"shm://{unique_name('nobody')}", timeout=0.2)
        monkeypatch.setattr(bootstrap, "_world", None)
        with pytest.raises(RdmamwError):
            rdmamw.Channel.open(1)          # by rank, without a job: its provider unknown
        want = {("shm", "opened"): 1, ("shm", "accepted"): 1, ("shm", "refused"): 2,
                ("unknown", "failed"): 1}
        assert until(want) == want
    finally:
        a.close()
        b.close()
        lst.close()
    got = readings.read().connects
    for key in (("shm", "opened"), ("shm", "accepted")):
        assert 0 < got[key].sum <= took
    assert got[("shm", "refused")].sum >= 0.2       # the open tried for its whole timeout
    for t in got.values():
        assert t.cumulative()[-1] == (float("inf"), t.count)


def test_nothing_is_counted_while_metrics_do_not_record(monkeypatch):
    monkeypatch.setattr(readings, "_connects", readings._Recorder())
    monkeypatch.setattr(observe, "connect", None)
    a, b, lst = make_pair()
    try:
        garbage(lst)
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.3)         # the garbage client came and went meanwhile
    finally:
        a.close()
        b.close()
        lst.close()
    assert counts() == {}
