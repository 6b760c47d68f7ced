"""The torch.distributed backend "rdmamw" (rdmamw/torch): every operation and dtype
against torch's own reduction of all ranks' inputs (tests/support/torch_worker.py), the init
methods, new groups, and the faults of issue 16: mismatched calls, unsupported dtypes
and ops, a rank killed mid-all_reduce, a wrong world size or a missing rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rdmamw import config
from rdmamw.bootstrap.launch import free_port, job_env
from tests.integrations.test_collectives import ROOT, job
from tests.support.helpers import reap

torch = pytest.importorskip("torch")
WORKER = os.path.join(ROOT, "tests", "support", "torch_worker.py")


def tjob(n: int, scenario: str, cfg: dict | None = None, **kw) -> list[dict]:
    return job(n, scenario, cfg, worker=WORKER, **kw)


def raw(procs: list[subprocess.Popen], timeout: float = 90) -> list[tuple[int, list, str]]:
    """(exit code, its JSON lines, stderr) of each process."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        reap(procs)
    res = []
    for p, (out, err) in zip(procs, outs, strict=True):
        res.append((p.returncode, [json.loads(x) for x in out.splitlines()
                                   if x.startswith("{")], err))
    return res


def popen(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_operation_and_dtype_matches_torch(n):
    lengths = [0, 1, 5, 3000] if n <= 3 else [0, 1, 5]
    res = tjob(n, "ops", {"lengths": lengths}, timeout=240)
    # per length: 2 checks per reduce op (all_reduce, reduce) + 13 other operations;
    # 4 float dtypes x 5 ops, 6 integer / bool dtypes x 7 ops
    per_length = 4 * (2 * 5 + 13) + 6 * (2 * 7 + 13)
    assert [r["checks"] for r in res] == [per_length * len(lengths)] * n


def test_new_groups():
    res = tjob(3, "groups")
    assert [r["groups"] for r in res] == [{"a": 2}, {"b": 2}, {"a": 2, "b": 2}]


@pytest.mark.parametrize("how", ["launcher", "tcp", "file", "torchrun"])
def test_every_init_method(how, tmp_path):
    """env:// under rdmamw's launcher and under torchrun (its agent's store), tcp://
    and file:// with explicit ranks: the backend meets through torch's store only."""
    py = sys.executable
    env = {k: v for k, v in os.environ.items()}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if how == "launcher":
        procs = [popen([py, "-m", "rdmamw.bootstrap.launch", "-n", "2", "--", py, WORKER,
                        "hello"], env)]
    elif how == "torchrun":
        procs = [popen([py, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), WORKER, "hello"], env)]
    else:
        method = (f"tcp://127.0.0.1:{free_port()}" if how == "tcp"
                  else f"file://{tmp_path / 'store'}")
        cfg = json.dumps({"init_method": method})
        procs = [popen([py, WORKER, "hello", cfg],
                       {**job_env(r, 2, "127.0.0.1", 1, "t" * 64), "PYTHONPATH": env["PYTHONPATH"]})
                 for r in range(2)]
    res = raw(procs)
    assert all(code == 0 for code, _, _ in res), [err[-2000:] for _, _, err in res]
    lines = [r for _, rs, _ in res for r in rs]      # a launcher prints both ranks' lines
    assert sorted(r["rank"] for r in lines) == [0, 1]
    assert all(r["backend"] == "rdmamw" and r["size"] == 2 for r in lines), lines


def test_recv_from_any_source_takes_each_message_once_and_respects_the_tag():
    """Two ranks send 20 messages each to rank 0 at once; rank 0 receives 40 times from
    any source: every message once, with its true sender, each sender's in order; a
    receive of tag 9 leaves rank 1's earlier tag-7 message for the receive of tag 7."""
    res = tjob(3, "anysource", {"k": 20})
    got = res[0]["got"]
    assert all(src == sender for src, sender, _ in got), got        # the source is right
    for r in (1, 2):
        assert [i for src, _, i in got if src == r] == list(range(20)), got
    assert res[0]["tags"] == {"9": [2, 9.0], "7": [1, 7.0]}, res[0]


def test_a_subgroup_whose_members_disagree_fails_on_every_member():
    res = tjob(3, "disagree")
    for r in res:
        assert r["error"] and r["error"].startswith("ConfigError: new_group"), r
        assert "[0, 1]" in r["error"] and "[0, 1, 2]" in r["error"], r
        assert r["seconds"] < 10, r


def test_monitored_barrier_names_a_rank_that_died_within_the_timeout():
    res = tjob(3, "monitored", {"victim": 1, "timeout": 2}, expect_dead=(1,))
    assert len(res) == 2
    for r in res:
        assert r["error"] and r["error"].startswith("Timeout"), r
        assert "ranks [1] failed to pass monitoredBarrier" in r["error"], r
        assert r["seconds"] < 2 + 2, r


