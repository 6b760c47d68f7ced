"""Collectives: multi-process jobs on shm (tests/support/coll_worker.py checks every result
against numpy's reduction of all ranks' inputs) and in-process unit tests of the
pieces (schedules, policy, topology, argument errors)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rdmamw.bootstrap import World
from rdmamw.bootstrap.launch import spawn
from rdmamw.collectives import CollectiveMismatch, Communicator, allreduce, policy, topology
from rdmamw.collectives import api as coll
from rdmamw.collectives.tree import TREE_BYTES, binomial, chain
from rdmamw.collectives.tree import shape as tree_shape
from tests.integrations.test_bootstrap import clean_env
from tests.integrations.test_multihost import two_hosts  # noqa: F401 - the fixture
from tests.support.helpers import reap
from tests.support.netns import shape_link

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "support", "coll_worker.py")
#: the built-in cost model, whatever `rdmamw tune` left in ~/.config
UNTUNED = {"RDMAMW_COLL_CONFIG": os.path.join(ROOT, "tests", "no-such-config.json")}


def job(n: int, scenario: str, cfg: dict | None = None, timeout: float = 90,
        expect_dead: tuple = (), env: dict | None = None, worker: str = WORKER
        ) -> list[dict]:
    """Run ``n`` ranks of the worker; every rank (but ``expect_dead``) must succeed."""
    procs = spawn(n, [sys.executable, worker, scenario, json.dumps(cfg or {})], cwd=ROOT,
                  env={**UNTUNED, **(env or {})}, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
    outs = []
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        if r in expect_dead:
            assert p.returncode == 3, err
            continue
        assert p.returncode == 0, f"rank {r}: {err[-3000:]}"
        res.append(json.loads(out.splitlines()[0]))
    return res


@pytest.mark.parametrize("n, labels", [(n, None) for n in range(1, 9)] + [
    (2, "a,b"),                 # every rank a leader: only the leaders' step (rhd)
    (3, "a,b,a"),               # 2 leaders (rhd), a group of 2 and one of 1
    (5, "a,a,b,b,c"),           # 3 leaders (ring)
    (6, "a,b,a,c,b,c"),         # 3 leaders, groups not contiguous in rank order
    (8, "a,b,c,a,b,c,d,a"),     # 4 leaders (rhd), groups of 3, 2, 2, 1
])
def test_every_algorithm_dtype_and_op_matches_numpy(n, labels):
    """On one host every rank shares one group, so hierarchical never reaches its
    leaders' allreduce; forced labels make several groups and every op cross them."""
    lengths = [0, 1, 7, 1001] + ([40_003] if n <= 4 else [])   # 40003 x 8 B: several chunks
    res = job(n, "matrix", {"lengths": lengths},
              env=None if labels is None else {"RDMAMW_COLL_TOPOLOGY": labels})
    assert [r["rank"] for r in res] == list(range(n))
    groups = [0] * n if labels is None else topology.labels_to_groups(labels.split(","))
    per_length = 4 * 4 * 4 + 4 * 3      # algorithms x dtypes x ops, then 3 collectives x dtypes
    for r in res:
        assert r["groups"] == groups
        assert r["checks"] == per_length * len(lengths)    # every case compared, none skipped


@pytest.mark.parametrize("n", [2, 3, 4])
def test_arrays_of_many_chunks(n):
    """12 MB per rank: hundreds of chunks, more than a ring's worth in flight."""
    job(n, "big", {"length": 3_000_001})


@pytest.mark.parametrize("n", [2, 3])
def test_chunk_boundaries_every_dtype_and_copies_received_in_place(n):
    """Chunks of RDMAMW_COLL_CHUNK = 100003 B (above the collectives' 64 KiB eager limit
    here, so by rendezvous; a multiple of no item size) over odd lengths, every dtype;
    a chunk that is only copied (allgather, broadcast) goes straight into the result:
    no rendezvous destination is allocated for it."""
    res = job(n, "chunked", {"lengths": [7, 250_001]}, timeout=180,
              env={"RDMAMW_COLL_CHUNK": "100003", "RDMAMW_COLL_SLOT_SIZE": "64K"})
    for r in res:
        assert r["checks"] == 12 * 2 * 6
        assert r["rndv_reads"] > 0          # the chunks did go by rendezvous
        assert r["allocated"] == 0, r


