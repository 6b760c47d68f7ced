"""bench/chaos.py, the chaos test of rank failures, tested itself: a tiny run (two
trials of a fixed seed: a killed rank in the broadcast/allgather layer on tcp, another
on shm) passes and prints its summary, and the judge of a
survivor's line counts what is wrong with it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.integrations.test_bootstrap import ROOT

SCRIPT = os.path.join(ROOT, "bench", "chaos.py")


def chaos_module():
    spec = importlib.util.spec_from_file_location("chaos", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["chaos"] = mod          # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(150)
def test_a_tiny_chaos_run_passes(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("RDMAMW_PROVIDER", None)
    # (kills in the collective layers only: the shortest trials)
    p = subprocess.run([sys.executable, SCRIPT, "--trials", "2", "--seed", "2",
                        "--faults", "kill", "--layers", "allreduce,bcast_gather",
                        "--logs", str(tmp_path)], cwd=ROOT, env=env,
                       text=True,
                       capture_output=True, timeout=140)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "trial      2-0: 5 ranks tcp bcast_gather kill rank 0" in out, out
    assert "trial      2-1: 4 ranks shm bcast_gather kill rank 2" in out, out
    assert "[chaos] seed 2: 2 trials, 0 failed" in out, out
    assert ("hang 0, wrong 0, untyped 0, misnamed 0, shrink 0, stalled 0, crash 0, "
            "setup 0") in out, out
    assert "time to error after kill: p50" in out and "after stop" not in out


def test_the_judge_counts_wrong_results_untyped_errors_and_misnamed_ranks():
    chaos = chaos_module()
    plan = chaos.Plan("x-0", 4, "shm", "stream", "kill", 2, 0.5, 1)
    res = chaos.Result(plan)
    good = {"t": 10.5, "calls": 9, "wrong": 0, "error": "PeerLost", "named": 2, "msg": "",
            "stream_error": None, "stream_peer": None, "stream_msg": ""}
    chaos.judge(res, plan, 0, good, 10.0)
    assert res.problems == {} and res.times == [0.5]
    chaos.judge(res, plan, 1, {**good, "wrong": 1}, 10.0)
    chaos.judge(res, plan, 3, {**good, "named": 3}, 10.0)
    chaos.judge(res, plan, 3, {**good, "error": "Timeout"}, 10.0)
    chaos.judge(res, plan, 3, {**good, "stream_error": "PeerLost", "stream_peer": 1}, 10.0)
    chaos.judge(res, plan, 3, {**good, "stream_error": "ProtocolError",
                               "stream_peer": 2}, 10.0)
    assert {k: len(v) for k, v in res.problems.items()} == {
        "wrong": 1, "misnamed": 2, "untyped": 2}
    # a stream deadline passed on a partner that survived (held up in a collective by
    # the fault) is not a misnaming
    res = chaos.Result(plan)
    chaos.judge(res, plan, 1, {**good, "stream_error": "Timeout", "stream_peer": 0}, 10.0)
    assert res.problems == {}


def test_the_judge_wants_of_each_fault_its_own_errors():
    """A closed rank is PeerLost (its goodbye), never a Timeout; a dropped link may be
    either (the heartbeat or the deadline comes first), but nothing else."""
    chaos = chaos_module()
    good = {"t": 10.5, "calls": 9, "wrong": 0, "named": 2, "msg": "", "stream_error": None,
            "stream_peer": None, "stream_msg": ""}
    for fault, error, stream, bad in [
            ("close", "PeerLost", "ChannelClosed", {}),
            ("close", "Timeout", None, {"untyped": 1}),
            ("close", "PeerLost", "Timeout", {"untyped": 1}),
            ("drop", "PeerLost", "PeerLost", {}),
            ("drop", "Timeout", "Timeout", {}),
            ("drop", "ProtocolError", None, {"untyped": 1}),
            ("drop", "Timeout", "BufferTooSmall", {"untyped": 1})]:
        plan = chaos.Plan("x-0", 4, "tcp", "stream", fault, 2, 0.5, 1)
        res = chaos.Result(plan)
        chaos.judge(res, plan, 3, {**good, "error": error, "stream_error": stream,
                                   "stream_peer": 2 if stream else None}, 10.0)
        assert {k: len(v) for k, v in res.problems.items()} == bad, (fault, error, stream)


def test_a_line_that_comes_before_its_take_is_kept_for_it():
    """Rank 1 prints its error and shrink lines while rank 2's error line is still to
    come: the error take must keep rank 1's shrink line for the shrink take (it used to
    drop it, and rank 1 was reported to have exited before its shrink line)."""
    chaos = chaos_module()

    class Done:             # an ended rank: exit status 0
        def wait(self, timeout=None):
            return 0

    lines = chaos.Lines.__new__(chaos.Lines)
    lines.procs, lines.early = [Done(), Done(), Done()], []
    lines.q = chaos.queue.Queue()
    for r, line in [(1, '{"error": "a"}'), (1, '{"t_after": 1}'), (1, None),
                    (2, '{"error": "b"}'), (2, '{"t_after": 2}'), (2, None)]:
        lines.q.put((r, line))
    res = chaos.Result(chaos.Plan("x-0", 3, "shm", "allreduce", "kill", 0, 0.5, 1))
    until = chaos.time.time() + 1
    errs = lines.take({1, 2}, until, res, "error", ("error",))
    after = lines.take({1, 2}, until, res, "shrink", ("t_after",))
    assert (errs, after, res.problems) == ({1: {"error": "a"}, 2: {"error": "b"}},
                                           {1: {"t_after": 1}, 2: {"t_after": 2}}, {})
