"""The consistency rules as state machines, driven by random schedules of
workers of different speeds (simulated time, no processes): each model's invariant
must hold on every schedule."""

from __future__ import annotations

import random

import pytest

from rdmamw.ps.consistency import APPLY, DROP, PEND, Adaptive, Async, Consistency, Hybrid, Rounds


def simulate(spec: str, speeds: list[float], iters: int = 40, seed: int = 0,
             timeout: float = 1e9, hang: tuple[int, float] | None = None,
             pushes: list | None = None) -> dict:
    """Workers compute for speed * jitter time units, push, then read when allowed.
    Returns the policy's stats plus per-round bookkeeping the test checks; ``pushes``
    collects (worker, staleness, was it pending already, decision) of every push."""
    rng = random.Random(seed)
    n = len(speeds)
    pol = Consistency.parse(spec, round_timeout=timeout).policy(list(range(n)))
    t = 0.0
    base = {w: 0 for w in range(n)}
    done_at = {w: speeds[w] * rng.uniform(0.8, 1.2) for w in range(n)}   # next push
    reading: set[int] = set()
    count = {w: 0 for w in range(n)}
    applied_per_round: list[int] = []
    gaps: list[int] = []
    while any(c < iters for c in count.values()):
        for w in sorted(reading):
            if pol.can_read(w):
                reading.discard(w)
                gaps.append(pol.clock[w] - min(pol.clock[v] for v in pol.live))
                base[w] = pol.version
                extra = hang[1] if hang and hang[0] == w and count[w] == 3 else 0.0
                done_at[w] = t + speeds[w] * rng.uniform(0.8, 1.2) + extra
                if count[w] >= iters:
                    pol.lost(w)                    # finished: it says goodbye
        busy = [w for w in range(n) if w not in reading and count[w] < iters]
        if not busy:
            t += 0.01
        else:
            w = min(busy, key=lambda v: done_at[v])
            deadline = pol.opened + pol.timeout if getattr(pol, "pending", None) else None
            if deadline is not None and t <= deadline < done_at[w]:
                t = deadline + 1e-6                # the round clock fires first
                while pol.close_due(t):
                    applied_per_round.append(len(pol.close(t)))
                continue
            t = max(t, done_at[w])
            was_pending = w in getattr(pol, "pending", ())
            d = pol.on_push(w, base[w], t)
            if pushes is not None:
                pushes.append((w, pol.version - base[w], was_pending, d))
            assert d in (APPLY, PEND, DROP)
            count[w] += 1
            reading.add(w)
        while pol.close_due(t):
            applied_per_round.append(len(pol.close(t)))
    return {**pol.stats, "per_round": applied_per_round, "gaps": gaps, "policy": pol}


SPEEDS = [[1.0, 1.0, 1.0], [1.0, 1.3, 3.0], [0.5, 1.0, 1.0, 4.0], [1.0, 2.0, 2.0, 2.0, 7.0]]


@pytest.mark.parametrize("speeds", SPEEDS)
@pytest.mark.parametrize("seed", range(3))
def test_bsp_applies_exactly_n_per_round(speeds, seed):
    r = simulate("bsp", speeds, seed=seed)
    n = len(speeds)
    full = [k for k in r["per_round"] if k == n]
    assert len(full) == 40 and r["dropped"] == 0 and r["max_staleness"] == 0
    assert set(r["per_round"]) == {n}


@pytest.mark.parametrize("speeds", SPEEDS)
@pytest.mark.parametrize("s", [0, 1, 3])
def test_ssp_never_lets_the_gap_exceed_s(speeds, s):
    r = simulate(f"ssp:{s}", speeds, seed=s)
    assert max(r["gaps"]) <= s and r["max_gap"] == max(r["gaps"])   # the stat is the gap read at
    if s and speeds[-1] > 2 * speeds[0]:
        assert max(r["gaps"]) == s           # the fast worker does run ahead