@pytest.mark.parametrize("n", [2, 3])
def test_results_and_inputs_may_be_overwritten_once_a_call_returns(n):
    """A chunk may travel by rendezvous (the receiver reads it from the sender's memory
    later): a call must not return before its peers have taken everything it sent, or
    a caller reusing its buffers (the next backward pass into the same gradients)
    changes what a slower rank receives. Rank 1 takes each chunk 30 ms late."""
    res = job(n, "reuse", {"length": 2_500_003, "delay": 0.03}, timeout=120)
    assert [r["checks"] for r in res] == [9] * n


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_alltoall_gather_scatter_reduce_match_numpy(n):
    """Every dtype, even and uneven alltoall, every reduce op, blocking and async."""
    lengths = [0, 1, 5, 70_001] if n <= 3 else [0, 1, 5]     # 70001 x 8 B: several chunks
    res = job(n, "rooted", {"lengths": lengths})
    assert [r["rank"] for r in res] == list(range(n))
    for r in res:
        # per length and blocking/async, for each of 12 dtypes: 2 uneven alltoalls + 3
        # (even alltoall, gather, scatter), + one per reduce op (7 on the 9 integer and
        # bool dtypes, 4 on the 3 float ones)
        assert r["checks"] == len(lengths) * 2 * (12 * 5 + 9 * 7 + 3 * 4)
        assert r["pool_allocations"] <= 2 and r["pool_reuses"] >= 4, r


@pytest.mark.parametrize("kind", ["shape", "dtype", "op", "call", "alltoall", "gather",
                                  "scatter", "reduce", "counts"])
def test_mismatched_calls_raise_on_every_rank(kind):
    res = job(3, "mismatch", {"kind": kind, "odd": 2 if kind == "op" else 1, "alg": "rhd"})
    errors = {r["error"] for r in res}
    assert len(errors) == 1 and None not in errors        # the same message everywhere
    msg = errors.pop()
    assert "rank" in msg and "called" in msg
    assert {"shape": "float32[101]", "dtype": "float64[100]", "op": "op=max",
            "call": "broadcast(", "alltoall": "float32[6]", "gather": "int64[5]",
            "scatter": "float32[4]", "reduce": "op=min", "counts": "recv_counts [3, 2, 2]"
            }[kind] in msg
    assert all(r["after"] == 3 for r in res)               # still usable afterwards


@pytest.mark.parametrize("alg, n, victim, at", [("ring", 4, 1, 3), ("rhd", 5, 1, 2),
                                                ("hierarchical", 3, 1, 1), ("rhd", 3, 0, 1),
                                                ("hierarchical", 4, 0, 2)])
def test_rank_dying_mid_collective_gives_peer_lost(alg, n, victim, at):
    """The victim dies as it starts its ``at``-th transfer, so its peers wait on it.
    (A rank that dies after its last send, while peers only send to it, is not noticed
    by them: they have their result, and see PeerLost on their next collective.)"""
    res = job(n, "die", {"victim": victim, "alg": alg, "length": 2_000_000, "at": at},
              expect_dead=(victim,))
    assert len(res) == n - 1
    for r in res:       # every survivor names the victim, not the neighbour it waited on
        assert r["error"] == "PeerLost", r
        assert r["named"] == victim and f"rank {victim}" in r["msg"], r
        assert r["seconds"] < 2.0, r


def test_hierarchical_on_given_labels():
    res = job(5, "topo", {"topology": "a,b,a,b,b"})
    assert all(r["groups"] == [0, 1, 0, 1, 1] for r in res)


def test_probed_topology_of_one_host_is_one_group():
    res = job(3, "topo", {"topology": "probe"})
    assert all(r["groups"] == [0, 0, 0] for r in res)


# ---- in-process unit tests -----------------------------------------------------------


def solo() -> Communicator:
    w = World(0, 1, "test", "solo", {0: {"host": "h", "hostname": "h"}})
    return Communicator(w)


