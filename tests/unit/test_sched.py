"""DSANA's pure parts: the classifier, the share apportionment (property-tested), the
cost check, the sample-weighted gradient, and the scheduler's decisions in scenarios
with injected timings (no processes, no clocks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmamw.sched import (
    FAILED,
    FAST,
    NORMAL,
    STRAGGLER,
    Classifier,
    CostModel,
    Dsana,
    apportion,
    bounds,
    weighted_mean,
)

# -- apportionment ----------------------------------------------------------------------

weights_st = st.dictionaries(st.integers(0, 40), st.floats(1e-3, 1e3), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(total=st.integers(0, 5000), ws=weights_st, fr=st.tuples(st.floats(0, 1),
                                                                  st.floats(1, 4)))
def test_shares_sum_exactly_stay_in_bounds_and_follow_speed(total, ws, fr):
    lo, hi = bounds(total, len(ws), *fr)
    s = apportion(total, ws, lo, hi)
    assert sorted(s) == sorted(ws)
    assert sum(s.values()) == total                     # nothing unassigned, nothing twice
    assert all(lo <= x <= hi and x >= 0 for x in s.values())
    for a in ws:                                         # faster never gets (much) less
        for b in ws:
            if ws[a] >= ws[b]:
                assert s[a] >= s[b] - 1


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 5000), ws=weights_st)
def test_unbounded_shares_are_within_one_sample_of_the_exact_quota(total, ws):
    s = apportion(total, ws)
    tot = sum(ws.values())
    for w, x in s.items():
        assert abs(x - total * ws[w] / tot) < 1 + 1e-9


def test_apportion_rejects_impossible_requests_with_clear_errors():
    with pytest.raises(ValueError, match="cannot sum"):
        apportion(10, {0: 1.0, 1: 1.0}, lo=6)
    with pytest.raises(ValueError, match="cannot sum"):
        apportion(10, {0: 1.0, 1: 1.0}, hi=4)
    with pytest.raises(ValueError, match="finite"):
        apportion(10, {0: 1.0, 1: math.inf})
    with pytest.raises(ValueError, match="finite"):
        apportion(10, {0: 0.0})
    with pytest.raises(ValueError, match="no workers"):
        apportion(10, {})
    with pytest.raises(ValueError, match="negative"):
        apportion(-1, {0: 1.0})


def test_bounds_always_let_the_workers_cover_the_batch():
    for total in range(0, 60):
        for n in range(1, 9):
            lo, hi = bounds(total, n, 0.9, 1.0)
            assert n * lo <= total <= n * hi and lo >= 0


# -- the sample-weighted gradient equals the full-batch gradient -------------------------

@pytest.fixture(scope="module")
def mlp():
    pytest.importorskip("sklearn")
    from rdmamw.apps.demo import mlp
    d = mlp.load()
    return mlp, d.xtr[:200], d.ytr[:200]


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(1, 199), min_size=1, max_size=6, unique=True))
def test_weighted_share_gradients_equal_the_full_batch_gradient(mlp, cuts):
    m, x, y = mlp
    p = m.init_params(64)
    edges = [0, *sorted(cuts), 200]
    full = m.gradients(p, x, y)
    parts = [m.gradients(p, x[a:b], y[a:b]) for a, b in zip(edges, edges[1:], strict=False)]
    ns = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    for k in range(len(full)):
        got = weighted_mean((n, g[k]) for n, g in zip(ns, parts, strict=True))
        assert np.allclose(got, full[k], rtol=1e-4, atol=1e-6)
    if len(set(ns)) > 1:           # the plain mean of the parts would be wrong
        plain = np.mean([g[0] for g in parts], axis=0)
        assert not np.allclose(plain, full[0], rtol=1e-4, atol=1e-6)


def test_weighted_mean_rejects_nothing_to_average():
    with pytest.raises(ValueError):
        weighted_mean([])
    with pytest.raises(ValueError):
        weighted_mean([(0, np.ones(2))])
    with pytest.raises(ValueError):
        weighted_mean([(-1, np.ones(2)), (3, np.ones(2))])


# -- the cost check -----------------------------------------------------------------------

def test_a_move_that_costs_more_than_it_saves_is_not_taken():
    per = {0: 2e-3, 1: 1e-3}
    old, new = {0: 50, 1: 50}, {0: 33, 1: 67}           # saves 100 ms - 67 ms per round
    v = CostModel(sample_bytes=256, bandwidth=1e9).judge(old, new, per)
    assert v.take and v.moved == 17 and v.saved_s == pytest.approx(0.1 - 0.067)
    slow_net = CostModel(sample_bytes=10_000_000, bandwidth=1e9)  # 17 x 10 ms of transfer
    v = slow_net.judge(old, new, per)
    assert not v.take and v.cost_s > v.saved_s
    assert slow_net.__class__(sample_bytes=10_000_000, bandwidth=1e9, horizon=10
                              ).judge(old, new, per).take   # pays off over 10 rounds


def test_a_negligible_gain_is_not_taken():
    per = {0: 1.0e-3, 1: 1.03e-3}
    v = CostModel().judge({0: 100, 1: 100}, {0: 101, 1: 99}, per)     # 1 % faster
    assert v.saved_s > v.cost_s and not v.take                # below min_gain


def test_cost_model_rejects_nonsense():
    with pytest.raises(ValueError):
        CostModel(bandwidth=0)
    with pytest.raises(ValueError):
        CostModel(horizon=0)


# -- the classifier ------------------------------------------------------------------------

def test_classifier_hysteresis_keeps_a_borderline_worker_in_its_class():
    c = Classifier([0, 1, 2], alpha=1.0)
    seq = [1.35, 1.2, 1.25, 1.18, 1.2, 1.1]       # enter at 1.35, stay above 1.15, leave at 1.1
    got = []
    for t, r in enumerate(seq):
        for w in (1, 2):
            c.observe(w, 1.0, 1, t)
        c.observe(0, r, 1, t)
        got.append(c.update(t)[0])
    assert got == [STRAGGLER] * 5 + [NORMAL]


def test_classifier_enters_a_class_at_its_threshold_exactly():
    c = Classifier([0, 1, 2], alpha=1.0)
    for w, x in ((0, 1.3), (1, 1.0), (2, 0.8)):        # ratios to the median 1.0
        c.observe(w, x, 1, 0.0)
    assert c.update(0.0) == {0: STRAGGLER, 1: NORMAL, 2: FAST}


def test_classifier_with_zero_times_keeps_everybody_normal():
    c = Classifier([0, 1, 2], alpha=1.0)
    for w in range(3):
        c.observe(w, 0.0, 4, 0.0)                      # too fast to measure: median 0
    assert c.update(0.0) == dict.fromkeys(range(3), NORMAL)


def test_a_lost_worker_leaves_the_plan_and_the_counts_start_at_zero():
    d = Dsana([0, 1, 2], 30)
    assert {k: v for k, v in d.stats.items() if isinstance(v, int)} == {
        k: 0 for k, v in d.stats.items() if isinstance(v, int)}
    for w in range(3):
        d.observe(w, 1.0, 10, 0.0)
    d.lost(1)
    assert d.classes()[1] == FAILED and sorted(d.plan(0.5)) == [0, 2]


def test_classifier_marks_silent_workers_failed_not_slow_and_readmits_them():
    c = Classifier([0, 1, 2, 3], fail_after=2.0, alpha=1.0)
    for t in range(3):
        for w in range(4):
            c.observe(w, 1.0 if w else 0.5, 1, t)
        c.update(t)
    assert c.state[0] == FAST
    for t in range(3, 7):                          # worker 0 goes silent
        for w in (1, 2, 3):
            c.observe(w, 1.0, 1, t)
        c.update(t)
    assert c.state[0] == FAILED and c.median() == 1.0
    c.observe(0, 1.0, 1, 7)
    assert c.update(7)[0] == NORMAL


def test_classifier_rejects_bad_reports():
    c = Classifier([0])
    for bad in [(-1.0, 1), (math.nan, 1), (1.0, -1)]:
        with pytest.raises(ValueError):
            c.observe(0, *bad, now=0)
    with pytest.raises(KeyError):
        c.observe(9, 1.0, 1, 0)
    with pytest.raises(ValueError):
        Classifier([0], slow_enter=1.1, slow_exit=1.2)


# -- scenarios: the scheduler with injected timings ----------------------------------------

def simulate(per_sample, rounds: int, batch: int = 256, silent=lambda r, w: False, **kw):
    """Run ``rounds`` BSP rounds: worker w takes ``share * per_sample(r, w)`` s. Returns
    the scheduler and per-round (assignment, classes, round time)."""
    workers = list(range(4)) if "workers" not in kw else kw.pop("workers")
    d = Dsana(workers, batch, **kw)
    now, log = 0.0, []
    plan = d.assignment()
    for r in range(rounds):
        times = {w: share * per_sample(r, w) for w, (_, share) in plan.items()
                 if not silent(r, w)}
        now += max(times.values())
        for w, t in times.items():
            d.observe(w, t, plan[w][1], now)
        for w in set(workers) - set(plan):             # no share: only a sign of life
            if not silent(r, w):
                d.observe(w, 0.0, 0, now)
        plan = d.plan(now)
        check_plan(plan, batch)
        log.append((plan, d.classes(), max(times.values())))
    return d, log


def check_plan(plan, batch):
    o = 0
    for w in sorted(plan):
        off, n = plan[w]
        assert off == o and n >= 1
        o += n
    assert o == batch


@pytest.mark.parametrize("factor,expect", [(2, 1 / 7), (4, 1 / 13)])
def test_static_straggler_gets_its_speed_share_and_the_round_shrinks(factor, expect):
    d, log = simulate(lambda r, w: 1e-3 * (factor if w == 0 else 1), 30)
    plan, classes, _ = log[-1]
    assert classes == {0: STRAGGLER, 1: NORMAL, 2: NORMAL, 3: NORMAL}
    assert abs(plan[0][1] - 256 * expect) <= 2
    bsp_round = 64 * factor * 1e-3
    assert log[-1][2] <= (1 / (1 + 3 / factor) * 1.02 + 0.01) * 256 * factor * 1e-3
    assert log[-1][2] < 0.6 * bsp_round
    first_change = next(i for i, (p, _, _) in enumerate(log) if p[0][1] != 64)
    assert first_change <= 2                           # found within two rounds
    assert [c[0] for _, c, _ in log[first_change:]] == [STRAGGLER] * (30 - first_change)
    assert d.stats["changes"] <= 6                     # settles, does not keep shuffling


def test_straggler_that_appears_mid_run_and_recovers():
    slow = range(10, 30)
    d, log = simulate(lambda r, w: 1e-3 * (2 if w == 0 and r in slow else 1), 45)
    cls0 = [c[0] for _, c, _ in log]
    assert cls0[:10] == [NORMAL] * 10
    assert all(p[w][1] == 64 for p, _, _ in log[:10] for w in range(4))
    start = cls0.index(STRAGGLER)
    assert 10 <= start <= 12
    stop = start + cls0[start:].index(NORMAL)
    assert 30 <= stop <= 36                             # recovered, noticed within a few rounds
    assert cls0[start:stop] == [STRAGGLER] * (stop - start)   # no flapping in between
    assert cls0[stop:] == [NORMAL] * (45 - stop)
    assert log[20][0][0][1] < 45                        # the slow phase was rebalanced
    assert all(p[w][1] == 64 for p, _, _ in log[-3:] for w in range(4))


def test_two_speed_classes_share_by_speed():
    d, log = simulate(lambda r, w: 1e-3 * (1 if w < 2 else 2), 25)
    plan, classes, t = log[-1]
    assert classes == {0: FAST, 1: FAST, 2: STRAGGLER, 3: STRAGGLER}
    assert [plan[w][1] for w in range(4)] in ([85, 85, 43, 43], [86, 85, 43, 42],
                                               [85, 86, 42, 43], [86, 86, 42, 42])
    assert t < 0.7 * 128 * 2e-3


def test_no_straggler_with_noise_moves_nothing():
    rng = np.random.default_rng(0)
    noise = rng.uniform(0.9, 1.1, size=(60, 4))
    d, log = simulate(lambda r, w: 1e-3 * noise[r, w], 60)
    assert d.stats["changes"] == 0
    assert all(p[w][1] == 64 for p, _, _ in log for w in range(4))


def test_a_silent_worker_is_failed_and_its_samples_go_to_the_others():
    d, log = simulate(lambda r, w: 1e-3 * (2 if w == 0 else 1), 30,
                      silent=lambda r, w: w == 3 and 10 <= r < 20,
                      classifier=Classifier([0, 1, 2, 3], fail_after=0.2))
    cls3 = [c[3] for _, c, _ in log]
    assert FAILED in cls3[10:20] and cls3[-1] == NORMAL
    during = log[cls3.index(FAILED)][0]
    assert 3 not in during and sum(n for _, n in during.values()) == 256
    assert d.stats["membership_changes"] == 2


def test_a_move_the_cost_model_refuses_keeps_the_old_plan():
    cost = CostModel(sample_bytes=10**9, bandwidth=1e6)          # every sample costs 1000 s
    d, log = simulate(lambda r, w: 1e-3 * (2 if w == 0 else 1), 10, cost=cost)
    assert d.stats["changes"] == 0 and d.stats["refused"] >= 8
    assert log[-1][1][0] == STRAGGLER and log[-1][0][0][1] == 64
    assert not d.last.take and d.last.cost_s > d.last.saved_s


def test_dsana_rejects_bad_configs():
    with pytest.raises(ValueError, match="at least one worker"):
        Dsana([], 10)
    with pytest.raises(ValueError):
        Dsana([0, 1, 2], 2)