@pytest.mark.parametrize("speeds", SPEEDS[1:])
def test_asp_never_waits(speeds):
    r = simulate("asp", speeds)
    assert r["applied"] == 40 * len(speeds) and r["dropped"] == 0
    assert r["policy"].version == r["applied"]       # one model version per gradient


@pytest.mark.parametrize("speeds", SPEEDS)
@pytest.mark.parametrize("k, bound", [(1, 0), (2, 1), (2, 3), (3, 2)])
def test_lsp_never_applies_a_gradient_older_than_its_bound(speeds, k, bound):
    r = simulate(f"lsp:{k}:{bound}", speeds, seed=k + bound)
    assert r["max_staleness"] <= bound
    assert r["below_quorum"] == 0
    pol = r["policy"]
    assert r["applied"] + r["dropped"] == 40 * len(speeds)
    assert pol.version == len(r["per_round"])


def test_lsp_closes_rounds_with_the_first_k():
    r = simulate("lsp:2:12", [1.0, 1.0, 10.0])
    assert r["per_round"].count(2) > r["per_round"].count(3)   # the straggler is not awaited
    assert r["dropped"] == 0                # 10x slower: about 10 rounds stale, within 12
    r = simulate("lsp:2:5", [1.0, 1.0, 10.0])
    assert r["dropped"] > 0 and r["max_staleness"] <= 5


def test_asp_counts_staleness_and_merged_gradients():
    pol = Consistency.parse("asp").policy([0, 1])
    assert [pol.on_push(w, 0, 0.0) for w in (0, 1)] == [APPLY, APPLY]   # 1 on version 1
    assert pol.on_push(0, 2, 0.0) == APPLY                               # fresh again
    assert (pol.version, pol.merged, pol.stats["max_staleness"]) == (3, 3, 1)


def test_lsp_1_closes_a_round_on_the_first_fresh_gradient():
    pol = Consistency.parse("lsp:1").policy([0, 1, 2])
    assert pol.on_push(2, 0, 0.0) == PEND and pol.close_due(0.0) and pol.close(0.0) == [2]


def test_a_late_gradient_joins_the_round_but_does_not_close_it():
    pol = Consistency.parse("lsp:2:5").policy([0, 1, 2])
    assert pol.on_push(0, 0, 0.0) == PEND and pol.on_push(1, 0, 0.0) == PEND
    assert pol.close_due(0.0) and sorted(pol.close(0.0)) == [0, 1]       # version 1
    assert pol.on_push(2, 0, 1.0) == PEND                 # late: computed on version 0
    assert pol.on_push(0, 1, 1.0) == PEND and not pol.close_due(1.0)   # 1 fresh of 2
    assert pol.on_push(1, 1, 1.0) == PEND and pol.close_due(1.0)
    assert pol.close(1.0) == [2, 0, 1] and pol.stats["below_quorum"] == 0


def test_a_round_with_every_live_worker_in_it_closes_even_with_late_ones(caplog):
    pol = Consistency.parse("lsp:3:2", round_timeout=5.0).policy([0, 1, 2])
    pol.on_push(0, 0, 0.0), pol.on_push(1, 0, 0.0)
    with caplog.at_level("WARNING", logger="rdmamw.ps"):
        assert pol.close_due(6.0) and sorted(pol.close(6.0)) == [0, 1]  # timed out without 2
    assert [r.getMessage() for r in caplog.records] == [
        "rdmamw.ps: round 0 closed after 5.0 s without workers [2]"]
    assert pol.stats["below_quorum"] == 1 and pol.stats["timeouts"] == 1
    pol.on_push(2, 0, 7.0), pol.on_push(0, 1, 7.0)
    assert not pol.close_due(7.0)
    pol.on_push(1, 1, 7.0)                    # 2 fresh < 3, but nobody else is left
    assert pol.close_due(7.0) and len(pol.close(7.0)) == 3 and pol.stats["below_quorum"] == 1


@pytest.mark.parametrize("speeds", SPEEDS)
def test_alsp_keeps_its_bound_and_finds_the_fast_group(speeds):
    r = simulate("alsp:1", speeds)
    assert r["max_staleness"] <= 1 and r["below_quorum"] == 0


