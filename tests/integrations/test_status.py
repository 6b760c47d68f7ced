"""``rdmamw status`` (rdmamw/apps/status.py) and the ``/health`` answers behind it
(rdmamw/metrics/health.py) on a running 3-rank shm job (tests/support/status_worker.py):
every rank up and connected; rank 0 blocked in a receive from rank 1 shown waiting on
it; ranks in an allreduce the last rank has not joined shown waiting on that one; a
stopped rank named silent and a killed one named gone (host endpoint) or not heard
from (per-rank endpoints), each answered within a second; nothing answering is an
error of its own."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from rdmamw.apps import status  # noqa: E402
from rdmamw.bootstrap.launch import spawn  # noqa: E402
from tests.support.helpers import free_ports, stop_process  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "support", "status_worker.py")
#: what the status may take (the host's endpoint gives a silent rank 0.5 s of it)
BOUND = 1.0


class Job:
    """3 ranks of the worker: ``host`` (one endpoint, ``targets`` its address) or one
    endpoint per rank."""

    def __init__(self, host: bool) -> None:
        port = free_ports(3)
        self.targets = [f"127.0.0.1:{port}"] if host else \
            [f"127.0.0.1:{port + r}" for r in range(3)]
        env = {"RDMAMW_METRICS_ADDR": "127.0.0.1",
               "RDMAMW_COLL_CONFIG": os.path.join(ROOT, "tests", "no-such-config.json"),
               "RDMAMW_METRICS_HOST_PORT" if host else "RDMAMW_METRICS_PORT": str(port)}
        self.procs = spawn(3, [sys.executable, WORKER], cwd=ROOT, env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        for r in range(3):
            assert self.line(r) == "ready", self.procs[r].stderr.read()[-3000:]

    def line(self, r: int) -> str:
        return self.procs[r].stdout.readline().strip()

    def say(self, r: int) -> None:
        self.procs[r].stdin.write("go on\n")
        self.procs[r].stdin.flush()

    def status(self) -> tuple[int, dict, float]:
        """(exit status, the JSON status, seconds it took), in this process."""
        out = io.StringIO()
        t0 = time.monotonic()
        with contextlib.redirect_stdout(out):
            rc = status.main(["--json", *self.targets])
        return rc, json.loads(out.getvalue()), time.monotonic() - t0

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()


@pytest.fixture(params=["host", "per-rank"])
def job(request):
    j = Job(request.param == "host")
    yield j
    j.kill()


@pytest.fixture
def host_job():
    j = Job(True)
    yield j
    j.kill()


def by_rank(st: dict) -> dict[str, dict]:
    return {r["rank"]: r for r in st["ranks"]}


def waits(st: dict) -> dict[str, list[str]]:
    return {r: v["waits_on"] for r, v in by_rank(st).items()}


def on(st: dict, rank: str, peer: str) -> dict[str, float]:
    """What ``rank`` waits for from ``peer``, and for how long."""
    return next(p for p in by_rank(st)[rank]["peers"] if p["peer"] == peer)["waiting"]


def wait_for(job: Job, what, within: float = 10.0) -> dict:
    """The status once ``what(status)`` holds (polled)."""
    end = time.monotonic() + within
    while True:
        rc, st, took = job.status()
        assert took < BOUND
        if what(st):
            return st
        assert time.monotonic() < end, st
        time.sleep(0.1)


def up(st: dict) -> bool:
    """Every rank answered (on a loaded machine a rank may miss the host endpoint's
    0.5 s for one answer: silent, by design; the next answer counts)."""
    return st["ok"] is True and all(r["state"] == "up" for r in st["ranks"])


def test_every_rank_up_connected_and_whom_it_waits_on(job):
    st = wait_for(job, lambda s: up(s) and waits(s).get("0") == ["1"])
    ranks = by_rank(st)
    assert sorted(ranks) == ["0", "1", "2"] and st["ok"] is True
    assert {r: (v["state"], v["pid"], v["world_size"]) for r, v in ranks.items()} == \
        {str(r): ("up", p.pid, 3) for r, p in enumerate(job.procs)}
    # each rank: a channel to every other (the allreduce's), 0 and 1 one more each
    assert {r: {p["peer"]: (p["channels"], p["lost"]) for p in v["peers"]}
            for r, v in ranks.items()} == {
        "0": {"1": (2, False), "2": (1, False)}, "1": {"0": (2, False), "2": (1, False)},
        "2": {"0": (1, False), "1": (1, False)}}
    assert waits(st) == {"0": ["1"], "1": [], "2": []}
    waited = on(st, "0", "1")
    assert list(waited) == ["arrival"] and 0 < waited["arrival"] < 60
    job.say(1)          # 1 sends 0 its message: both enter the allreduce, 2 has not
    st = wait_for(job, lambda s: up(s) and waits(s) == {"0": ["2"], "1": ["2"], "2": []}
                  and all(on(s, r, "2").get("collective", 0) > 0.3 for r in ("0", "1")))
    job.say(2)
    assert [job.line(r) for r in range(3)] == ["done"] * 3
    wait_for(job, lambda s: up(s) and waits(s) == {"0": [], "1": [], "2": []})


def test_a_stopped_rank_is_named_silent_within_the_bound(host_job):
    """(Not the rank serving the host's endpoint: that one stopped, the endpoint
    waits with it, docs/metrics.md.)"""
    job = host_job
    url = f"http://{job.targets[0]}/health"
    served_by = json.loads(urllib.request.urlopen(url, timeout=10).read())["served_by"]
    stopped = next(r for r in (2, 1, 0) if job.procs[r].pid != served_by)
    stop_process(job.procs[stopped].pid)   # (not asked: answered at once, not at 0.5 s)
    try:
        rc, st, took = job.status()
    finally:
        os.kill(job.procs[stopped].pid, signal.SIGCONT)
    assert took < BOUND and rc == 1 and st["ok"] is False
    silent = by_rank(st)[str(stopped)]
    assert (silent["state"], silent["pid"]) == ("silent", job.procs[stopped].pid)
    assert silent["error"] == "stopped (SIGSTOP or a debugger), not asked", silent
    assert {r: v["state"] for r, v in by_rank(st).items()} == \
        {str(r): "silent" if r == stopped else "up" for r in range(3)}
    got = subprocess.run([sys.executable, "-m", "rdmamw.cli", "status", *job.targets],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert got.returncode == 0, got.stdout + got.stderr     # running again: all up
    assert [ln.split()[:3] for ln in got.stdout.splitlines()] == \
        [["rank", str(r), "up"] for r in range(3)]


def test_a_killed_rank_is_named(job):
    job.say(1)          # 0 and 1 enter the allreduce and wait for 2
    wait_for(job, lambda s: waits(s) == {"0": ["2"], "1": ["2"], "2": []})
    job.procs[2].kill()
    job.procs[2].wait()
    rc, st, took = job.status()
    assert took < BOUND and rc == 1 and st["ok"] is False
    if len(job.targets) == 1:       # the host's endpoint knew the process: gone
        gone = by_rank(st)["2"]
        assert (gone["state"], gone["pid"]) == ("gone", job.procs[2].pid)
    else:                           # its own endpoint is gone with it
        assert [u["url"] for u in st["unreachable"]] == \
            [f"http://{job.targets[2]}/health"]
        assert [m["rank"] for m in st["missing"]] == ["2"]
    # the others' allreduce fails naming the peer lost, its channels closed with it
    assert [job.line(r) for r in (0, 1)] == ["failed: PeerLost"] * 2
    st = wait_for(job, lambda s: [[p["peer"] for p in by_rank(s)[r]["peers"]]
                                  for r in ("0", "1")] == [["1"], ["0"]])
    got = subprocess.run([sys.executable, "-m", "rdmamw.cli", "status", *job.targets],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert got.returncode == 1
    named = [ln.partition(" (found")[0] for ln in got.stdout.splitlines()
             if ln.startswith("rank    2 ")]
    assert named == [f"rank    2  gone    pid {job.procs[2].pid:<7}  process "
                     f"{job.procs[2].pid} exited" if len(job.targets) == 1 else
                     "rank    2  not heard from by any endpoint"], got.stdout


def test_nothing_answering_is_an_error_within_the_bound():
    port = free_ports(1)
    t0 = time.monotonic()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = status.main([f"127.0.0.1:{port}"])
    assert time.monotonic() - t0 < BOUND
    assert rc == 2 and out.getvalue() == ""
    assert err.getvalue().startswith(f"rdmamw status: nothing answers (http://127.0.0.1:"
                                     f"{port}/health: "), err.getvalue()