@pytest.mark.parametrize("kind, words", [("shape", "float32[101]"), ("dtype", "float64[100]"),
                                         ("op", "op=max")])
def test_mismatched_calls_raise_on_every_rank(kind, words):
    res = tjob(3, "mismatch", {"kind": kind})
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors, errors    # every rank, one message
    msg = errors.pop()
    assert msg.startswith("CollectiveMismatch") and words in msg and "rank 1" in msg, msg
    assert [r["after"] for r in res] == [3, 3, 3]


def test_unsupported_dtype_op_and_device_fail_before_sending():
    res = tjob(2, "unsupported")
    for r in res:
        e = r["errors"]
        assert e[0].startswith("UnsupportedTensor") and "uint64" in e[0], e
        assert e[1].startswith("UnsupportedOp") and "AVG" in e[1], e
        assert e[2].startswith("UnsupportedOp: ReduceOp.BXOR needs an integer"), e
        assert e[3].startswith("UnsupportedTensor") and "CPU tensors only" in e[3], e
        assert e[4].startswith("UnsupportedTensor") and "uint32" in e[4], e


def test_rank_killed_during_all_reduce():
    res = tjob(3, "die", {"victim": 1}, expect_dead=(1,))
    assert len(res) == 2
    for r in res:
        assert r["error"] and r["error"].startswith("PeerLost"), r
        assert r["seconds"] < 2.0, r


def test_world_size_other_than_the_launchers():
    """Launched as 2 ranks, asked for 3: rank 1 refuses at once (our check); rank 0,
    whose TCPStore waits for 3 clients, gets torch's store timeout."""
    res = tjob(2, "size", {"world_size": 3, "timeout": 4})
    assert "ConfigError" in res[1]["error"] and "started 2 ranks" in res[1]["error"], res
    assert res[1]["seconds"] < 2
    assert res[0]["error"] and res[0]["seconds"] < 4 + 5, res