@pytest.mark.parametrize("speeds", SPEEDS)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_hybrid_syncs_fresh_gradients_and_applies_stale_ones_at_once(speeds, k):
    pushes: list = []
    r = simulate(f"hybrid:{k}", speeds, seed=k, pushes=pushes)
    n = len(speeds)
    for _w, staleness, was_pending, d in pushes:
        assert d == (PEND if staleness == 0 and not was_pending else APPLY)
    assert r["dropped"] == 0 and r["below_quorum"] == 0          # nothing is thrown away
    assert max(r["per_round"]) <= n          # (below k only once finished workers left)
    pol = r["policy"]
    assert pol.version == len(r["per_round"])                    # async applies: no version
    assert r["merged"] + len(pol.pending) == 40 * n == len(pushes)
    assert r["async"] == sum(d == APPLY for *_, d in pushes)


def test_hybrid_lets_a_straggler_work_asynchronously():
    r = simulate("hybrid:2", [1.0, 1.0, 4.0])
    # while the fast pair runs (40 rounds of 2, never waiting), the straggler's ~10
    # gradients are all stale and applied at once; alone afterwards, it is fresh
    assert r["per_round"].count(2) == 40 and r["async"] >= 9 and r["max_staleness"] >= 3


def test_alsp_plans_k_and_groups_from_times():
    pol = Adaptive([0, 1, 2, 3], bound=1, timeout=10, ratio=1.5, global_every=0)
    for w, sec in enumerate([1.0, 1.1, 1.9, 5.0]):
        pol.observe(w, sec)
    assert pol.groups == [[0, 1], [2], [3]]
    assert pol.k == 4            # leaving 3 out at k=3 means staleness ceil(5/1.9)-1 = 2 > 1
    pol2 = Adaptive([0, 1, 2], bound=2, timeout=10, ratio=1.5, global_every=0)
    for w, sec in enumerate([1.0, 1.05, 2.5]):
        pol2.observe(w, sec)
    assert pol2.k == 2 and pol2.groups == [[0, 1], [2]]
    assert (pol2.stats["k"], pol2.stats["groups"]) == (2, [[0, 1], [2]])   # what it reports
    pol3 = Adaptive([0, 1, 2], bound=2, timeout=10, ratio=1.5, global_every=0)
    for w, sec in enumerate([2.5, 1.05, 1.0]):      # the fast ones are not the low ranks
        pol3.observe(w, sec)
    assert pol3.k == 2 and pol3.groups == [[2, 1], [0]]
    pol2.lost(2)
    assert pol2.k == 2 and pol2.groups == [[0, 1]]


def test_alsp_at_its_limits():
    """A time exactly ``ratio`` x the group's fastest joins the group; a group's
    round takes its slowest member's time (2.7 / 1.4 -> within bound 1 behind);
    global_every=1 makes every round global."""
    pol = Adaptive([0, 1, 2], bound=1, timeout=10, ratio=1.5, global_every=0)
    for w, sec in enumerate([1.0, 1.5, 4.0]):
        pol.observe(w, sec)
    assert pol.groups == [[0, 1], [2]]
    for w, sec in enumerate([1.0, 1.4, 2.7]):
        pol.observe(w, sec)
    assert (pol.k, pol.groups, pol.quorum()) == (2, [[0, 1], [2]], 2)
    pol.global_every = 1
    assert pol.quorum() == 3
    pol.global_every = 4                   # the 4th, 8th, ... round (versions 3, 7) is global
    quorums = []
    for v in range(8):
        pol.version = v
        quorums.append(pol.quorum())
    assert quorums == [2, 2, 2, 3, 2, 2, 2, 3]
    for w, sec in enumerate([0.1, 0.4, 1.0]):      # sub-second times: the same rule
        pol.observe(w, sec)
    assert (pol.k, pol.groups) == (3, [[0], [1], [2]])


