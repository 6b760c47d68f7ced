"""Two "hosts" in the soft-RoCE VM, chosen by the providers themselves (no
RDMAMW_PROVIDER): the ranks run in two network namespaces (tests/support/netns.py), each
"host" has its own rxe device over one end of a veth pair, so the automatic choice
must give shm inside a namespace and verbs across, with the RDMA traffic on the wire.

The rxe devices live in the initial namespace with policy routing that sends their
traffic over the veth pair (rxe_over_veth below): the VM's 6.1 rxe
routes in the initial namespace only, so an rxe inside a namespace cannot send
(ibv_rc_pingpong: "local QP operation error"). A rank in a namespace therefore cannot
see its device's netdev, and the hosts declare their fabric (RDMAMW_VERBS_FABRIC)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.integrations.test_bootstrap import ROOT, clean_env, json_objects
from tests.integrations.test_multihost import start_ranks, two_hosts  # noqa: F401 - the fixture
from tests.support.helpers import NO_DEVICE, VERBS_OK, assert_ranks_ok, reap
from tests.support.netns import ip

pytestmark = [pytest.mark.device, pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE),
              pytest.mark.timeout(400),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("rdma") is None,
                                 reason="needs root and rdma (iproute2)")]
WIRE = {"rxeA": ("rvA", "10.79.0.1"), "rxeB": ("rvB", "10.79.0.2")}


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def rxe_over_veth():
    """rxeA on rvA and rxeB on rvB, a veth pair; their traffic crosses the wire."""
    (a_dev, a_ip), (b_dev, b_ip) = WIRE["rxeA"], WIRE["rxeB"]
    undo: list[tuple[str, ...]] = []
    try:
        ip("link", "add", a_dev, "type", "veth", "peer", "name", b_dev)
        undo.append(("ip", "link", "del", a_dev))
        for dev, addr in ((a_dev, a_ip), (b_dev, b_ip)):
            ip("addr", "add", f"{addr}/24", "dev", dev)
            ip("link", "set", dev, "up")
        for c in ("all", a_dev, b_dev):
            sh("sysctl", "-qw", f"net.ipv4.conf.{c}.accept_local=1",
               f"net.ipv4.conf.{c}.rp_filter=0")
        # both addresses are local: without these rules the kernel would use lo
        ip("rule", "add", "pref", "100", "lookup", "local")
        undo.append(("ip", "rule", "del", "pref", "100"))
        ip("rule", "del", "pref", "0")
        undo.append(("ip", "rule", "add", "pref", "0", "lookup", "local"))
        ip("route", "add", f"{b_ip}/32", "dev", a_dev, "src", a_ip, "table", "100")
        ip("route", "add", f"{a_ip}/32", "dev", b_dev, "src", b_ip, "table", "101")
        ip("rule", "add", "pref", "10", "iif", "lo", "to", b_ip, "lookup", "100")
        undo.append(("ip", "rule", "del", "pref", "10"))
        ip("rule", "add", "pref", "11", "iif", "lo", "to", a_ip, "lookup", "101")
        undo.append(("ip", "rule", "del", "pref", "11"))
        for rxe, (dev, _) in WIRE.items():
            sh("rdma", "link", "add", rxe, "type", "rxe", "netdev", dev)
            undo.append(("rdma", "link", "delete", rxe))
        for rxe in WIRE:        # the IPv4 GID appears a moment after the link
            path = f"/sys/class/infiniband/{rxe}/ports/1/gids/1"
            for _ in range(100):
                with open(path) as f:
                    if f.read().startswith("0000:0000:0000:0000:0000:ffff:"):
                        break
                time.sleep(0.1)
        yield
    finally:
        for cmd in reversed(undo):
            subprocess.run(cmd, capture_output=True, timeout=30)


def tx_bytes(dev: str) -> int:
    with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
        return int(f.read())


def test_shm_inside_a_namespace_verbs_across(two_hosts):  # noqa: F811 - the fixture
    hosts, _ = two_hosts
    a, b = sorted(hosts)
    with rxe_over_veth():
        tx0 = tx_bytes(WIRE["rxeA"][0])
        per_rank = [{"RDMAMW_VERBS_DEVICE": d} for d in ("rxeA", "rxeA", "rxeB", "rxeB")]
        procs = start_ranks(hosts, [a, a, b, b], per_rank=per_rank,
                            RDMAMW_VERBS_FABRIC="vm-veth", RDMAMW_LOG_LEVEL="info")
        try:
            outs = [p.communicate(timeout=300) for p in procs]
        finally:
            reap(procs)
        tx1 = tx_bytes(WIRE["rxeA"][0])
    assert_ranks_ok(procs, outs)
    res = {r["rank"]: r for out, _ in outs for r in json_objects(out)}
    same = {(0, 1), (1, 0), (2, 3), (3, 2)}
    for rank, r in res.items():
        assert r["channel_provider"] == {
            str(p): "shm" if (rank, p) in same else "verbs" for p in range(4) if p != rank}, r
        for p, t in r["traffic"].items():
            if (rank, int(p)) not in same:
                # one doorbell per batch, besides wake-ups, control words and reclaim
                # write-backs (a ring that grows: its sender waits for credit at first; a wake-up
                # chained behind its control word shares that one's doorbell)
                assert t["doorbells"] - t["wakeups_sent"] + t["wakeups_chained"] \
                    - t["control_writes"] - t["reclaim_writebacks"] == 10, t
                assert t["bytes_written"] > 0, t
    # both "hosts" wrote about 2 x 77 kB to each of the other's ranks, over rxeA -> rvA
    assert tx1 - tx0 > 4 * 70_000, (tx0, tx1)
    err0 = outs[0][1]
    assert "rank 0 -> rank 1: shm provider (same host" in err0, err0
    assert ("rank 0 -> rank 2: verbs provider (common fabric net:vm-veth (rxeA port 1 / "
            "rxeB port 1); not shm: different hosts") in err0, err0


TWO_CHANNELS_SERVER = """
import sys, faulthandler
faulthandler.dump_traceback_later(100, exit=True)
import rdmamw
lst = rdmamw.channel.listen(f"verbs://{sys.argv[1]}:0?device=rxeA")
print(lst.address, flush=True)
for k in range(2):
    ch = lst.accept(timeout=60)
    for _ in range(3):
        ch.send(bytes(ch.recv(timeout=30)))
    print("server done", k, file=sys.stderr, flush=True)
    ch.close()
