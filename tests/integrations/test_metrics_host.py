"""One metrics endpoint for every rank of a host (RDMAMW_METRICS_HOST_PORT,
rdmamw/metrics/host.py): a 3-rank shm job (tests/support/metrics_worker.py) scraped at
the one port gives every rank's per-peer counters equal to the ranks' own
``stats()``; the rank that answered killed, or stopped (SIGSTOP), the others answer
(the dead rank's series gone, the stopped one reported down); a rank stopped neither
holds the scrape past a bound nor hides the others' series; a rank that accepts and
never answers holds no scrape and no thread; a fork child holds no port."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("prometheus_client")
from rdmamw.metrics.gather import RANK_TIMEOUT  # noqa: E402
from rdmamw.metrics.host import TAKEOVER  # noqa: E402
from tests.integrations.test_metrics_job import (  # noqa: E402
    Job,
    counters,
    expected,
    per_peer,
    scrape,
)

# A scrape that waits on a silent rank ends by RANK_TIMEOUT and this much more: the
# scheduling of a loaded 2-core machine (a scrape took 1.7 s beside the VM of the device
# tests); one that waited on the silent rank itself would not end while it stays silent.
MARGIN = 2.5

SERVED_BY = ("rdmamw_host_endpoint_pid", frozenset())


@pytest.fixture
def job3():
    j = Job(3, host=True)
    yield j
    for p in j.procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
    j.kill()


def ranks_up(samples: dict) -> dict[str, float]:
    return {dict(ls)["rank"]: v for (name, ls), v in samples.items()
            if name == "rdmamw_host_rank_up"}


def ranks_seen(samples: dict) -> set[str]:
    return {dict(ls)["rank"] for (name, ls), _ in samples.items()
            if "rank" in dict(ls) and name != "rdmamw_host_rank_up"}


def peers_of(samples: dict, ranks: list[int]) -> dict:
    got: dict = {}
    for r in ranks:
        got.update(per_peer(samples, r))
    return got


def want_of(job: Job, ranks: list[int]) -> dict:
    return {k: v for k, v in expected(job).items() if int(k[1]) in ranks}


def test_one_endpoint_serves_every_rank_of_the_host(job3):
    samples = scrape(job3.host)
    assert peers_of(samples, [0, 1, 2]) == expected(job3)
    assert ranks_up(samples) == {"0": 1, "1": 1, "2": 1}
    assert samples[SERVED_BY] in {p.pid for p in job3.procs}
    assert counters(job3.finish()) == counters(job3.reports)    # (it was idle)


def test_the_serving_rank_dies_another_takes_over_without_its_series(job3):
    served_by = int(scrape(job3.host)[SERVED_BY])
    dead = next(r for r, p in enumerate(job3.procs) if p.pid == served_by)
    job3.procs[dead].kill()
    job3.procs[dead].wait()
    killed = time.monotonic()
    while True:
        try:
            samples = scrape(job3.host)
            break
        except OSError:
            assert time.monotonic() - killed < 2 + 4 * TAKEOVER, "nobody took over"
            time.sleep(0.05)
    alive = [r for r in range(3) if r != dead]
    assert int(samples[SERVED_BY]) in {job3.procs[r].pid for r in alive}
    assert ranks_up(samples) == {str(r): 1 for r in alive}
    assert ranks_seen(samples) == {str(r) for r in alive}       # the dead one's: gone
    assert peers_of(samples, alive) == want_of(job3, alive)


def _stopped(pid: int) -> None:
    """Until ``pid`` is stopped: SIGSTOP lands asynchronously, and a process still
    running for a moment after kill() may accept the next scrape on the shared socket
    and hold it (docs/metrics.md: a scrape accepted just before the stop is lost)."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within 5 s")


def test_a_stopped_rank_holds_no_scrape_and_is_reported_down(job3):
    served_by = int(scrape(job3.host)[SERVED_BY])
    stopped = next(r for r, p in enumerate(job3.procs) if p.pid != served_by)
    os.kill(job3.procs[stopped].pid, signal.SIGSTOP)
    _stopped(job3.procs[stopped].pid)
    try:
        t0 = time.monotonic()
        samples = scrape(job3.host)
        took = time.monotonic() - t0
    finally:
        os.kill(job3.procs[stopped].pid, signal.SIGCONT)
    others = [r for r in range(3) if r != stopped]
    assert took < RANK_TIMEOUT + MARGIN
    assert ranks_up(samples) == {**{str(r): 1 for r in others}, str(stopped): 0}
    assert ranks_seen(samples) == {str(r) for r in others}
    assert peers_of(samples, others) == want_of(job3, others)
    # running again, it is back in the next scrape
    samples = scrape(job3.host)
    assert peers_of(samples, [0, 1, 2]) == expected(job3)
    assert ranks_up(samples) == {"0": 1, "1": 1, "2": 1}
    assert counters(job3.finish()) == counters(job3.reports)


def holders(job: Job) -> set[int]:
    """The pids holding a copy of the host's port's socket (each hands it on at its
    PID.sock in the host's directory)."""
    from rdmamw.metrics import members
    d = members.directory(job.host)
    return {int(f.removesuffix(".sock")) for f in os.listdir(d) if f.endswith(".sock")}