def test_a_round_times_out_counting_from_its_first_gradient():
    pol = Consistency.parse("lsp:3:2", round_timeout=5.0).policy([0, 1, 2])
    pol.on_push(0, 0, 0.0), pol.on_push(1, 0, 3.0)
    assert not pol.close_due(4.9) and pol.close_due(5.5)


def test_alsp_loses_a_worker_that_never_reported_a_time():
    pol = Adaptive([0, 1, 2], bound=1, timeout=10, ratio=1.5, global_every=0)
    pol.observe(0, 1.0), pol.observe(1, 1.0)
    pol.lost(2)                                  # no time of its own: nothing to forget
    assert pol.live == {0, 1} and pol.k == 2 and pol.groups == [[0, 1]]


def test_alsp_is_bsp_until_every_worker_has_a_time():
    pol = Adaptive([0, 1, 2], bound=1, timeout=10, ratio=1.5, global_every=0)
    assert pol.quorum() == 3 and pol.groups == [[0, 1, 2]]
    pol.observe(0, 1.0)
    assert pol.quorum() == 3


def test_a_silent_worker_times_out_of_bsp_and_its_late_gradient_is_dropped():
    r = simulate("bsp", [1.0, 1.0, 1.0], timeout=5.0, hang=(1, 50.0))
    assert r["timeouts"] >= 1 and r["dropped"] >= 1 and r["max_staleness"] == 0
    assert r["timeouts"] == r["below_quorum"] >= 2           # each timed-out round counted


def test_lost_workers_leave_the_quorum():
    pol = Consistency.parse("bsp").policy([0, 1, 2])
    assert pol.on_push(0, 0, 0.0) == PEND
    assert not pol.close_due(0.0)
    pol.lost(2)
    assert pol.on_push(1, 0, 0.0) == PEND and pol.close_due(0.0)
    assert sorted(pol.close(0.0)) == [0, 1]


@pytest.mark.parametrize("text, err", [("nope", "one of"), ("ssp:-1", "negative"),
                                       ("hybrid:2:dc-1", "negative"),
                                       ("asp:dcx", "cannot read"), ("lsp:a", "cannot read")])
def test_parse_errors(text, err):
    with pytest.raises(ValueError, match=err):
        Consistency.parse(text)


def test_parse():
    c = Consistency.parse("lsp:3:2")
    assert (c.mode, c.k, c.bound) == ("lsp", 3, 2)
    c = Consistency.parse("lsp:3")                    # the bound keeps its default
    assert (c.mode, c.k, c.bound) == ("lsp", 3, 1)
    assert Consistency.parse("ssp:4").s == 4
    assert Consistency.parse("ALSP:3").bound == 3
    h = Consistency.parse("hybrid:3")
    assert (h.mode, h.k, h.dc) == ("hybrid", 3, Consistency.HYBRID_DC)
    assert Consistency.parse("hybrid:3:dc0.5").dc == 0.5
    assert Consistency.parse("hybrid", dc=0.0).dc == 0.0
    assert (Consistency.parse("ssp:2:dc0.1").s, Consistency.parse("ssp:2:dc0.1").dc) == (2, 0.1)
    assert Consistency.parse("bsp").dc == 0.0


@pytest.mark.parametrize("spec, kind, fields", [
    ("asp", Async, {"s": None}),
    ("ssp:2", Async, {"s": 2}),
    ("bsp", Rounds, {"k": 0, "bound": 0, "timeout": 10.0}),   # docs/ps.md: default 10 s
    ("lsp:2:3", Rounds, {"k": 2, "bound": 3, "timeout": 10.0}),
    ("lsp", Rounds, {"k": 0, "bound": 1}),                     # k 0: every live worker
    ("hybrid", Hybrid, {"k": 0}),
    ("hybrid:2", Hybrid, {"k": 2, "bound": 0, "timeout": 10.0}),
    ("alsp:1", Adaptive, {"bound": 1, "ratio": 1.5, "global_every": 4, "timeout": 10.0}),
])
def test_each_mode_makes_its_own_policy(spec, kind, fields):
    pol = Consistency.parse(spec).policy([0, 1, 2])
    assert type(pol) is kind
    assert {f: getattr(pol, f) for f in fields} == fields