"""
TWO_CHANNELS_CLIENT = """
import sys, faulthandler
faulthandler.dump_traceback_later(100, exit=True)
import numpy as np, rdmamw
for k in range(2):
    ch = rdmamw.Channel.open(sys.argv[1].split("?")[0] + "?device=rxeB", timeout=30)
    for n in (8, 64 << 10, 8 << 20):
        x = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
        ch.send(x).wait(30)
        assert np.array_equal(np.frombuffer(ch.recv(timeout=30), np.uint8), x), (k, n)
    print("client done", k, file=sys.stderr, flush=True)
    ch.close()
"""


@pytest.mark.slow     # (`make test-slow`): rxe's own failures under load, below
def test_large_rendezvous_messages_on_two_channels_one_after_another(two_hosts):  # noqa: F811
    """Out of `make test` (in `make test-slow`): with the CI's host half beside the VM,
    its server's QP went into error mid-rendezvous in both whole runs of 2026-12-07
    (once on the first channel, once on the second; both processes alive, the VM's
    console saying `rdma_rxe: Failed sending ACK`) and in one run before, while it
    passed in others and alone in the VM.
    Two channels in turn between the same two "hosts", each carrying 8 B, 64 KiB and
    8 MiB (a rendezvous READ) both ways. Before long READs went in pieces
    (RDMAMW_VERBS_READ_CHUNK, 512 KiB on soft-RoCE) it failed in 3 of 3 runs: the first
    8 MiB READ lost a packet at the veth receiver and rxe's retry stalled it for good
    (docs/design.md "Long READs on soft-RoCE"); with RDMAMW_VERBS_READ_CHUNK=0 it still
    does."""
    hosts, _ = two_hosts
    a, b = sorted(hosts)
    env = {"RDMAMW_TOKEN": "two-hosts-" + str(os.getpid()),
           "RDMAMW_VERBS_FABRIC": "vm-veth", "RDMAMW_LOG_LEVEL": "info"}
    with rxe_over_veth():
        server = subprocess.Popen(
            ["ip", "netns", "exec", a, sys.executable, "-c", TWO_CHANNELS_SERVER, hosts[a]],
            env=clean_env(PYTHONPATH=str(ROOT), **env), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            address = server.stdout.readline().strip()
            client = subprocess.run(
                ["ip", "netns", "exec", b, sys.executable, "-c", TWO_CHANNELS_CLIENT, address],
                env=clean_env(PYTHONPATH=str(ROOT), **env), capture_output=True, text=True,
                cwd=ROOT, timeout=200)
        finally:
            server.kill()
            _, server_err = server.communicate(timeout=30)
    if client.returncode != 0:          # shown with the failure: where each side was
        print("---- client ----", client.stderr[-6000:], "---- server ----",
              server_err[-4000:], sep="\n")
    assert client.returncode == 0
