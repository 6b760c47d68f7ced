"""The providers choose (rdmamw/bootstrap/choice.py): each answers ``can_connect`` for
two ranks' descriptors, the bootstrap walks them. Descriptors' verbs entries are
checked (rdmamw/providers/verbs/rank.py), RDMAMW_PROVIDER forces one for every pair or
fails on every rank, and RDMAMW_SOCKET_IFNAME picks the interface. Jobs over real
verbs are in test_verbs_rank.py (VM)."""

from __future__ import annotations

import ipaddress
import logging
import subprocess
import sys
import time

import pytest

import rdmamw
from rdmamw.bootstrap import choice, ifname
from rdmamw.bootstrap.launch import free_port
from rdmamw.errors import ConfigError
from rdmamw.providers.verbs import rank as verbs_rank
from tests.channel.test_channel_basic import recv_all
from tests.integrations.test_bootstrap import ROOT, WORKER, clean_env, run_job
from tests.support.helpers import make_pair, reap


def port(addr: str, link: str = "ethernet", dev: str = "rxe0") -> dict:
    """A port entry of a verbs descriptor: RoCE on ``addr`` ("10.1.0.1/24"), or
    InfiniBand with subnet prefix ``addr`` (16 hex digits)."""
    if link == "infiniband":
        gid = bytes.fromhex(addr) + bytes.fromhex("0002c90300a1b2c3")
        return {"dev": dev, "port": 1, "gid_index": 0, "gid": gid, "link": link,
                "fabric": f"ib:{addr}"}
    ip = ipaddress.ip_interface(addr)
    return {"dev": dev, "port": 1, "gid_index": 1,
            "gid": ipaddress.IPv6Address(f"::ffff:{ip.ip}").packed, "link": link,
            "fabric": f"roce:{ip.network}"}


def desc(rank: int, host: str, *ports: dict, why: str = "no RDMA device found") -> dict:
    verbs = {"addr": f"verbs://10.0.0.{rank}:7000", "ports": list(ports)} if ports \
        else {"why": why}
    return {"rank": rank, "host": host, "hostname": host, "tcp": f"tcp://10.0.0.{rank}:1",
            "forced": "", "verbs": verbs}


CHOICES = [
    # same kernel and namespace: shm, even with a common fabric
    (desc(0, "A", port("10.1.0.1/24")), desc(1, "A", port("10.1.0.2/24")), "shm",
     "same host"),
    (desc(0, "A", port("10.1.0.1/24")), desc(1, "B", port("10.1.0.2/24")), "verbs",
     "common fabric roce:10.1.0.0/24 (rxe0 port 1 / rxe0 port 1)"),
    (desc(0, "A", port("fe80000000000000", "infiniband")),
     desc(1, "B", port("fe80000000000000", "infiniband")), "verbs",
     "common fabric ib:fe80000000000000"),
    # a second port on the common network is found
    (desc(0, "A", port("10.1.0.1/24"), port("10.2.0.1/24", dev="rxe1")),
     desc(1, "B", port("10.2.0.2/24")), "verbs",
     "common fabric roce:10.2.0.0/24 (rxe1 port 1 / rxe0 port 1)"),
    (desc(0, "A", port("10.1.0.1/24")), desc(1, "B", port("10.2.0.1/24")), "tcp",
     "tcp reaches every host; not shm: different hosts (A / B) or network namespaces; "
     "not verbs: no common fabric: rank 0 is on roce:10.1.0.0/24, rank 1 on "
     "roce:10.2.0.0/24"),
    (desc(0, "A", port("fe80000000000000", "infiniband")), desc(1, "B", port("10.1.0.2/24")),
     "tcp", "not verbs: no common fabric: rank 0 is on ib:fe80000000000000, rank 1 on "
     "roce:10.1.0.0/24"),
    # a declared fabric joins what the addresses would not
    (desc(0, "A", {**port("10.1.0.1/24"), "fabric": "net:lab"}),
     desc(1, "B", {**port("10.2.0.1/24"), "fabric": "net:lab"}), "verbs",
     "common fabric net:lab"),
    (desc(0, "A", port("10.1.0.1/24")), desc(1, "B"), "tcp",
     "not verbs: rank 1 has no usable RDMA port (no RDMA device found)"),
]


@pytest.mark.parametrize("a, b, scheme, why", CHOICES)
def test_the_providers_choose_the_same_on_both_sides(a, b, scheme, why):
    got_a, got_b = choice.choose(a, b), choice.choose(b, a)
    assert got_a[0] == got_b[0] == scheme
    assert why in got_a[1], got_a[1]
    assert got_a[1] == got_b[1]