@pytest.mark.parametrize("spec", ["bsp", "asp", "ssp:1", "lsp:2:1", "alsp:1", "hybrid:2"])
def test_each_workers_clock_counts_its_pushes(spec):
    pushes: list = []
    r = simulate(spec, [1.0, 1.3, 4.0], iters=12, pushes=pushes)
    assert r["policy"].clock == {w: 12 for w in range(3)} == {
        w: sum(p[0] == w for p in pushes) for w in range(3)}


def test_round_sizes_are_counted():
    r = simulate("bsp", [1.0, 1.0], iters=5)
    assert r["round_sizes"] == {2: 5}


def test_blocks_respect_the_eager_limit_and_cover_the_array():
    import numpy as np

    from rdmamw.ps import wire
    a = np.arange(1001, dtype=np.float64)
    parts = list(wire.blocks(a, 800))
    assert all(b.nbytes <= 800 for _, b in parts)
    assert np.array_equal(np.concatenate([b for _, b in parts]), a)
    assert [o for o, _ in parts] == list(range(0, 1001, 100))
    assert list(wire.blocks(np.zeros(0), 64))[0][1].size == 0      # empty arrays: one block
    assert wire.shard("W1", 3) == wire.shard("W1", 3)
    assert {wire.shard(k, 2) for k in range(9)} == {0, 1}


def test_servers_that_close_a_round_with_different_workers_do_not_wait_on_each_other():
    """Each server decides its rounds alone. Server 0 heard workers 0, 1, 2 first and
    server 1 workers 0, 1, 3, so worker 3 is late on server 0 and worker 2 on server 1.
    A worker reads from both before its next gradient; if a late gradient held its
    worker's reads, worker 3 would wait on server 0 for a round that needs worker 2's
    fresh gradient, and worker 2 on server 1 for worker 3's (until round_timeout)."""
    servers = [Consistency.parse("lsp:3:2").policy([0, 1, 2, 3]) for _ in range(2)]
    for pol, first, late in ((servers[0], (0, 1, 2), 3), (servers[1], (0, 1, 3), 2)):
        for w in first:
            assert pol.on_push(w, 0, 0.0) == PEND
        assert pol.close_due(0.0) and sorted(pol.close(0.0)) == list(first)
        assert pol.on_push(late, 0, 0.0) == PEND          # joins round 1, late
    readers = {w: all(pol.can_read(w) for pol in servers) for w in range(4)}
    assert readers == {0: True, 1: True, 2: True, 3: True}
    for pol in servers:                                   # every fresh gradient of round 1
        for w in range(4):
            assert pol.on_push(w, 1, 1.0) == PEND
            assert not pol.can_read(w)                    # a fresh one waits for its round
        assert pol.close_due(1.0) and len(pol.close(1.0)) == 5
    assert all(pol.can_read(w) for pol in servers for w in range(4))


def test_with_samples_the_quorum_is_that_share_of_the_batch():
    """DSANA gives workers unequal shares; K of n workers then means K/n of the
    global batch in fresh samples, so a worker left with 3 of 64 samples (fast again
    on so little) cannot close a round of lsp:1 alone, which it did, over and over:
    the model trained on 3-sample steps while the big share's gradients came too
    late and were dropped."""
    pol = Consistency.parse("lsp:1:2").policy([0, 1])
    pol.on_push(0, 0, 0.0, 61), pol.on_push(1, 0, 0.0, 3)     # round 0: shares learnt
    assert pol.close_due(0.0) and sorted(pol.close(0.0)) == [0, 1]
    assert pol.on_push(1, 1, 1.0, 3) == PEND and not pol.close_due(1.0)   # 3 < 32 of 64
    assert not pol.can_read(1)                            # its round must close first
    assert pol.on_push(0, 1, 1.0, 61) == PEND and pol.close_due(1.0)
    assert sorted(pol.close(1.0)) == [0, 1]
    assert pol.on_push(0, 2, 2.0, 61) == PEND and pol.close_due(2.0)  # 61 >= 32 alone
    # no samples reported: K counts gradients, as before
    pol = Consistency.parse("lsp:1:2").policy([0, 1])
    assert pol.on_push(1, 0, 0.0) == PEND and pol.close_due(0.0)


