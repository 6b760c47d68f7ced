"""The metrics endpoint of a running job (rdmamw.metrics, docs/metrics.md): ranks of a
shm job (tests/support/metrics_worker.py) serve RDMAMW_METRICS_PORT + local rank; a
scrape of each, and a real Prometheus server's query API, give per peer the counters
the ranks' channels report themselves (``stats()``), exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rdmamw.bootstrap.launch import spawn  # noqa: E402
from tests.support import metrics_worker  # noqa: E402
from tests.support.helpers import free_ports  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "support", "metrics_worker.py")
PROMETHEUS = shutil.which("prometheus")
#: each per-peer counter of the exposition and the stats() key it must equal (written
#: out here, not read from rdmamw.metrics: a wrong mapping there must fail)
STATS_KEY = {
    "rdmamw_messages_sent_total": "messages",
    "rdmamw_messages_received_total": "messages_received",
    "rdmamw_sent_bytes_total": "bytes",
    "rdmamw_received_bytes_total": "bytes_received",
    "rdmamw_batches_total": "batches",
    "rdmamw_doorbells_total": "doorbells",
    "rdmamw_work_requests_total": "work_requests",
    "rdmamw_signaled_completions_total": "signaled_completions",
    "rdmamw_credit_waits_total": "credit_waits",
    "rdmamw_credit_wait_seconds_total": "credit_wait_seconds",
    "rdmamw_sleeps_total": "sleeps",
    "rdmamw_arrival_sleeps_total": "arrival_sleeps",
    "rdmamw_wakeups_sent_total": "wakeups_sent",
    "rdmamw_rendezvous_received_total": "rndv_received",
    "rdmamw_rendezvous_sent_bytes_total": "rndv_bytes",
}


class Job:
    """``n`` ranks of the worker, each serving its metrics (``host``: all of them at
    one port, ``self.host``, as RDMAMW_METRICS_HOST_PORT does); ``reports[r]`` is rank
    r's first report (its channels' stats per peer)."""

    def __init__(self, n: int, host: bool = False) -> None:
        self.n, self.base = n, free_ports(n)
        self.host = free_ports(1) if host else 0
        env = {"RDMAMW_METRICS_ADDR": "127.0.0.1",
               "RDMAMW_COLL_CONFIG": os.path.join(ROOT, "tests", "no-such-config.json"),
               **({"RDMAMW_METRICS_HOST_PORT": str(self.host)} if host else
                  {"RDMAMW_METRICS_PORT": str(self.base)})}
        self.procs = spawn(n, [sys.executable, WORKER], cwd=ROOT, env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        try:
            self.reports = [self._report(p) for p in self.procs]
        except BaseException:
            self.kill()
            raise

    def _report(self, p: subprocess.Popen) -> dict:
        line = p.stdout.readline()
        if not line:
            p.wait(10)
            raise AssertionError(f"a rank failed: {p.stderr.read()[-3000:]}")
        return json.loads(line)

    def finish(self) -> list[dict]:
        """The ranks' second report (after the scrapes), and their exit."""
        self._say()
        again = [self._report(p) for p in self.procs]
        self._say()
        for p in self.procs:
            assert p.wait(30) == 0, p.stderr.read()[-3000:]
        return again

    def _say(self) -> None:
        for p in self.procs:
            p.stdin.write("go on\n")
            p.stdin.flush()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def job4():
    j = Job(4)
    yield j
    j.kill()


@pytest.fixture(params=[2, 4])
def job(request):
    j = Job(request.param)
    yield j
    j.kill()


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples}


def expected(job: Job) -> dict[tuple[str, str, str], float]:
    """(metric, rank, peer) -> the value the ranks' own stats() give it."""
    return {(name, str(r), peer): float(stats[key])
            for r, rep in enumerate(job.reports) for peer, stats in rep["stats"].items()
            for name, key in STATS_KEY.items()}


def per_peer(samples: dict, rank: int) -> dict[tuple[str, str, str], float]:
    """Every sample labelled with a peer but the levels and the rendezvous by strategy
    (checked on their own)."""
    return {(name, labels["rank"], labels["peer"]): v
            for (name, ls), v in samples.items()
            for labels in [dict(ls)] if "peer" in labels and "strategy" not in labels
            and name != "rdmamw_channels_open" and not name.endswith("_created")
            and labels["rank"] == str(rank)}


def test_each_rank_serves_its_channels_counters_per_peer(job):
    got = {}
    for r in range(job.n):
        samples = scrape(job.base + r)
        got.update(per_peer(samples, r))
        # the collectives' histogram counted every allreduce, into one bucket or another
        count = samples[("rdmamw_collective_seconds_count",
                         frozenset({"rank": str(r), "collective": "allreduce"}.items()))]
        assert count == metrics_worker.ALLREDUCES
        for peer, st in job.reports[r]["stats"].items():
            labels = {"rank": str(r), "provider": "shm", "peer": peer}
            rndv = {k: samples[("rdmamw_rendezvous_sent_total",
                                frozenset({**labels, "strategy": k}.items()))]
                    for k in ("read", "write")}
            assert rndv == {"read": st["rndv_sends"] - st["rndv_writes"],
                            "write": st["rndv_writes"]}
            assert st["rndv_sends"] >= 1
        assert samples[("rdmamw_channels_open", frozenset(
            {"rank": str(r), "provider": "shm", "peer": str((r + 1) % job.n)}.items()))] == 2
    assert got == expected(job)
    # the stats are what was sent: each rank's own channel sent each peer the plan's bytes
    assert [rep["sent"] for rep in job.reports] == [
        {str(p): metrics_worker.plan(r, p)[0] * metrics_worker.plan(r, p)[1]
         * metrics_worker.plan(r, p)[2] + metrics_worker.LARGE for p in range(job.n) if p != r}
        for r in range(job.n)]
    # and the counters did not move while the ranks were scraped (free_send_slots, a
    # level, may: a release the peer wrote is seen late)
    assert counters(job.finish()) == counters(job.reports)


def counters(reports: list[dict]) -> list[dict]:
    return [{peer: {k: v for k, v in s.items() if k != "free_send_slots"}
             for peer, s in rep["stats"].items()} for rep in reports]


PROM_CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: rdmamw
    static_configs:
      - targets: [{targets}]
"""


def query(api: str, promql: str) -> list[dict]:
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian package "
                    "prometheus; scripts/setup_test_deps.sh installs it)")
def test_a_prometheus_server_scrapes_the_job(job4, tmp_path):
    """Debian's Prometheus scrapes the 4 ranks each second; its query API returns every
    rank's per-peer counters equal to the ranks' stats()."""
    targets = ", ".join(f"'127.0.0.1:{job4.base + r}'" for r in range(job4.n))
    (tmp_path / "prometheus.yml").write_text(PROM_CONFIG.format(targets=targets))
    port = free_ports(1)
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    api = f"http://127.0.0.1:{port}"
    want = expected(job4)
    names = sorted({name for name, _, _ in want})
    got: dict = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                got = {(name, s["metric"]["rank"], s["metric"]["peer"]): float(s["value"][1])
                       for name in names for s in query(api, name)}
            except OSError:
                pass            # not listening yet
            if got == want:
                break
            time.sleep(0.5)
        assert server.poll() is None, server.stderr.read()[-3000:]
        assert got == want
        up = query(api, "up")
        assert sorted(s["metric"]["instance"] for s in up if s["value"][1] == "1") == \
            sorted(f"127.0.0.1:{job4.base + r}" for r in range(job4.n))
    finally:
        server.terminate()
        server.wait(30)
    job4.finish()
