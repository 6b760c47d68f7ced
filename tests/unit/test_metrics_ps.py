"""The parameter servers' counters in the metrics (docs/metrics.md): rounds, gradients,
their staleness, DSANA's moved samples, read from each live KVServer at a scrape."""

from __future__ import annotations

import gc

import pytest

from rdmamw import observe
from rdmamw.metrics import readings
from rdmamw.ps.server import KVServer
from rdmamw.sched import Dsana

ROUNDS = 6


@pytest.fixture(autouse=True)
def no_servers(monkeypatch):
    monkeypatch.setattr(observe, "_servers", type(observe._servers)())


def run_rounds() -> tuple[KVServer, Dsana]:
    """A server of two workers, worker 1 five times slower and one version behind from
    the second round on: its rounds close with both gradients, DSANA moves samples
    to worker 0."""
    d = Dsana([0, 1], global_batch=64)
    srv = KVServer({0: None, 1: None}, consistency="lsp", scheduler=d)
    now = 0.0
    for r in range(ROUNDS):
        now += 1
        for w, seconds in ((0, 0.1), (1, 0.5)):
            d.observe(w, seconds, d.shares[w], now)
        v = srv.policy.version
        srv.policy.on_push(0, v, now, d.shares[0])
        srv.policy.on_push(1, v - 1 if r else v, now, d.shares[1])
        srv._close_round(now)
    return srv, d


def test_rounds_staleness_and_moved_samples_are_read_from_the_servers():
    assert readings.ps() == {}
    srv, d = run_rounds()
    assert d.stats["moved"] > 0
    want = {"rdmamw_ps_rounds_total": ROUNDS, "rdmamw_ps_round_timeouts_total": 0,
            "rdmamw_ps_gradients_applied_total": 2 * ROUNDS,
            "rdmamw_ps_gradients_dropped_total": 0,
            "rdmamw_ps_staleness_total": ROUNDS - 1,
            "rdmamw_ps_samples_moved_total": d.stats["moved"],
            "rdmamw_ps_plan_changes_total": d.stats["changes"],
            "rdmamw_ps_staleness_max": 1}
    assert readings.ps() == want
    srv2, d2 = run_rounds()         # two servers in the process: summed
    assert readings.ps() == {k: (v if k == "rdmamw_ps_staleness_max" else 2 * v)
                             for k, v in want.items()}
    del srv, srv2
    gc.collect()
    assert readings.ps() == {}      # a server gone takes its counters with it


def test_a_scrape_shows_them():
    pytest.importorskip("prometheus_client")
    from rdmamw.metrics.exporter import RdmamwCollector
    srv, _ = run_rounds()
    got = {s.name: s.value for fam in RdmamwCollector().collect()
           for s in fam.samples if s.name.startswith("rdmamw_ps_")}
    assert got == readings.ps()
    assert len(got) == len(readings.PS_COUNTERS) + 1
