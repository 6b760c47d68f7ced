"""Two network namespaces joined by a veth pair: two "hosts" on one machine (their own
addresses; shm:// names do not cross a namespace). Used by the multi-host tests and by
bench/allreduce_two_hosts.py; needs root and iproute2."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

SUBNET = "10.231.{}.{}"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[dict, dict]]:
    """({name: address}, {name: veth device}) of two fresh namespaces on one link,
    deleted afterwards; CalledProcessError when they cannot be made here."""
    tag = f"{os.getpid() % 100000}"
    a, b = f"rdmamwA{tag}", f"rdmamwB{tag}"
    net = os.getpid() % 250 + 1
    hosts = {a: SUBNET.format(net, 1), b: SUBNET.format(net, 2)}
    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
        ip("link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}",
           "netns", b)
        for ns, dev in ((a, f"va{tag}"), (b, f"vb{tag}")):
            ip("-n", ns, "addr", "add", f"{hosts[ns]}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield hosts, {a: f"va{tag}", b: f"vb{tag}"}
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def shape_link(devs: dict, rate: str = "200mbit") -> None:
    """Limit each namespace's end of the link to ``rate`` (tbf): a slow network."""
    for ns, dev in devs.items():
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                        "tbf", "rate", rate, "burst", "64kb", "latency", "400ms"],
                       check=True, capture_output=True)
