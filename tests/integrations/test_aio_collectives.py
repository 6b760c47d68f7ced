"""rdmamw.aio.collectives: the blocking collectives' schedules awaited on an event loop
(issue 17). Each rank is a process of tests/support/aio_coll_worker.py."""

from __future__ import annotations

import os

import pytest

from tests.integrations.test_collectives import ROOT, job

WORKER = os.path.join(ROOT, "tests", "support", "aio_coll_worker.py")


@pytest.mark.parametrize("n, lengths", [(1, [0, 5]), (2, [0, 1, 7, 40_003]),
                                        (3, [1, 1001, 40_003]), (4, [7, 1001])])
def test_awaited_results_equal_the_blocking_calls(n, lengths):
    """Every algorithm, dtype and op of allreduce, and broadcast, reduce_scatter,
    allgather, reduce, gather, scatter, alltoall (even and uneven), barrier: the awaited
    call's whole result equals the blocking call's on the same inputs (40003 x 8 B:
    several chunks)."""
    res = job(n, "same", {"lengths": lengths}, worker=WORKER, timeout=180)
    assert [r["rank"] for r in res] == list(range(n))
    for r in res:
        assert r["checks"] == len(lengths) * 4 * (4 * 4 * 2 + 8)


@pytest.mark.parametrize("alg", ["ring", "rhd"])
def test_the_loop_runs_other_work_while_a_step_waits(alg):
    """Rank 1 joins 0.5 s late: rank 0's loop keeps ticking (every 10 ms) meanwhile."""
    res = job(2, "overlap", {"length": 100_000, "late": 0.5, "alg": alg}, worker=WORKER)
    r0 = res[0]
    assert r0["waited"] >= 0.4, r0
    assert r0["ticks"] >= 20, r0            # ~50 if the loop was free all along


@pytest.mark.parametrize("blocking_peer", [False, True])
def test_cancelled_collective_closes_the_communicator_and_the_peer_raises(blocking_peer):
    """Rank 0's ``asyncio.timeout`` cancels its allreduce while rank 1 has not come: the
    communicator is broken (closed), and rank 1's call, awaited or blocking, raises
    PeerLost at once instead of waiting for a rank that left."""
    res = job(2, "cancel", {"length": 1000, "late": 2.0, "blocking_peer": blocking_peer},
              worker=WORKER)
    r0, r1 = res
    assert r0["error"] == "cancelled" and r0["broken"], r0
    assert r0["after"] == "RdmamwError", r0            # broken: later calls refuse
    assert r1["error"] == "PeerLost" and r1["broken"], r1
    assert r1["seconds"] < 2.0, r1


@pytest.mark.parametrize("alg, n, victim, at", [("ring", 3, 1, 2), ("rhd", 4, 2, 1),
                                                ("rhd", 3, 0, 1), ("hierarchical", 3, 1, 1)])
def test_rank_killed_mid_collective_the_others_await_raises_within_2s(alg, n, victim, at,
                                                                      tmp_path):
    """The victim dies as it starts its ``at``-th transfer; every other rank's await
    raises PeerLost within 2 s of its death."""
    stamp = str(tmp_path / "died")
    res = job(n, "die", {"victim": victim, "alg": alg, "length": 2_000_000, "at": at,
                         "stamp": stamp}, worker=WORKER, expect_dead=(victim,))
    with open(stamp) as f:
        died = float(f.read())
    assert len(res) == n - 1
    for r in res:
        assert r["error"] == "PeerLost", r
        assert r["at"] - died < 2.0, (r, died)
