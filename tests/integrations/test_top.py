"""``rdmamw top`` (rdmamw/apps/top.py) on a running 2-rank job's metrics endpoints
(tests/integrations/test_metrics_job.py's): one frame (``--once``) shows per rank and
peer exactly the ranks' own ``stats()``; in a real terminal (tmux) it shows every rank
in its first frame, refreshes, and quits on Ctrl-C. On a 3-rank job's one host
endpoint (RDMAMW_METRICS_HOST_PORT): a row per rank and peer, each rank its own, and a
rank stopped (SIGSTOP) shown down with why, the frame late by no more than the host's
per-rank bound; what each rank waits on, per peer, as its health answer says."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("rich")
from rdmamw.apps.top import COLUMNS  # noqa: E402
from rdmamw.metrics.gather import RANK_TIMEOUT  # noqa: E402
from tests.integrations.test_metrics_host import job3  # noqa: E402,F401 - the fixture
from tests.integrations.test_metrics_job import Job, counters  # noqa: E402
from tests.integrations.test_status import host_job  # noqa: E402,F401 - the fixture
from tests.support.helpers import free_ports, stop_process  # noqa: E402

TMUX = shutil.which("tmux")
#: the frame's columns of totals and the stats() key each must equal (written out
#: here: a wrong mapping in top must fail)
TOTALS = {"bytes sent": "bytes", "bytes recv": "bytes_received", "msgs sent": "messages",
          "msgs recv": "messages_received", "credit waits": "credit_waits",
          "sleeps": "sleeps"}


@pytest.fixture
def job2():
    j = Job(2)
    yield j
    j.kill()


def rows(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """The table's body rows, (rank, peer) -> column -> cell."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == len(COLUMNS) and cells[0] != "rank":
            row = dict(zip(COLUMNS, cells, strict=True))
            out[(row["rank"], row["peer"])] = row
    return out


