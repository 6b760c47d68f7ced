"""Verbs by rank, in the soft-RoCE VM: jobs started the way users start them, every
channel on verbs (RDMAMW_PROVIDER=verbs: inside one host the providers would choose
shm), the traffic through the verbs counters, and the faults of issue 14: a rank
without a device, a rank killed mid-job, a descriptor in the store that contradicts
the peer's handshake. The host half (choice, descriptors) is test_provider_choice.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rdmamw.bootstrap.launch import free_port
from tests.integrations.test_bootstrap import ROOT, WORKER, clean_env, json_objects
from tests.support.helpers import NO_DEVICE, VERBS_OK, reap, within

pytestmark = [pytest.mark.device, pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE)]
FAULT_WORKER = os.path.join(ROOT, "tests", "support", "rank_fault_worker.py")


def start(n: int, script: str = WORKER, args: tuple = ("60",), per_rank: list | None = None,
          **env: str) -> list[subprocess.Popen]:
    """Ranks 0..n-1 with torchrun's variables (RANK, WORLD_SIZE, MASTER_*)."""
    port = str(free_port())
    return [subprocess.Popen([sys.executable, script, *args], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=clean_env(RANK=str(r), WORLD_SIZE=str(n),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                           **env, **(per_rank[r] if per_rank else {})))
            for r in range(n)]


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        reap(procs)


def check_verbs_job(results: list[dict], n: int) -> None:
    """Every channel of every rank is a verbs channel, the bytes went through it, and
    each batch of the doorbell phase took one doorbell."""
    assert sorted(r["rank"] for r in results) == list(range(n))
    for r in results:
        peers = {str(p) for p in range(n) if p != r["rank"]}
        assert r["channel_provider"] == r["stats_provider"] == dict.fromkeys(peers, "verbs")
        assert r["providers"] == dict.fromkeys(peers, "verbs")      # verbs:// peers
        for t in r["traffic"].values():
            assert t["batches"] == 10
            # one doorbell per batch, besides wake-ups, control words and reclaim
            # write-backs (a ring that grows: its sender waits for credit at first; a wake-up
            # chained behind its control word shares that one's doorbell)
            assert t["doorbells"] - t["wakeups_sent"] + t["wakeups_chained"] - t["control_writes"] \
                - t["reclaim_writebacks"] == 10, t
            assert t["bytes"] > 65536 and t["bytes_written"] >= t["bytes"], t
            assert t["bytes_received"] > 65536, t


def test_job_from_the_launcher_runs_on_verbs():
    out = subprocess.run([sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", "3", "--",
                          sys.executable, WORKER, "60"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env=clean_env(RDMAMW_PROVIDER="verbs", RDMAMW_LOG_LEVEL="info"))
    assert out.returncode == 0, out.stderr[-3000:]
    check_verbs_job(json_objects(out.stdout), 3)
    assert "rank 1 -> rank 2: verbs provider (forced by RDMAMW_PROVIDER)" in out.stderr


def test_torchrun_style_job_runs_on_verbs():
    outs = finish(start(2, RDMAMW_PROVIDER="verbs"))
    check_verbs_job([json_objects(o)[0] for o, _ in outs], 2)


@pytest.mark.timeout(300)
def test_forced_verbs_where_a_rank_has_no_device_fails_every_rank():
    """The error comes as soon as the table does: well within the init timeout (120 s
    here, which the whole run, interpreter start-up under TCG included, stays below)."""
    t0 = time.monotonic()
    procs = start(3, args=("120",), RDMAMW_PROVIDER="verbs",
                  per_rank=[{}, {}, {"RDMAMW_VERBS_DEVICE": "nosuch0"}])
    outs = finish(procs, 200)
    assert time.monotonic() - t0 < 120
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode != 0
        assert ("ProviderUnavailable: RDMAMW_PROVIDER=verbs, but rank 0 and rank 2 cannot "
                "connect over verbs: rank 2 has no usable RDMA port (no RDMA device "
                "'nosuch0' (found: ") in err, err


def test_killed_rank_gives_its_peers_peer_lost_within_two_seconds():
    procs = start(3, args=("60", "--hold"), RDMAMW_PROVIDER="verbs")
    try:
        lines = [p.stdout.readline() for p in procs]
        if not all(lines):
            pytest.fail("a rank failed: " + " | ".join(p.communicate(timeout=60)[1]
                                                       for p in procs))
        assert all(json.loads(x)["channel_provider"] for x in lines)
        time.sleep(0.3)
        t_kill = time.time()
        procs[2].send_signal(signal.SIGKILL)
        outs = [p.communicate(timeout=120) for p in procs[:2]]
    finally:
        reap(procs)
    for p, (out, err) in zip(procs[:2], outs, strict=True):
        assert p.returncode == 0, err
        lost = json.loads(out.splitlines()[-1])["lost"]
        assert list(lost) == ["2"], out                 # the other survivor is fine
        assert 0 <= lost["2"] - t_kill < within(2.0), (lost, t_kill)


def test_descriptor_that_contradicts_the_handshake_is_refused_before_rtr():
    """Rank 1's table says rank 0 has another GID (same network): opening the channel
    is a ProtocolError; rank 1 keeps no queue pair and no registration. The same job
    with the true table connects (so the resource query sees QPs when they exist)."""
    honest = finish(start(2, FAULT_WORKER, ("honest",), RDMAMW_PROVIDER="verbs"))
    r1 = next(r for o, _ in honest for r in json_objects(o) if r["rank"] == 1)
    assert r1["opened"] == "verbs" and r1["qps"] and r1["mrs"] > 0, honest
    procs = start(2, FAULT_WORKER, ("tamper",), RDMAMW_PROVIDER="verbs")
    outs = finish(procs)
    res = {r["rank"]: r for o, _ in outs for r in json_objects(o)}
    assert res[1]["error"].startswith("ProtocolError: "), res
    assert "in its handshake, but" in res[1]["error"] and "in its descriptor in the store" \
        in res[1]["error"], res
    assert res[1]["qps"] == [] and res[1]["mrs"] == 0, res
    # rank 0 never gets the channel: at its deadline, or once rank 1's process ended
    # (it exits after its refusal: PeerLost at once, one host)
    assert res[0]["error"].startswith(("Timeout: ", "PeerLost: ")), res
