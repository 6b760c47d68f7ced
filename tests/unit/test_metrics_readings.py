"""rdmamw.metrics in one process: what a reading sums (channels open and closed, the
peers beyond the bound under "other", rendezvous by strategy), the errors by kind, the
snapshot against a scrape of the endpoint, and that nothing is imported or started
while RDMAMW_METRICS_PORT and RDMAMW_METRICS_HOST_PORT are unset. The endpoints of a
running job: tests/integrations/test_metrics_job.py, test_metrics_host.py."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import urllib.request

import pytest

import rdmamw
from rdmamw import errors, observe
from rdmamw.errors import ConfigError, PeerLost, PeerNotFound, Timeout
from rdmamw.metrics import readings
from tests.support.helpers import free_ports, make_pair, unique_name


class Fake:
    """A channel as rdmamw.observe sees one: a provider, a peer rank and stats()."""

    def __init__(self, peer_rank: int, **stats: int) -> None:
        self.provider, self.peer_rank, self.peer = "fake", peer_rank, "fake://x"
        self.counters = stats

    def stats(self) -> dict:
        return dict(self.counters)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """An empty registry and no labels given yet (the suite's other channels aside)."""
    monkeypatch.setattr(observe, "_open", {})
    monkeypatch.setattr(observe, "_closed", {})
    monkeypatch.setattr(observe, "_dead", [])
    monkeypatch.setattr(readings, "_labels", {})


def rows() -> dict[tuple[str, str], dict[str, int]]:
    return readings.read().channels


def test_rendezvous_sends_by_strategy():
    ch = Fake(3, rndv_sends=5, rndv_writes=2, bytes=7)
    observe.register(ch)
    row = rows()[("fake", "3")]
    assert (row[readings.RNDV_READ], row[readings.RNDV_WRITE], row["rdmamw_sent_bytes_total"],
            row["rdmamw_channels_open"]) == (3, 2, 7, 1)


def test_peers_beyond_the_bound_are_summed_under_other(monkeypatch):
    monkeypatch.setenv("RDMAMW_METRICS_MAX_PEERS", "3")
    chans = [Fake(r, bytes=10 + r) for r in range(8)]
    for ch in chans:
        observe.register(ch)
    got = {peer: row["rdmamw_sent_bytes_total"] for (_, peer), row in rows().items()}
    # which three peers get their own series depends on the registry's order; the
    # others' bytes are all under "other", none lost, none twice
    assert len(got) == 4 and got.pop("other") + sum(got.values()) == sum(10 + r for r in range(8))
    assert all(v == 10 + int(peer) for peer, v in got.items())
    own = set(got)
    # a label once given stays: a peer seen later, or the bound raised, moves nothing
    monkeypatch.setenv("RDMAMW_METRICS_MAX_PEERS", "100")
    observe.register(Fake(99, bytes=1))
    again = {peer for (_, peer), _ in rows().items()}
    assert again == own | {"other", "99"}


def test_no_peer_of_its_own_at_a_bound_of_zero(monkeypatch):
    monkeypatch.setenv("RDMAMW_METRICS_MAX_PEERS", "0")
    chans = [Fake(r, messages=1) for r in range(3)]
    for ch in chans:
        observe.register(ch)
    assert {k: v["rdmamw_messages_sent_total"] for k, v in rows().items()} == \
        {("fake", "other"): 3}


def test_a_closed_channel_keeps_its_counters_and_a_dropped_one_its_last():
    a, b, lst = make_pair()
    try:
        a.send_batch([b"x" * 8] * 5).wait()
        assert len(b.recv_batch(timeout=10)) == 5
        want = a.stats()["bytes"] + b.stats()["bytes"]
        a.close()
        b.close()
        row = rows()[("shm", lst.address)]
        assert (row["rdmamw_sent_bytes_total"], row["rdmamw_channels_open"]) == (want, 0)
    finally:
        lst.close()
    ch = Fake(1, bytes=4)
    observe.register(ch)
    rows()                          # its last reading: 4 bytes
    ch.counters["bytes"] = 9        # never read again: collected without a close
    del ch
    gc.collect()
    assert {k: (v["rdmamw_sent_bytes_total"], v["rdmamw_channels_open"])
            for k, v in rows().items() if k[0] == "fake"} == {("fake", "1"): (4, 0)}


def test_errors_count_each_failure_once():
    before = dict(errors.COUNTS)
    with pytest.raises(PeerNotFound):
        rdmamw.Channel.open(f"shm://{unique_name('nobody')}", timeout=0.2)
    try:
        try:
            raise PeerLost("the connection broke")
        except PeerLost as e:
            raise PeerLost(f"rank 3: {e}") from e     # the same failure, named
    except PeerLost:
        pass
    Timeout("waited")
    got = {k: errors.COUNTS[k] - before[k] for k in errors.KINDS}
    assert got == {"peer_lost": 1, "timeout": 1, "refused": 1, "protocol": 0}


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def test_the_snapshot_is_what_a_scrape_shows():
    pytest.importorskip("prometheus_client")
    import rdmamw.metrics as metrics
    port = metrics.serve(0, "127.0.0.1")
    a, b, lst = make_pair()
    try:
        a.send_batch([b"y" * 16] * 3).wait()
        assert len(b.recv_batch(timeout=10)) == 3
        scraped = scrape(port)
        snap = metrics.snapshot()
    finally:
        a.close()
        b.close()
        lst.close()
        metrics.stop()
    (row,) = snap["channels"]
    labels = {"rank": snap["rank"], "provider": row.pop("provider"), "peer": row.pop("peer")}
    from_scrape = {}
    for (name, ls), v in scraped.items():
        ls = dict(ls)
        if ls.get("peer") == labels["peer"]:
            strategy = ls.pop("strategy", None)
            assert ls == labels
            key = readings.sample(name, strategy=strategy) if strategy else name
            from_scrape[key] = v
    assert from_scrape == row
    assert row["rdmamw_sent_bytes_total"] == 48 and row["rdmamw_channels_open"] == 2
    assert {k: scraped[("rdmamw_errors_total", frozenset({"rank": "", "kind": k}.items()))]
            for k in errors.KINDS} == snap["errors"]
    # the connects' histograms: this pair's open and accept at least, as scraped
    connects = {}
    for (name, ls), v in scraped.items():
        ls = dict(ls)
        if name.startswith("rdmamw_connect_seconds_") and not name.endswith("_created"):
            h = connects.setdefault((ls["provider"], ls["outcome"]), {"buckets": []})
            if name.endswith("_bucket"):
                h["buckets"].append([float(ls["le"]), v])
            else:
                h[name.rpartition("_")[2]] = v
    assert connects == {(c.pop("provider"), c.pop("outcome")): c for c in snap["connects"]}
    assert connects[("shm", "opened")]["count"] >= 1
    assert connects[("shm", "accepted")]["count"] >= 1


OFF = """
import json, sys, threading, rdmamw
from rdmamw import observe
from tests.support.helpers import make_pair
a, b, lst = make_pair()
a.send_batch([b"z"]).wait()
out = {"prometheus_client": "prometheus_client" in sys.modules,
       "recording": observe.collective is not None,
       "connects": observe.connect is not None,
       "threads": sorted(t.name for t in threading.enumerate()
                         if "serve" in t.name or t.name.startswith("rdmamw-metrics"))}
if len(sys.argv) > 1:
    import urllib.request
    out["scrape"] = urllib.request.urlopen(
        f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode().count("rdmamw_sent_bytes_total")
print(json.dumps(out))
"""


def run_off(env: dict, *args: str) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", OFF, *args], cwd=root, text=True,
                          capture_output=True, timeout=60, env={**os.environ, **env})


def test_off_by_default_nothing_is_imported_or_started():
    p = run_off({})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"prometheus_client": False, "recording": False,
                                    "connects": False, "threads": []}


def test_the_setting_serves_the_endpoint_from_the_first_channel():
    pytest.importorskip("prometheus_client")
    port = free_ports(1)
    p = run_off({"RDMAMW_METRICS_PORT": str(port), "RDMAMW_METRICS_ADDR": "127.0.0.1"},
                str(port))
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert (got["prometheus_client"], got["recording"], got["connects"],
            len(got["threads"])) == (True, True, True, 1)
    assert got["scrape"] == 3       # HELP, TYPE and the one peer's sample


def test_a_bad_port_fails_the_open_naming_the_setting():
    p = run_off({"RDMAMW_METRICS_PORT": "http"})
    assert p.returncode != 0
    assert "ConfigError" in p.stderr and "RDMAMW_METRICS_PORT='http'" in p.stderr


def test_a_port_past_the_last_for_this_local_rank_is_a_config_error(monkeypatch):
    import rdmamw.metrics as metrics
    monkeypatch.setenv("RDMAMW_METRICS_PORT", "65535")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="65536"):
        metrics.serve()
    assert metrics._endpoint is None