def top_once(*targets: str) -> tuple[str, float]:
    """One frame (two reads 0.5 s apart) of ``rdmamw top`` and how long it took."""
    t0 = time.monotonic()
    got = subprocess.run([sys.executable, "-m", "rdmamw.cli", "top", "--once",
                          "--interval", "0.5", *targets],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    return got.stdout, time.monotonic() - t0


def want_rows(job: Job, ranks: list[int]) -> dict[tuple[str, str], dict[str, str]]:
    """The rows of the idle ``job``'s ``ranks``: its ranks' own stats() per peer."""
    return {(str(r), peer): {**{col: str(st[key]) for col, key in TOTALS.items()},
                             "rank": str(r), "peer": peer, "provider": "shm",
                             "errors": "0", "waiting on peer": "-",
                             # the job is idle while it is read: no rate
                             "sent/s": "0 B", "recv/s": "0 B", "msg sent/s": "0",
                             "msg recv/s": "0"}
            for r in ranks for peer, st in job.reports[r]["stats"].items()}


def test_one_frame_shows_each_ranks_counters_per_peer(job2):
    down = free_ports(1)        # nothing listens there
    targets = [f"127.0.0.1:{job2.base + r}" for r in range(job2.n)] + [f"127.0.0.1:{down}"]
    out, _ = top_once(*targets)
    assert rows(out) == want_rows(job2, list(range(job2.n)))
    assert f"not answering: http://127.0.0.1:{down}/metrics" in out
    assert counters(job2.finish()) == counters(job2.reports)    # (it was idle)


def test_a_hosts_endpoint_shows_each_rank_and_a_stopped_one_down(job3):  # noqa: F811
    out, running = top_once(f"127.0.0.1:{job3.host}")
    assert rows(out) == want_rows(job3, [0, 1, 2])
    stop_process(job3.procs[2].pid)     # (every thread: then it is not asked)
    try:
        out, took = top_once(f"127.0.0.1:{job3.host}")
    finally:
        os.kill(job3.procs[2].pid, signal.SIGCONT)
    down = {c: "" for c in COLUMNS} | {
        "rank": "2", "peer": "-", "provider": "-", "sent/s": "down",
        "waiting on peer": "silent: stopped (SIGSTOP or a debugger), not asked"}
    assert rows(out) == {**want_rows(job3, [0, 1]), ("2", "-"): down}, out
    # each of its two reads waits for the stopped rank at most the host's bound (not at
    # all when it is seen stopped)
    assert took < running + 2 * RANK_TIMEOUT + 1.0, (took, running)
    assert counters(job3.finish()) == counters(job3.reports)    # (it was idle)


def tmux(*args: str) -> str:
    return subprocess.run([TMUX, *args], capture_output=True, text=True, timeout=10,
                          check=True).stdout


@pytest.mark.skipif(TMUX is None, reason="no tmux (scripts/setup_test_deps.sh installs "
                    "it)")
def test_the_live_view_refreshes_in_a_terminal(job2, tmp_path):
    session = f"rdmamw-top-{job2.base}"
    # (COLUMNS and LINES, if this process has them, would override the pane's size)
    cmd = " ".join(["env", "-u", "COLUMNS", "-u", "LINES", sys.executable, "-m",
                    "rdmamw.cli", "top",
                    *(f"127.0.0.1:{job2.base + r}" for r in range(job2.n))])
    tmux("-S", str(tmp_path / "sock"), "new-session", "-d", "-s", session, "-x", "220",
         "-y", "30", cmd)
    sock = ("-S", str(tmp_path / "sock"))
    try:
        def screen() -> str:
            return tmux(*sock, "capture-pane", "-p", "-t", session)

        def wait_for(text: str) -> str:
            end = time.monotonic() + 30
            while time.monotonic() < end:
                s = screen()
                if text in s:
                    return s
                time.sleep(0.1)
            raise AssertionError(f"{text!r} never shown:\n{s}")

        first = wait_for("frame 1,")
        # every rank with its peer in the first frame (before any refresh)
        assert set(rows(first)) == {("0", "1"), ("1", "0")}, first
        wait_for("frame 3,")                # refreshed, each second
        tmux(*sock, "send-keys", "-t", session, "C-c")
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if subprocess.run([TMUX, *sock, "has-session", "-t", session],
                              capture_output=True).returncode != 0:
                break           # the command quit: its session ended
            time.sleep(0.1)
        else:
            raise AssertionError(f"top did not quit on Ctrl-C:\n{screen()}")
    finally:
        subprocess.run([TMUX, *sock, "kill-server"], capture_output=True)
    job2.finish()


def waiting(out: str) -> dict[tuple[str, str], str]:
    """The frame's "waiting on peer" cells that say a wait, by (rank, peer), the
    seconds written as S, the waits in the order of their names."""
    return {k: ", ".join(sorted(re.sub(r"\d+\.\d s", "S", row["waiting on peer"])
                                .split(", ")))
            for k, row in rows(out).items() if row["waiting on peer"] != "-"}


def test_a_hosts_endpoint_shows_whom_each_rank_waits_on(host_job):  # noqa: F811
    """tests/support/status_worker.py's job: rank 0 blocked in a receive from rank 1,
    then ranks 0 and 1 in an allreduce rank 2 has not joined."""
    target = host_job.targets[0]
    end = time.monotonic() + 20
    while (got := waiting(top_once(target)[0])) != {("0", "1"): "arrival S"}:
        assert time.monotonic() < end, got
    host_job.say(1)     # rank 1 sends: both in the allreduce, waiting for rank 2
    end = time.monotonic() + 20       # (its step's receive asleep on the channel too)
    while (got := waiting(top_once(target)[0])) != {("0", "2"): "arrival S, collective S",
                                                     ("1", "2"): "arrival S, collective S"}:
        assert time.monotonic() < end, got


def test_a_gone_record_of_an_earlier_process_leaves_the_live_rank_up():
    """A host's directory keeps a dead process's record for 10 minutes: its rank's
    new process, answering the metrics, stays up; a rank the health answer alone
    knows (gone) is shown down, with why."""
    from rdmamw.apps.top import Rank, Scrape, _add_health
    s = Scrape("u", 0.0, ranks={"0": Rank()})
    _add_health(s, json.dumps({"ranks": [
        {"rank": "0", "state": "gone", "error": "process 7 exited (found 9 s ago)"},
        {"rank": "0", "state": "up", "peers": [{"peer": "1", "waiting": {"arrival": 2.0}}]},
        {"rank": "1", "state": "gone", "error": "process 8 exited (found 9 s ago)"},
    ]}).encode())
    assert s.ranks == {"0": Rank(waiting={"1": "arrival 2.0 s"}),
                       "1": Rank(up=False, why="gone: process 8 exited (found 9 s ago)")}