def test_no_provider_at_all_is_a_clear_error():
    a, b = desc(0, "A"), desc(1, "B")
    del a["tcp"]
    with pytest.raises(rdmamw.ProviderUnavailable, match="no provider connects rank 0 and "
                       "rank 1: shm: different hosts .*; tcp: a rank has no tcp"):
        choice.choose(a, b)


def bad(change) -> dict:
    d = desc(1, "B", port("10.1.0.2/24"))
    change(d["verbs"])
    return d


MALFORMED = {
    "not a map": lambda v: v.clear() or v.update(x=1),
    "extra key": lambda v: v.update(extra=1),
    "why not text": lambda v: (v.clear(), v.update(why=3)),
    "address scheme": lambda v: v.update(addr="tcp://10.0.0.1:7000"),
    "address port": lambda v: v.update(addr="verbs://10.0.0.1:99999"),
    "no ports": lambda v: v.update(ports=[]),
    "ports not a list": lambda v: v.update(ports={"a": 1}),
    "too many ports": lambda v: v.update(ports=v["ports"] * 17),
    "port missing a key": lambda v: v["ports"][0].pop("fabric"),
    "port number a bool": lambda v: v["ports"][0].update(port=True),
    "port number 0": lambda v: v["ports"][0].update(port=0),
    "gid short": lambda v: v["ports"][0].update(gid=b"\x01" * 15),
    "gid zero": lambda v: v["ports"][0].update(gid=bytes(16)),
    "gid text": lambda v: v["ports"][0].update(gid="::ffff:10.1.0.2"),
    "link layer": lambda v: v["ports"][0].update(link="ethernet2"),
    # inconsistent: the fabric does not hold the GID's address / subnet prefix
    "fabric elsewhere": lambda v: v["ports"][0].update(fabric="roce:10.9.0.0/24"),
    "fabric garbage": lambda v: v["ports"][0].update(fabric="roce:banana"),
    "fabric kind": lambda v: v["ports"][0].update(fabric="ib:0a01000000000000"),
    "ib prefix": lambda v: v["ports"][0].update(link="infiniband"),
    "declared empty": lambda v: v["ports"][0].update(fabric="net:"),
    "declared too long": lambda v: v["ports"][0].update(fabric="net:" + "x" * 65),
    "declared unprintable": lambda v: v["ports"][0].update(fabric="net:a\nb"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_or_inconsistent_verbs_entry_is_a_protocol_error(name):
    peer = bad(MALFORMED[name])
    me = desc(0, "A", port("10.1.0.1/24"))
    with pytest.raises(rdmamw.ProtocolError, match="rank 1's verbs descriptor from the store"):
        choice.choose(me, peer)
    with pytest.raises(rdmamw.ProtocolError, match="rank 1's verbs descriptor"):
        choice.choose(peer, me)


def test_a_forced_provider_must_connect_every_pair():
    table = {0: desc(0, "A", port("10.1.0.1/24")), 1: desc(1, "B", port("10.1.0.2/24")),
             2: desc(2, "C", why="RDMAMW_VERBS_DEVICE=mlx5_9: no such device")}
    assert choice.check_forced(table) == ""
    for d in table.values():
        d["forced"] = "verbs"
    with pytest.raises(rdmamw.ProviderUnavailable,
                       match=r"RDMAMW_PROVIDER=verbs, but rank 0 and rank 2 cannot connect "
                             r"over verbs: rank 2 has no usable RDMA port \(RDMAMW_VERBS_DEVICE"
                             r"=mlx5_9: no such device\); unset RDMAMW_PROVIDER"):
        choice.check_forced(table)
    del table[2]
    assert choice.check_forced(table) == "verbs"
    table[1]["forced"] = "shm"
    with pytest.raises(ConfigError, match="disagree on RDMAMW_PROVIDER: rank 0: "
                       "verbs, rank 1: shm"):
        choice.check_forced(table)
    for d in table.values():
        d["forced"] = "ib"
    with pytest.raises(ConfigError, match="RDMAMW_PROVIDER='ib' is not a provider"):
        choice.check_forced(table)
    table[1]["forced"] = ["verbs"]          # a malformed descriptor from the store
    with pytest.raises(rdmamw.ProtocolError, match="rank 1's descriptor from the store is "
                       r"malformed: 'forced' is \['verbs'\], not a string"):
        choice.check_forced(table)


def start(n: int, *, timeout: float = 60, **env: str) -> list[subprocess.Popen]:
    port_ = str(free_port())
    return [subprocess.Popen([sys.executable, WORKER, str(timeout)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=clean_env(RANK=str(r), WORLD_SIZE=str(n),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port_, **env))
            for r in range(n)]


def test_forced_verbs_without_a_device_fails_on_every_rank_naming_it():
    """On this host no rank has an RDMA device: every rank says so within the init
    timeout, instead of hanging in Channel.open."""
    if verbs_rank.local_ports()[0]:
        pytest.skip("this host has an RDMA port (the VM test covers a rank without one)")
    t0 = time.monotonic()
    procs = start(3, timeout=20, RDMAMW_PROVIDER="verbs")
    try:
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        reap(procs)
    assert time.monotonic() - t0 < 20
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode != 0
        assert ("ProviderUnavailable: RDMAMW_PROVIDER=verbs, but rank 0 and "
                "rank 1 cannot connect over verbs: rank 0 has no usable RDMA port (") in err, err


def test_channels_say_what_they_run_on():
    res = run_job(3)
    for r in res:
        assert r["channel_provider"] == r["stats_provider"] == r["providers"]
        assert set(r["providers"].values()) == {"shm"}
    res = run_job(2, RDMAMW_PROVIDER="tcp")
    assert [r["stats_provider"] for r in res] == [{"1": "tcp"}, {"0": "tcp"}]


@pytest.mark.parametrize("text, want", [
    ("eth", (False, False, ["eth"])),
    ("^docker, lo", (True, False, ["docker", "lo"])),
    ("=eth0", (False, True, ["eth0"])),
    ("^=eth0,ib0", (True, True, ["eth0", "ib0"])),
])
def test_interface_selector_syntax(text, want):
    assert ifname.parse(text) == want


def test_interface_selector_matches_like_nccl():
    assert ifname.matches("eth0", *ifname.parse("eth"))
    assert not ifname.matches("eth0", *ifname.parse("=eth"))
    assert ifname.matches("eth0", *ifname.parse("=eth0"))
    assert not ifname.matches("docker0", *ifname.parse("^docker,lo"))
    assert ifname.matches("eth1", *ifname.parse("^docker,lo"))
    with pytest.raises(ConfigError, match="RDMAMW_SOCKET_IFNAME='\\^' names no"):
        ifname.parse("^")


def test_interface_selector_picks_the_address(monkeypatch):
    monkeypatch.setenv("RDMAMW_SOCKET_IFNAME", "=lo")
    assert ifname.selected_address() == "127.0.0.1"
    monkeypatch.setenv("RDMAMW_SOCKET_IFNAME", "nosuchif")
    with pytest.raises(ConfigError, match="selects no interface with an IPv4 address "
                       r"\(this host has: lo 127.0.0.1"):
        ifname.selected_address()
    monkeypatch.delenv("RDMAMW_SOCKET_IFNAME")
    assert ifname.selected_address() is None


def test_bad_interface_selector_fails_every_rank():
    procs = start(2, timeout=10, RDMAMW_SOCKET_IFNAME="=nosuchif0")
    try:
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        reap(procs)
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode != 0 and "RDMAMW_SOCKET_IFNAME='=nosuchif0' selects no" in err, err


def test_declared_fabric_setting(monkeypatch):
    monkeypatch.setenv("RDMAMW_VERBS_FABRIC", " lab-1 ")
    assert verbs_rank.declared_fabric() == ("net:lab-1", "")
    monkeypatch.setenv("RDMAMW_VERBS_FABRIC", "x" * 65)
    with pytest.raises(ConfigError, match="RDMAMW_VERBS_FABRIC='xxx.* is not a name of 1 to 64"):
        verbs_rank.declared_fabric()
    monkeypatch.delenv("RDMAMW_VERBS_FABRIC")
    assert verbs_rank.declared_fabric() is None


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_a_channel_says_its_provider_and_logs_what_it_carried(provider, caplog):
    a, b, lst = make_pair(provider=provider)
    try:
        assert a.provider == b.provider == a.stats()["provider"] == provider
        a.send_batch([b"x" * 100] * 3)
        assert len(recv_all(b, 3)) == 3
        with caplog.at_level(logging.INFO, logger="rdmamw.channel"):
            a.close()
            a.close()               # once only
    finally:
        b.close(), lst.close()
    lines = [r.getMessage() for r in caplog.records if "closed" in r.getMessage()]
    assert len(lines) == 1 and f"closed ({provider}): 3 messages / 300 bytes sent in 1 " \
        "batches" in lines[0], lines
