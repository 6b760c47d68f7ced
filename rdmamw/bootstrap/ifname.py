"""``RDMAMW_SOCKET_IFNAME``: which network interface the tcp listener, the verbs side
channel and the connection to the store use, as NCCL_SOCKET_IFNAME / DMLC_INTERFACE
choose it. A comma-separated list of name prefixes (``eth,ib``); ``=`` before the list
asks for exact names (``=eth0``), ``^`` excludes (``^docker,lo``). Unset: the address
this host reaches rank 0's store from."""

from __future__ import annotations

import fcntl
import socket
import struct

from rdmamw import config
from rdmamw.errors import ConfigError

SIOCGIFADDR = 0x8915
ENV = "RDMAMW_SOCKET_IFNAME"


def parse(text: str) -> tuple[bool, bool, list[str]]:
    """(exclude, exact, names) of a selector, or ConfigError."""
    spec = text.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"{ENV}={text!r} names no interface; e.g. eth0, ib, =eth0 or "
                          f"^docker,lo")
    return exclude, exact, names


def matches(name: str, exclude: bool, exact: bool, names: list[str]) -> bool:
    hit = any(name == n if exact else name.startswith(n) for n in names)
    return hit != exclude


def ipv4_interfaces() -> list[tuple[str, str]]:
    """(name, IPv4 address) of this network namespace's interfaces that have one."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _i, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            out.append((name, socket.inet_ntoa(got[20:24])))
    return out


def selected_address() -> str | None:
    """The IPv4 address of the first interface ``RDMAMW_SOCKET_IFNAME`` selects (None
    when unset); ConfigError when it selects none."""
    text = config.get(ENV)
    if not text.strip():
        return None
    rule = parse(text)
    have = ipv4_interfaces()
    for name, ip in have:
        if matches(name, *rule):
            return ip
    listed = ", ".join(f"{n} {ip}" for n, ip in have) or "none"
    raise ConfigError(f"{ENV}={text!r} selects no interface with an IPv4 address (this "
                      f"host has: {listed})")