def test_a_missing_rank_times_out_naming_it(tmp_path):
    """A world of 3 with rank 2 never started (file:// store: torch itself does not
    wait for the ranks): both ranks raise our Timeout naming rank 2 within the
    group's timeout."""
    cfg = json.dumps({"init_method": f"file://{tmp_path / 'store'}", "timeout": 3})
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [popen([sys.executable, WORKER, "size", cfg],
                   {**job_env(r, 3, "127.0.0.1", 1, "t" * 64), **env}) for r in range(2)]
    res = raw(procs)
    for code, (r,), err in res:
        assert code == 0, err[-2000:]
        assert "Timeout" in r["error"] and "ranks [2] of 3" in r["error"], r
        assert r["seconds"] < 3 + 3, r


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_ddp_trains_like_gloo(n, tmp_path):
    """DistributedDataParallel from one seed (ranks start with different parameters,
    so DDP's initial broadcast matters; 1 MB buckets, so several all_reduces overlap
    backward): the final parameters on rdmamw equal gloo's."""
    final = {}
    for backend in ("gloo", "rdmamw"):
        out = tmp_path / f"{backend}.pt"
        tjob(n, "ddp", {"backend": backend, "steps": 15, "out": str(out)})
        final[backend] = torch.load(out)
    assert len(final["gloo"]) == len(final["rdmamw"]) == 6
    for a, b in zip(final["gloo"], final["rdmamw"], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


# ---- in-process: meeting through a store -------------------------------------------


def test_store_join_names_missing_ranks_and_refuses_bad_descriptors():
    """bootstrap.kvstore.join on a torch HashStore: a rank that never publishes makes
    the join time out naming it; a descriptor that is not one is a ProtocolError."""
    import msgpack

    from rdmamw.bootstrap import kvstore
    from rdmamw.errors import ProtocolError, Timeout
    kv = torch.distributed.HashStore()
    with pytest.raises(Timeout, match=r"ranks \[1\] of 2 never published"):
        kvstore.join(kv, 0, 2, 0.3, "127.0.0.1", "t1")
    kv.set("t2/desc/1", msgpack.packb({"tcp": "http://evil", "host": "h"}))
    with pytest.raises(ProtocolError, match="rank 1's descriptor"):
        kvstore.join(kv, 0, 2, 5.0, "127.0.0.1", "t2")
    kv.set("t3/desc/1", b"\xc1 not msgpack")
    with pytest.raises(ProtocolError, match="rank 1's descriptor"):
        kvstore.join(kv, 0, 2, 5.0, "127.0.0.1", "t3")
    w = kvstore.join(kv, 0, 1, 5.0, "127.0.0.1", "t4")     # a world of one meets itself
    assert w.world_size == 1 and w.peers[0]["rank"] == 0 and w.job
    w.close()


def test_register_is_idempotent_and_exported(monkeypatch):
    """rdmamw.torch.register() (what Ray Train and other launchers call in each worker)
    returns the backend's name, any number of times: after the import registered it,
    a call changes nothing (the same registration object stays); where torch has no
    "rdmamw" (a worker whose torch state was reset), it registers it."""
    import torch.distributed as dist

    import rdmamw.torch
    assert "register" in rdmamw.torch.__all__
    before = dist.Backend._plugins["RDMAMW"]
    assert rdmamw.torch.register() == rdmamw.torch.register() == "rdmamw"
    assert dist.Backend._plugins["RDMAMW"] is before
    monkeypatch.setattr(dist.Backend, "_plugins", {})
    assert rdmamw.torch.register() == "rdmamw"
    assert dist.Backend._plugins["RDMAMW"].creator_fn is rdmamw.torch.create
    assert dist.Backend("rdmamw") == "rdmamw"
    assert dist.Backend.backend_capability["rdmamw"] == ["cpu"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [2, 0])
def test_the_survivors_of_a_lost_rank_shrink_the_group_and_go_on(victim):
    """4 ranks loop all_reduce; rank 2 dies. Each survivor's all_reduce raises naming
    it (``.rank``), rdmamw.torch.shrink gives the three a group of their own (ranks 0,
    1, 2) and its all_reduce is right: 1 + 2 + 4 = 7. Rank 0 too, though torch's
    store dies with it (the shrink's note for a re-join has nowhere to go)."""
    res = tjob(4, "lose", {"victim": victim, "at": 5, "timeout": 30},
               expect_dead=(victim,), timeout=150)
    alive = [r for r in range(4) if r != victim]
    assert sorted(r["rank"] for r in res) == alive
    for r in res:
        assert r["error"] and r["named"] == victim, r
        assert (r["new_size"], r["new_rank"]) == (3, alive.index(r["rank"])), r
        assert (r["sum"], r["same"]) == (float(sum(a + 1 for a in alive)), True), r
        assert r["shrink_s"] < 3.0, r


@pytest.mark.timeout(180)
def test_ddp_loses_a_rank_and_finishes_training_on_the_survivors():
    """4 ranks train a DDP model; rank 2 dies at step 3. Each survivor's backward
    raises naming rank 2 (before: a SIGSEGV in torch's reducer, which took the failed
    future's exception for tensors); it shrinks the group, wraps the model again on
    the survivors' group and finishes: the three end with the very same parameters."""
    res = tjob(4, "ddp_lose", {"victim": 2, "at": 3, "steps": 8, "timeout": 30},
               expect_dead=(2,), timeout=150)
    assert sorted(r["rank"] for r in res) == [0, 1, 3]
    for r in res:
        assert r["error"] and r["named"], r
        assert (r["new_size"], r["new_rank"]) == (3, [0, 1, 3].index(r["rank"])), r
        assert r["steps"] == 8 and r["shrink_s"] < 3.0, r
    assert res[0]["digest"] == res[1]["digest"] == res[2]["digest"]


def elastic_example(*args: str, provider: str = "shm") -> tuple[str, list[dict]]:
    """examples/torch_elastic.py with ``args`` as its docstring runs it (the local
    launcher, 4 ranks, --max-lost 1): the launcher's stderr and each process's result,
    by rank."""
    cmd = [sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", "4", "--max-lost", "1",
           "--", sys.executable, os.path.join(ROOT, "examples", "torch_elastic.py"), *args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RDMAMW_TOKEN", "RDMAMW_PROVIDER")}
    env["PYTHONPATH"] = ROOT
    if provider != "shm":
        env["RDMAMW_PROVIDER"] = provider
    p = subprocess.run(cmd, cwd=ROOT, env=config.without_launchers(env),
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[launch] rank 2 failed (killed by SIGKILL); the other 3 go on" in p.stderr
    return p.stderr, sorted((json.loads(x.split(" ", 1)[1]) for x in p.stdout.splitlines()
                             if x.startswith("result ")), key=lambda r: r["rank"])


def test_the_elastic_example_loses_a_rank_and_finishes_on_the_others():
    """examples/torch_elastic.py as its docstring runs it: the local launcher with
    --max-lost 1, rank 2 SIGKILLed at step 20 of 60. The launcher reports it and lets the
    others run on; each survivor names rank 2, shrinks to 3 ranks, finishes all 60
    steps with the very same parameters, and the fit converged (noise 0.01: mse ~1e-4)."""
    _, res = elastic_example("--lose", "2", "--at", "20", "--steps", "60")
    assert [(r["rank"], r["new_rank"], r["size"], r["steps"]) for r in res] == \
        [(0, 0, 3, 60), (1, 1, 3, 60), (3, 2, 3, 60)], res
    for r in res:
        assert "rank 2" in r["error"] and "shrunk to 3 ranks" in r["error"], r
        assert r["loss"] < 1e-3, r
    assert res[0]["state"] == res[1]["state"] == res[2]["state"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_the_elastic_example_takes_a_replacement_back_and_finishes_on_four(provider):
    """examples/torch_elastic.py --replace: rank 2 SIGKILLed at step 20 of 60, the three
    shrink and train on; a new process for rank 2 (its launcher environment) re-joins
    with rdmamw.torch.join while the three call rdmamw.torch.grow at step 40; DDP's
    wrap on the grown group gives the newcomer rank 0's model (its own is another).
    All four finish the 60 steps, ranks back in world order, with the very same
    state_dict (every tensor, exactly) and a converged fit."""
    _, res = elastic_example("--lose", "2", "--at", "20", "--steps", "60", "--replace",
                             "--back", "40", "--timeout", "60", provider=provider)
    assert [(r["rank"], r["new_rank"], r["size"], r["steps"]) for r in res] == \
        [(0, 0, 4, 60), (1, 1, 4, 60), (2, 2, 4, 60), (3, 3, 4, 60)], res
    for r in res[:2] + res[3:]:
        assert "rank 2" in r["error"] and "shrunk to 3 ranks" in r["error"], r
        assert "grown to 4 ranks" in r["error"], r
        assert r["loss"] < 1e-3 < r["first_loss"], r
    new = res[2]
    assert new["error"] == "joined at step 40", new
    # its first step was on the job's model (trained 40 steps), not its own fresh one
    assert new["loss"] < 1e-3 and new["first_loss"] < 0.1, new
    assert res[0]["state"] == res[1]["state"] == res[2]["state"] == res[3]["state"]
    assert sorted(res[0]["state"]) == ["bias", "weight"]


@pytest.mark.timeout(300)
def test_a_replacement_rejoins_and_the_grown_group_runs_collectives_and_p2p():
    """4 ranks loop all_reduce; rank 2 dies; the three shrink; a new process started
    with rank 2's environment calls rdmamw.torch.join (its default group) while the
    three call rdmamw.torch.grow: the four are ranks 0..3 again (world order), the
    all_reduce is 1 + 2 + 3 + 4 = 10 and a ring of send / recv reaches each rank from
    the previous one, the newcomer included (its p2p channels meet the new process)."""
    res = tjob(4, "grow", {"victim": 2, "at": 5, "timeout": 60}, expect_dead=(2,),
               timeout=200)
    new = res[0].pop("replacement")
    assert isinstance(new, dict), new
    assert new.pop("default") is True, new       # join: the newcomer's default group
    for r in [*res, new]:
        assert (r["new_rank"], r["new_size"]) == (r["rank"], 4), r
        assert (r["sum"], r["same"]) == (10.0, True), r
        assert r["from_prev"] == [float((r["rank"] - 1) % 4)] * 3, r
    assert sorted(r["rank"] for r in [*res, new]) == [0, 1, 2, 3]
    for r in res:
        assert r["named"] == 2 and "rank 2" in r["error"], r


def test_the_operations_are_spans_of_torchs_profiler(tmp_path):
    """Under torch.profiler every collective and send/recv of the backend is a
    ``record_function`` span rdmamw::<kind> (rdmamw/torch/profiling.py), in the
    profiler's events and its Chrome trace, the asynchronous all_reduce's too: its
    span ends with its work (on the work's future), not when the call returns, and
    not on the progress thread that ran it, whose events the profiler ignores."""
    out = tjob(2, "profiled", {"chrome": str(tmp_path / "chrome-%r.json")})
    both = {"rdmamw::allreduce": 2, "rdmamw::broadcast": 1, "rdmamw::barrier": 1}
    assert [o["events"] for o in out] == [{**both, "rdmamw::send": 1},
                                         {**both, "rdmamw::recv": 1}]
    assert [o["chrome"] for o in out] == [o["events"] for o in out]
    assert [o["value"] for o in out] == [4.0, 4.0]
    for o, p2p in zip(out, ("rdmamw::send", "rdmamw::recv"), strict=True):
        spans = o["spans"]
        assert [s[0] for s in spans] == ["rdmamw::allreduce"] * 2 + [
            "rdmamw::broadcast", "rdmamw::barrier", p2p]
        # one after the other: each ended (the async one with its work) before the next
        assert all(a[1] <= a[2] <= b[1] for a, b in zip(spans, spans[1:], strict=False))
    # rank 1 joined the asynchronous all_reduce half a second late: rank 0's span of it
    # lasted until its work was done, not until the call returned
    assert out[0]["spans"][1][2] - out[0]["spans"][1][1] > 100_000
