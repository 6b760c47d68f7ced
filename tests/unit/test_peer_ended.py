"""rdmamw._host.ended and RankPair's waits: a rank waiting to open a channel to a rank
of its host whose process ended raises PeerLost at once; a live one, another host, or a
descriptor without the fields is left to the deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rdmamw import _host
from rdmamw.errors import PeerLost, Timeout
from rdmamw.providers.base import RankPair


def desc(pid: int, proc: str | None = None, host: str | None = None) -> dict:
    """A descriptor as the bootstrap makes it (rdmamw.bootstrap._descriptor)."""
    d = {"host": host or _host.host_key(), "pid": pid}
    d["proc"] = proc if proc is not None else key_of(pid)
    return d


def key_of(pid: int) -> str:
    """The ``proc`` field a process ``pid`` of this pid namespace would publish."""
    with open(f"/proc/{pid}/stat") as f:
        start = f.read().rpartition(")")[2].split()[19]
    return f"{_host.proc_ns()}:{start}"


ME = {"host": _host.host_key()}


def test_this_process_has_not_ended():
    assert _host.process_key() == key_of(os.getpid())
    assert _host.ended(ME, desc(os.getpid())) is None


def test_a_killed_process_has_ended_before_and_after_it_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    d = desc(child.pid)
    assert _host.ended(ME, d) is None
    child.kill()
    for _ in range(200):                        # a zombie until waited for
        if _host.ended(ME, d):
            break
        time.sleep(0.01)
    assert _host.ended(ME, d) == f"its process {child.pid} ended (killed or exited, " \
                                 f"not yet reaped)"
    child.wait()
    assert _host.ended(ME, d) == f"its process {child.pid} ended"


def test_a_pid_that_names_another_process_now_has_ended():
    ns, _, start = key_of(os.getpid()).partition(":")
    assert _host.ended(ME, desc(os.getpid(), f"{ns}:{int(start) + 1}")) == \
        f"its process {os.getpid()} ended (the pid now names another)"


@pytest.mark.parametrize("theirs", [
    {"host": "another-boot/1", "pid": 1 << 22, "proc": "1:1"},    # another host
    {"pid": 1 << 22, "proc": "1:1"},                              # no host
    {"host": ME["host"], "pid": 1 << 22},                         # no proc (older rank)
    {"host": ME["host"], "pid": 1 << 22, "proc": "999:1"},        # another pid namespace
    {"host": ME["host"], "pid": "1", "proc": f"{_host.proc_ns()}:1"},
    {"host": ME["host"], "pid": -1, "proc": f"{_host.proc_ns()}:1"},
    {"host": ME["host"], "pid": True, "proc": f"{_host.proc_ns()}:1"},
    {"host": ME["host"], "pid": 1 << 22, "proc": f"{_host.proc_ns()}:x"},
    {"host": ME["host"], "pid": 1 << 22, "proc": 5},
])
def test_what_cannot_be_told_is_left_to_the_deadline(theirs):
    assert _host.ended(ME, theirs) is None


def pair(gone) -> RankPair:
    return RankPair("job", 1, 0, {}, {}, lambda t: None, gone)   # type: ignore[arg-type]


def never(timeout: float):
    time.sleep(timeout)
    raise Timeout("nobody came")


def test_an_accept_stops_once_the_peer_is_gone():
    state = {"gone": None}
    p = pair(lambda: state["gone"])
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        p.accept_within(never, 0.3)              # alive: the whole deadline
    assert time.monotonic() - t0 >= 0.3
    state["gone"] = "its process 7 ended"
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="rank 0 will not connect: its process 7 ended"):
        p.accept_within(never, 30)
    assert time.monotonic() - t0 < 5


def test_an_accept_returns_what_comes():
    p = pair(lambda: "ended")
    assert p.accept_within(lambda t: "conn", 1) == "conn"   # type: ignore[arg-type]


def test_a_stopped_process_is_told_from_a_running_one():
    """rdmamw._host.stopped: what a member past its deadline asks before it names a
    silent rank (a starved one is running, a SIGSTOPped one is not)."""
    import signal

    from tests.support.helpers import stop_process
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        d = desc(child.pid)
        assert _host.stopped(ME, d) is False
        stop_process(child.pid)
        assert _host.stopped(ME, d) is True
        os.kill(child.pid, signal.SIGCONT)
        for _ in range(500):
            if _host.stopped(ME, d) is False:
                break
            time.sleep(0.01)
        assert _host.stopped(ME, d) is False
        assert _host.stopped(ME, desc(child.pid, host="another-host")) is None
        ns, _, start = key_of(child.pid).partition(":")
        assert _host.stopped(ME, desc(child.pid, f"{ns}:{int(start) + 1}")) is None
    finally:
        child.kill()
        child.wait()
    assert _host.stopped(ME, d) is None                 # ended: nothing to tell
