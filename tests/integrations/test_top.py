"""``rdmamw top`` (rdmamw/apps/top.py) on a running 2-rank job's metrics endpoints
(tests/integrations/test_metrics_job.py's): one frame (``--once``) shows per rank and
peer exactly the ranks' own ``stats()``; in a real terminal (tmux) it shows every rank
in its first frame, refreshes, and quits on Ctrl-C."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("rich")
from rdmamw.apps.top import COLUMNS  # noqa: E402
from tests.integrations.test_metrics_job import Job, counters  # noqa: E402
from tests.support.helpers import free_ports  # noqa: E402

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


def test_one_frame_shows_each_ranks_counters_per_peer(job2):
    down = free_ports(1)        # nothing listens there
    targets = [f"127.0.0.1:{job2.base + r}" for r in range(job2.n)] + [f"127.0.0.1:{down}"]
    got = subprocess.run([sys.executable, "-m", "rdmamw.cli", "top", "--once",
                          "--interval", "0.5", *targets],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    want = {(str(r), peer): {**{col: str(st[key]) for col, key in TOTALS.items()},
                             "provider": "shm", "errors": "0",
                             # the job is idle while it is read: no rate
                             "sent/s": "0 B", "recv/s": "0 B", "msg sent/s": "0",
                             "msg recv/s": "0"}
            for r, rep in enumerate(job2.reports) for peer, st in rep["stats"].items()}
    shown = {k: {c: v for c, v in row.items() if c not in ("rank", "peer")}
             for k, row in rows(got.stdout).items()}
    assert shown == want
    assert f"not answering: http://127.0.0.1:{down}/metrics" in got.stdout
    assert counters(job2.finish()) == counters(job2.reports)    # (it was idle)


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