@pytest.mark.parametrize("spec", ["bsp", "lsp:2:1", "alsp:1", "hybrid:2"])
def test_a_round_model_takes_a_joiner_only_between_rounds_and_waits_for_it_after(spec):
    pol = Consistency.parse(spec).policy([0, 1, 2])
    pol.lost(2)                                     # worker 2 died
    assert pol.boundary()
    assert pol.on_push(0, 0, 0.0) == PEND
    assert not pol.boundary()                       # a round is open: not now
    assert pol.on_push(1, 0, 0.0) == PEND
    assert pol.close_due(0.0) and sorted(pol.close(0.0)) == [0, 1]   # not waiting for 2
    assert pol.boundary()
    pol.join(2)                                     # its replacement, at the boundary
    assert pol.live == {0, 1, 2} and pol.clock[2] == 0
    for w in (0, 1):
        pol.on_push(w, 1, 1.0)
    if spec in ("bsp", "alsp:1"):                   # everybody: its gradient too
        assert not pol.close_due(1.0)
        pol.on_push(2, 1, 1.0)
    assert pol.close_due(1.0)
    done = pol.close(1.0)
    assert sorted(done) == ([0, 1, 2] if spec in ("bsp", "alsp:1") else [0, 1])
    assert pol.stats["max_staleness"] == 0 and pol.stats["dropped"] == 0


def test_a_new_worker_index_joins_a_round_model():
    pol = Consistency.parse("bsp").policy([0, 1])
    pol.join(5)
    assert pol.workers == [0, 1, 5] and pol.quorum() == 3
    for w in (0, 1):
        pol.on_push(w, 0, 0.0)
    assert not pol.close_due(0.0)
    pol.on_push(5, 0, 0.0)
    assert pol.close(0.0) == [0, 1, 5]


def test_ssp_counts_a_joiners_staleness_from_the_current_clock():
    """The newcomer starts at the slowest live clock: nobody's read waits for it to
    catch up, and it reads at once; from then on it is held to the bound as any."""
    pol = Consistency.parse("ssp:1").policy([0, 1, 2])
    for _ in range(5):
        pol.on_push(0, 0, 0.0)
    for _ in range(4):
        pol.on_push(1, 0, 0.0)
    pol.lost(2)
    assert pol.can_read(0) and pol.can_read(1)
    pol.join(2)
    assert pol.clock[2] == 4
    assert pol.can_read(0) and pol.can_read(1) and pol.can_read(2)
    pol.on_push(0, 0, 0.0)                          # 6 against 4: held
    assert not pol.can_read(0)
    pol.on_push(2, 0, 0.0)
    pol.on_push(1, 0, 0.0)
    assert pol.can_read(0)


def test_alsp_is_bsp_again_until_a_joiner_reports_its_time():
    pol = Consistency.parse("alsp:1").policy([0, 1, 2])
    assert isinstance(pol, Adaptive)
    for w, t in ((0, 1.0), (1, 1.0), (2, 1.8)):
        pol.observe(w, t)
    assert pol.k == 2
    pol.lost(2)
    pol.join(2)
    assert pol.k == 0 and pol.quorum() == 3
    pol.observe(2, 1.0)
    assert pol.k == 3


def test_asp_takes_a_joiner_at_any_time():
    pol = Consistency.parse("asp").policy([0, 1])
    pol.on_push(0, 0, 0.0)
    assert pol.boundary()
    pol.join(2)
    assert pol.can_read(2) and pol.on_push(2, 1, 0.0) == APPLY
    assert pol.stats["max_staleness"] == 0
