"""Jobs across "hosts": two network namespaces joined by a veth pair stand in for
two machines (their own addresses; shm:// names do not cross a namespace). The tests
create and delete the namespaces themselves and skip without root or ``ip``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.integrations.test_bootstrap import ROOT, WORKER, clean_env, json_objects
from tests.support.helpers import assert_ranks_ok, reap
from tests.support.netns import ip, two_namespaces

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2 (`ip`)")

@pytest.fixture
def two_hosts():
    """({name: address}, {name: device}) of two namespaces on one veth link."""
    with contextlib.ExitStack() as stack:
        try:
            hosts_devs = stack.enter_context(two_namespaces())
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create network namespaces here: {e.stderr!r}")
        yield hosts_devs


def start_ranks(hosts: dict, placement: list[str], hold: bool = False,
                per_rank: list[dict] | None = None, **env: str):
    """The worker as ranks 0.. in the namespaces of ``placement``; ``per_rank``: more
    variables for each rank."""
    master = hosts[placement[0]]
    port = str(29000 + os.getpid() % 1000)
    return [subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, WORKER, "60"] + (["--hold"] if hold else []),
        env=clean_env(RANK=str(r), WORLD_SIZE=str(len(placement)), MASTER_ADDR=master,
                      MASTER_PORT=port, **env, **(per_rank[r] if per_rank else {})),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for r, ns in enumerate(placement)]


def test_four_ranks_on_two_hosts(two_hosts):
    hosts, _ = two_hosts
    a, b = sorted(hosts)
    procs = start_ranks(hosts, [a, a, b, b])
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        reap(procs)
    assert_ranks_ok(procs, outs)
    res = {r["rank"]: r for out, _ in outs for r in json_objects(out)}
    same_host = {(0, 1), (1, 0), (2, 3), (3, 2)}
    for rank, r in res.items():
        for peer, scheme in r["providers"].items():
            assert scheme == ("shm" if (rank, int(peer)) in same_host else "tcp"), res


def test_host_link_down_gives_peer_lost_within_two_seconds(two_hosts):
    hosts, devs = two_hosts
    a, b = sorted(hosts)
    procs = start_ranks(hosts, [a, b, b], hold=True, RDMAMW_TCP_HOST_TIMEOUT="1.0")
    try:
        lines = [p.stdout.readline() for p in procs]
        if not all(lines):
            pytest.fail("a rank failed: " + " | ".join(p.communicate(timeout=60)[1]
                                                       for p in procs))
        first = [json.loads(line) for line in lines]             # traffic went through
        assert first[0]["providers"] == {"1": "tcp", "2": "tcp"}
        time.sleep(0.3)
        t_down = time.time()
        ip("-n", b, "link", "set", devs[b], "down")              # host b vanishes
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        reap(procs)
    lost = json.loads(outs[0][0])["lost"]
    assert set(lost) == {"1", "2"}, outs
    assert max(lost.values()) - t_down < 2.0, (lost, t_down)
    for out, err in outs[1:]:             # ...and host b's ranks lose rank 0 as well
        assert out and "0" in json.loads(out)["lost"], err


def test_ranks_on_different_fabrics_fall_back_to_tcp_and_say_why(two_hosts):
    """Two hosts whose RDMA ports are on different networks (descriptors faked by the
    worker: this machine has no RDMA): tcp, and the log gives the fabrics."""
    hosts, _ = two_hosts
    a, b = sorted(hosts)
    procs = start_ranks(hosts, [a, b], RDMAMW_LOG_LEVEL="info",
                        per_rank=[{"FAKE_VERBS_FABRIC": "10.1.0.1/24"},
                                  {"FAKE_VERBS_FABRIC": "10.2.0.7/24"}])
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        reap(procs)
    assert_ranks_ok(procs, outs)
    res = {r["rank"]: r for out, _ in outs for r in json_objects(out)}
    assert res[0]["channel_provider"] == {"1": "tcp"} and res[1]["channel_provider"] == {"0": "tcp"}
    for (me, other), (_, err) in zip([(0, 1), (1, 0)], outs, strict=True):
        assert (f"rank {me} -> rank {other}: tcp provider (tcp reaches every host; not shm: "
                f"different hosts") in err, err
        assert ("; not verbs: no common fabric: rank 0 is on roce:10.1.0.0/24, rank 1 on "
                "roce:10.2.0.0/24)") in err, err
