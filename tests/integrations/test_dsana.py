"""DSANA end to end on the parameter server: multi-process BSP jobs on shm (started
by the local launcher, tests/support/dsana_job.py) whose result must equal plain BSP on the
whole batch, with the straggler given a smaller share; and the chunked, overlapped
push/pull path giving the same numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "support", "dsana_job.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

from test_ps import clean_env  # noqa: E402


def run(n: int, *args: str) -> tuple[dict, list[dict]]:
    p = subprocess.run([sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", str(n), "--",
                        sys.executable, JOB, *args], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    server = next(r for r in rows if r["role"] == "server")
    workers = sorted((r for r in rows if r["role"] == "worker"), key=lambda r: r["index"])
    return server, workers


def covers_every_round(workers: list[dict], batch: int) -> None:
    """Each round the shares tile [0, batch) exactly: no sample twice, none left out."""
    for r in range(len(workers[0]["plan"])):
        spans = sorted(tuple(w["plan"][r]) for w in workers if w["plan"][r][1] > 0)
        o = 0
        for off, share in spans:
            assert off == o
            o += share
        assert o == batch


def test_dsana_moves_work_off_the_straggler_and_still_makes_plain_bsp_steps():
    """Worker 0 reports 6x the others' compute per sample (synthetic timings: the
    scheduler's inputs are fixed, not sleeps on a loaded machine)."""
    server, workers = run(4, "--sched", "dsana", "--rounds", "30", "--slow", "100")
    for w in workers:
        assert w["max_rel_err"] < 1e-9 and w["moved"] > 0.1
    covers_every_round(workers, 60)
    assert [w["plan"][0][1] for w in workers] == [20] * 3
    last = [w["plan"][-1][1] for w in workers]
    # 120 vs 20 ms per sample: the plan the scheduler makes from those timings alone
    from tests.unit.test_sched import simulate
    _, log = simulate(lambda r, w: 1e-3 * (20 + (100 if w == 0 else 0)), 30, batch=60,
                      workers=[0, 1, 2])
    assert last == [log[-1][0][w][1] for w in range(3)] == [4, 28, 28]
    d = server["dsana"]
    assert d["changes"] >= 1 and d["classes"]["straggler"] == 1


def test_delay_compensation_leaves_bsp_with_weighted_shares_exact():
    """BSP gradients are never stale, so delay compensation (dc) corrects nothing: the
    per-sample weighted rounds with dc give the plain result (the server's weighted
    dc path, which compensates into a scratch array before weighting)."""
    server, workers = run(4, "--sched", "dsana", "--rounds", "10", "--slow", "100",
                          "--consistency", "bsp:dc0.1")
    assert server["mode"] == "bsp"
    for w in workers:
        assert w["max_rel_err"] < 1e-9 and w["compute_n"] == 10


def test_the_comparison_can_fail():
    """Workers that ignore the plan (each computes an equal share but the server is
    told DSANA's) break the tiling and the result: the checks above are not vacuous."""
    server, workers = run(4, "--sched", "dsana", "--rounds", "12", "--slow", "100",
                          "--ignore-plan")
    assert max(w["max_rel_err"] for w in workers) > 1e-3


def test_a_worker_the_scheduler_failed_is_served_with_share_0_and_rejoins():
    """Worker 0 starts 3 s late: the rounds close on their 0.3 s timeout without it and
    the scheduler marks it FAILED after 1 s of silence, so the server answers its init
    (and pulls) while it is outside the plan: share 0, the offset 0. Its first push (no
    samples, a sign of life) brings it back into the plan."""
    server, workers = run(4, "--sched", "dsana", "--rounds", "12", "--late", "0:3",
                          "--round-timeout", "0.3", "--fail-after", "1")
    assert [w["index"] for w in workers] == [0, 1, 2]
    assert workers[0]["plan"][0] == [0, 0]
    assert workers[0]["plan"][-1][1] > 0
    assert [w["plan"][0] for w in workers[1:]] == [[20, 20], [40, 20]]   # all three at first
    assert server["dsana"]["membership_changes"] >= 2 and server["timeouts"] >= 2


@pytest.mark.parametrize("sched", ["none", "dsana"])
def test_chunked_overlapped_push_and_pull_give_the_same_model(sched):
    server, workers = run(3, "--sched", sched, "--rounds", "15", "--stream", "--chunk",
                          "4096", "--slow", "50")
    for w in workers:
        assert w["max_rel_err"] < 1e-9 and w["compute_n"] == 15
        assert w["chunk"] == 4096                   # ps.start handed the block size on
    covers_every_round(workers, 60)


def test_worker_rejects_bad_chunks_samples_and_keys_before_sending():
    from rdmamw.ps import KVWorker
    with pytest.raises(ValueError, match="chunk"):
        KVWorker([], chunk=0)
    for thread in (False, True):
        w = KVWorker([], send_thread=thread)
        with pytest.raises(KeyError, match="unknown key"):
            w.push_part(["nope"], [bytearray(4)])
        with pytest.raises(ValueError, match="keys but"):
            w.push_part(["a", "b"], [bytearray(4)])
        with pytest.raises(ValueError, match="samples"):
            w.push_end(samples=-1)


# -- rdmamw demo --sched ----------------------------------------------------------------------

def test_demo_runs_bsp_with_and_without_dsana(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    from test_ps_demo import check_runs, demo
    out = tmp_path / "d.json"
    p = demo("--workers", "3", "--servers", "1", "--epochs", "2", "--compute-ms", "10",
             "--quiet", "--consistency", "bsp", "--sched", "none,dsana", "--json", str(out),
             "--plot", "", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "bsp+dsana" in p.stdout
    r = check_runs(out, ["bsp", "bsp+dsana"], 2)
    plain, dsana = r["runs"]
    assert plain["sched"] == {} and r["job"]["sched"] == "none,dsana"
    s = dsana["sched"]
    assert s["sched"] == "dsana" and s["global_batch"] == 96
    assert s["first_shares"] == [32, 32, 32] and sum(s["last_shares"]) == 96
    # which shares follow depends on measured (real) compute times: what the scheduler
    # makes of given timings is test_dsana_moves_work_off_the_straggler... above


def test_demo_rejects_an_unknown_scheduler(tmp_path):
    from test_ps_demo import demo
    p = demo("--sched", "fifo", cwd=tmp_path)
    assert p.returncode == 2 and "neither 'none' nor 'dsana'" in p.stderr


def test_share_hook_takes_the_assignment_and_counts_plan_changes():
    from types import SimpleNamespace

    from rdmamw.sched.hook import ShareHook
    node = SimpleNamespace(assignment=None, plan_shares=None)
    tr = SimpleNamespace(node=node, batch_size=32)
    h = ShareHook()
    h(tr)
    assert tr.batch_size == 32 and h.summary()["iterations"] == 0    # no scheduler: as is
    for plan in ([(0, 32, 96), [32, 32, 32]], [(0, 40, 96), [40, 40, 16]],
                 [(0, 40, 96), [40, 40, 16]]):
        node.assignment, node.plan_shares = plan
        h(tr)
    assert tr.batch_size == 40
    s = h.summary()
    assert s["first_shares"] == [32, 32, 32] and s["last_shares"] == [40, 40, 16]
    assert s["plan_changes"] == 1 and s["mean_shares"][2] == pytest.approx(64 / 3)