def test_single_rank_results_and_argument_errors():
    c = solo()
    x = np.arange(10, dtype=np.float32)
    assert allreduce(x, comm=c) is not x
    assert allreduce(x, out=x, comm=c) is x
    np.testing.assert_array_equal(coll.allgather(x, comm=c)[0], x)
    np.testing.assert_array_equal(coll.reduce_scatter(x, comm=c), x)
    coll.barrier(comm=c)
    with pytest.raises(TypeError, match="dtype"):
        allreduce(np.ones(3, np.complex64), comm=c)
    with pytest.raises(ValueError, match="op must be"):
        allreduce(x, op="avg", comm=c)
    with pytest.raises(ValueError, match="integer"):
        allreduce(x, op="bxor", comm=c)
    with pytest.raises(ValueError, match="shape"):
        allreduce(x, out=np.empty(11, np.float32), comm=c)
    y = np.zeros(20, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        allreduce(y[:10], out=y[5:15], comm=c)
    with pytest.raises(ValueError, match="algorithm"):
        allreduce(x, algorithm="butterfly", comm=c)
    with pytest.raises(TypeError, match="numpy"):
        allreduce([1.0, 2.0], comm=c)
    with pytest.raises(ValueError, match="root"):
        coll.broadcast(x, root=1, comm=c)
    assert issubclass(CollectiveMismatch, ValueError)


@pytest.mark.parametrize("n", range(1, 10))
def test_trees_reach_every_rank_once(n):
    members = list(range(n))
    for root in range(n):
        for shape in (binomial, chain):
            kids: list[int] = []
            for r in members:
                parent, children = shape(members, root, r)
                assert (parent is None) == (r == root)
                kids += children
                for c in children:
                    assert shape(members, root, c)[0] == r
            assert sorted(kids) == [r for r in members if r != root]


def test_broadcast_tree_is_binomial_up_to_tree_bytes_then_a_chain():
    members = [0, 1, 2, 3, 4]
    for r in members:
        assert tree_shape(members, 0, r, TREE_BYTES) == binomial(members, 0, r)
        assert tree_shape(members, 0, r, TREE_BYTES + 1) == chain(members, 0, r)
    assert binomial(members, 0, 0) != chain(members, 0, 0)      # the two differ here


def test_waits_sleep_at_once_when_the_host_is_oversubscribed(monkeypatch):
    """More ranks on this host than CPUs: a collective's waits do not spin (spin 0);
    otherwise the channels' default; RDMAMW_COLL_SPIN_US overrides both."""
    from types import SimpleNamespace

    from rdmamw.collectives.comm import spin_for
    from rdmamw.errors import ConfigError

    def world(hosts: list[str]) -> SimpleNamespace:
        return SimpleNamespace(rank=0, peers={r: {"host": h} for r, h in enumerate(hosts)})

    monkeypatch.delenv("RDMAMW_COLL_SPIN_US", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert spin_for(world(["a", "a"])) is None
    assert spin_for(world(["a", "a", "a"])) == 0.0
    assert spin_for(world(["a", "b", "a", "b", "b"])) is None      # 2 ranks on our host
    assert spin_for(world(["a", "a", "b", "a"])) == 0.0
    monkeypatch.setenv("RDMAMW_COLL_SPIN_US", "25")
    assert spin_for(world(["a", "a", "a"])) == 25.0
    monkeypatch.setenv("RDMAMW_COLL_SPIN_US", "-1")
    with pytest.raises(ConfigError):
        spin_for(world(["a"]))


def test_groups_from_bandwidth():
    fast, slow = 5e9, 1e8
    g = [0, 0, 1, 1]
    bw = np.array([[0 if a == b else (fast if g[a] == g[b] else slow) for b in range(4)]
                   for a in range(4)])
    assert topology.groups_from_bandwidth(bw) == [0, 0, 1, 1]
    assert topology.groups_from_bandwidth(np.full((3, 3), fast)) == [0, 0, 0]
    assert topology.labels_to_groups(["x", "y", "x"]) == [0, 1, 0]


def test_policy_follows_the_cost_model(monkeypatch, tmp_path):
    monkeypatch.delenv(policy.ALGO_ENV, raising=False)
    m = policy.Model(policy.Link(10e-6, 1 / 5e9), policy.Link(50e-6, 1 / 0.1e9), 1 / 5e9)
    flat8 = [0] * 8
    assert policy.choose(1024, flat8, m) == "rhd"              # latency-bound
    assert policy.choose(1 << 30, [0] * 6, m) == "ring"         # fix-up costs 2N at n=6
    hosts2 = [0, 0, 0, 0, 1, 1, 1, 1]
    assert policy.choose(64 << 20, hosts2, m) == "hierarchical"
    assert policy.choose(64 << 20, hosts2, m, "ring") == "ring"
    monkeypatch.setenv(policy.ALGO_ENV, "rhd")
    assert policy.choose(64 << 20, hosts2, m) == "rhd"
    monkeypatch.delenv(policy.ALGO_ENV)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": m.to_json(), "algorithm": "ring"}))
    loaded = policy.load(cfg)
    assert loaded.inter.beta == m.inter.beta and loaded.algorithm == "ring"
    assert policy.choose(1024, flat8, loaded) == "ring"
    assert policy.load(tmp_path / "missing.json").source == "built-in defaults"


def test_small_results_are_plain_arrays_and_large_ones_recycled_pool_memory():
    """Below results.SMALL a result is numpy's (heap memory, no pool bookkeeping); from
    it up, pool memory that goes back when the array is collected and is reused."""
    import gc

    from rdmamw.collectives import results

    before = results.pool().stats()
    for shape, dt in [((2,), np.float32), ((3, 5), np.int64), ((results.SMALL // 8 - 1,),
                                                              np.float64)]:
        a = results.empty(shape, dt)
        assert a.shape == shape and a.dtype == dt and a.flags.c_contiguous and a.flags.writeable
        assert a.base is None                  # numpy's own memory
    assert results.pool().stats() == before
    big = (results.SMALL // 4,)
    a = results.empty(big, np.float32)
    assert a.shape == big and a.dtype == np.float32 and a.base is not None
    a[:] = 7
    mid = results.pool().stats()
    assert mid["allocations"] + mid["reuses"] == before["allocations"] + before["reuses"] + 1
    del a
    gc.collect()
    b = results.empty(big, np.float32)
    assert results.pool().stats()["reuses"] == mid["reuses"] + 1
    del b


def test_remembered_choices_are_the_cost_models_and_follow_its_changes(monkeypatch):
    """policy.Choices answers what policy.choose does, for every size and grouping, and
    sees a model edited in place, a new grouping and RDMAMW_ALLREDUCE_ALGORITHM."""
    monkeypatch.delenv(policy.ALGO_ENV, raising=False)
    m = policy.Model(policy.Link(10e-6, 1 / 5e9), policy.Link(50e-6, 1 / 0.1e9), 1 / 5e9)
    memo = policy.Choices()
    sizes = [1 << k for k in range(0, 31, 3)]
    groupings = [[0] * 6, [0] * 8, [0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 0, 1, 2, 2]]
    for groups in groupings:
        for _ in range(2):                      # the second pass answers from memory
            got = [memo.choose(n, groups, m) for n in sizes]
            assert got == [policy.choose(n, groups, m) for n in sizes]
    assert len(set(got)) > 1 or len({memo.choose(n, groupings[2], m) for n in sizes}) > 1
    hosts2 = groupings[2]
    assert memo.choose(64 << 20, hosts2, m) == "hierarchical"
    m.inter = policy.Link(50e-6, 1 / 100e9)     # edited in place: a fast inter-host link
    assert memo.choose(64 << 20, hosts2, m) == policy.choose(64 << 20, hosts2, m) != \
        "hierarchical"
    monkeypatch.setenv(policy.ALGO_ENV, "ring")
    assert memo.choose(1024, hosts2, m) == "ring"
    monkeypatch.setenv(policy.ALGO_ENV, "rhd")
    assert memo.choose(1024, hosts2, m) == "rhd"
    assert memo.choose(1024, hosts2, m, "ring") == "ring"   # the argument first
    monkeypatch.delenv(policy.ALGO_ENV)
    for n in range(policy.Choices.LIMIT + 10):
        memo.choose(n, hosts2, m)
    assert len(memo._seen) <= policy.Choices.LIMIT


# ---- two "hosts" ----------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="network namespaces and tc need root and iproute2")
def test_every_algorithm_is_right_across_two_hosts_and_auto_is_the_models_choice(
        two_hosts):  # noqa: F811 - fixture
    """Ranks alternate between two network namespaces (shm inside, tcp across) whose
    veth link tbf limits to 200 Mbit/s: probing finds the two groups (shm is ~100x
    faster), ring, rhd and hierarchical each sum right (the worker checks), and every
    rank's automatic choice is what the cost model says for these bytes and groups.
    Which algorithm is faster on the link is a benchmark's question, not a unit
    test's: the times are only printed. A shaped link drops bursts and tcp may back
    off past the default 1.5 s peer timeout: it gets 10 s."""
    hosts, devs = two_hosts
    a, b = sorted(hosts)
    shape_link(devs)
    placement = [a, b, a, b]
    cfg = json.dumps({"topology": "probe", "length": 1 << 20, "reps": 1})
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, WORKER, "race", cfg],
                              env=clean_env(RANK=str(r), WORLD_SIZE="4",
                                            RDMAMW_TCP_PEER_TIMEOUT="10", **UNTUNED,
                                            MASTER_ADDR=hosts[a],
                                            MASTER_PORT=str(28000 + os.getpid() % 1000)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT) for r, ns in enumerate(placement)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        reap(procs)
    errs = "\n".join(f"rank {r}: {err[-2000:]}" for r, (_, err) in enumerate(outs))
    assert all(p.returncode == 0 for p in procs), errs
    res = [json.loads(out.splitlines()[0]) for out, _ in outs]
    assert all(r["groups"] == [0, 1, 0, 1] for r in res), res
    print("best seconds of a 4 MiB allreduce across two namespaces:", res[0]["best"])
    want = policy.choose(4 << 20, [0, 1, 0, 1], policy.Model())
    assert [r["auto"] for r in res] == [want] * 4, (res, policy.explain(
        4 << 20, [0, 1, 0, 1], policy.Model()))