def test_the_serving_rank_stopped_another_answers_at_once(job3):
    """The process that answered a scrape stopped (SIGSTOP): the next scrapes are
    answered by the others within the per-rank bound, the stopped one reported down;
    running again, it is back. (Before the shared socket: nobody answered.)"""
    pids = {p.pid for p in job3.procs}
    end = time.monotonic() + 5
    while holders(job3) != pids:
        assert time.monotonic() < end, (holders(job3), pids)
        time.sleep(0.05)
    served_by = int(scrape(job3.host)[SERVED_BY])
    stopped = next(r for r, p in enumerate(job3.procs) if p.pid == served_by)
    os.kill(served_by, signal.SIGSTOP)
    _stopped(served_by)
    others = [r for r in range(3) if r != stopped]
    try:
        for _ in range(5):
            t0 = time.monotonic()
            samples = scrape(job3.host)
            took = time.monotonic() - t0
            assert took < RANK_TIMEOUT + MARGIN, took
            assert int(samples[SERVED_BY]) in {job3.procs[r].pid for r in others}
            assert ranks_up(samples) == {**{str(r): 1 for r in others}, str(stopped): 0}
            assert peers_of(samples, others) == want_of(job3, others)
    finally:
        os.kill(served_by, signal.SIGCONT)
    samples = scrape(job3.host)
    assert ranks_up(samples) == {"0": 1, "1": 1, "2": 1}
    assert peers_of(samples, [0, 1, 2]) == expected(job3)
    assert counters(job3.finish()) == counters(job3.reports)


def test_a_rank_that_accepts_and_never_answers_holds_no_scrape(tmp_path):
    """Two processes of the host that the kernel connects to and that never answer
    (one never accepts, one sends its header and then a byte each 0.2 s): the scrape
    answers within RANK_TIMEOUT and a margin, without them (up 0), and leaves no
    thread asking them behind."""
    import json
    import socket
    import subprocess
    import sys
    import threading

    from rdmamw.metrics import members
    from rdmamw.metrics.exporter import Endpoint
    from rdmamw.metrics.host import Host

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mute = socket.create_server(("127.0.0.1", 0), backlog=8)       # never accepts
    trickle = socket.create_server(("127.0.0.1", 0), backlog=8)
    stop = threading.Event()

    def dribble() -> None:
        while not stop.is_set():
            trickle.settimeout(0.1)
            try:
                c, _ = trickle.accept()
            except TimeoutError:
                continue
            with c:
                c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 1000000\r\n\r\n")
                while not stop.wait(0.2):
                    try:
                        c.sendall(b"#")
                    except OSError:
                        break

    threading.Thread(target=dribble, daemon=True).start()
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                for _ in range(2)]
    files = []
    for p, srv in zip(sleepers, (mute, trickle), strict=True):
        files.append(os.path.join(members.directory(port), f"{p.pid}.json"))
        with open(files[-1], "w") as f:
            json.dump({"pid": p.pid, "rank": "", "start": members.started(p.pid),
                       "url": f"http://127.0.0.1:{srv.getsockname()[1]}"}, f)
    own = Endpoint(0, "127.0.0.1")
    host = Host(port, "127.0.0.1", f"http://127.0.0.1:{own.port}", "")
    try:
        end = time.monotonic() + 5
        while not host.serving and time.monotonic() < end:
            time.sleep(0.01)
        for _ in range(2):
            t0 = time.monotonic()
            samples = scrape(port)
            took = time.monotonic() - t0
            assert took < RANK_TIMEOUT + MARGIN, took      # (as a stopped rank's, above)
            assert ranks_up(samples) == {f"pid{os.getpid()}": 1, f"pid{sleepers[0].pid}": 0,
                                         f"pid{sleepers[1].pid}": 0}
        end = time.monotonic() + 1
        while time.monotonic() < end and any(t.name == "rdmamw-metrics-ask"
                                             for t in threading.enumerate()):
            time.sleep(0.01)
        assert not [t for t in threading.enumerate() if t.name == "rdmamw-metrics-ask"]
    finally:
        stop.set()
        host.close()
        own.close()
        mute.close(), trickle.close()
        for p, path in zip(sleepers, files, strict=True):
            p.kill(), p.wait()
            members.leave(path)


FORKS = """
import os, sys, time
import rdmamw.metrics as m
m.serve_host(int(sys.argv[1]))
while not m._host.serving:
    time.sleep(0.01)
child = os.fork()
if child == 0:
    os.close(1), os.close(2)    # (the test reads the parent's output to its end)
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
"""


def test_a_fork_child_outliving_its_parent_holds_no_port():
    """A process serving the host's endpoint forks (a DataLoader's worker) and exits:
    its child, still running, has closed its inherited copies of the port's socket,
    so the port is free for the next process."""
    import socket
    import subprocess
    import sys

    from tests.support.helpers import free_ports
    port = free_ports(1)
    env = {**os.environ, "RDMAMW_METRICS_ADDR": "127.0.0.1"}
    out = subprocess.run([sys.executable, "-c", FORKS, str(port)], env=env, timeout=60,
                         capture_output=True, text=True, check=True).stdout
    child = int(out)
    try:
        with socket.create_server(("127.0.0.1", port)):
            pass
    finally:
        os.kill(child, signal.SIGKILL)
