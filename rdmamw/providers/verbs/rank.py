"""Verbs between ranks: the ``"verbs"`` entry of a rank's descriptor in the bootstrap
store, and whether two ranks can reach each other over RDMA.

A rank lists its usable ports (``RDMAMW_VERBS_DEVICE`` / ``_PORT`` / ``_GID_INDEX``
narrow them), each with the GID it uses, the link layer and a *fabric*: the subnet
prefix on InfiniBand (``ib:fe80000000000000``), the IP network of the GID on RoCE
(``roce:10.77.0.0/24``), or the name ``RDMAMW_VERBS_FABRIC`` declares (``net:NAME``:
routed RoCE v2 across subnets, or devices whose netdev this network namespace does not
see). Two ranks connect over verbs when they share a fabric; the
queue pairs are set up through the side channel of the lower rank's one verbs
listener (``addr``), whose address is in the descriptor too. A rank without a usable
port says why instead (``{"why": ...}``). docs/protocol.md has the format."""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rdmamw import config
from rdmamw.errors import ConfigError, ProtocolError, ProviderUnavailable
from rdmamw.providers.verbs import probe as dev
from rdmamw.providers.verbs.address import parse_where

log = logging.getLogger("rdmamw.verbs")
PREFERENCE = 200            # above tcp, below shm (inside a host shm is faster)
LINKS = {0: "infiniband", 1: "infiniband", 2: "ethernet"}
MAX_PORTS = 16
MAX_FABRIC = 64
SIOCGIFNETMASK = 0x891B


@dataclass(frozen=True)
class Port:
    """One usable port of a rank, as its descriptor says."""

    dev: str
    port: int
    gid_index: int
    gid: bytes
    link: str
    fabric: str

    def as_dict(self) -> dict:
        return {"dev": self.dev, "port": self.port, "gid_index": self.gid_index,
                "gid": self.gid, "link": self.link, "fabric": self.fabric}


def _gid_netdev(name: str, port: int, index: int) -> str:
    try:
        with open(f"{dev.SYSFS}/{name}/ports/{port}/gid_attrs/ndevs/{index}") as f:
            return f.read().strip()
    except OSError:
        return ""


def _prefixlen(netdev: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> int | None:
    """The prefix length of ``ip`` on ``netdev`` (None when this namespace has no such
    address there)."""
    if ip.version == 4:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                req = struct.pack("256s", netdev.encode()[:15])
                mask = fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, req)[20:24]
            except OSError:
                return None
        return bin(int.from_bytes(mask, "big")).count("1")
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5] == netdev and parts[0] == ip.packed.hex():
                    return int(parts[2], 16)
    except OSError:
        pass
    return None


def fabric_of(name: str, port: int, index: int, gid: bytes, link: str) -> tuple[str, str]:
    """(fabric, "") or ("", why this GID names no fabric we can compare)."""
    if link == "infiniband":
        return "ib:" + gid[:8].hex(), ""
    ip = ipaddress.IPv6Address(gid)
    addr = ip.ipv4_mapped or ip
    if addr.is_link_local:
        return "", f"GID {addr} is link-local (no IP address on the RoCE device's netdev)"
    netdev = _gid_netdev(name, port, index)
    if not netdev:
        return "", f"sysfs names no netdev for GID index {index}"
    try:
        socket.if_nametoindex(netdev)
    except OSError:
        return "", f"its netdev {netdev} is not in this network namespace"
    plen = _prefixlen(netdev, addr)
    if plen is None:
        return "", f"{netdev} has no address {addr} in this network namespace"
    return f"roce:{ipaddress.ip_network((addr, plen), strict=False)}", ""


def local_ports() -> tuple[list[Port], str]:
    """This host's usable ports (as the settings narrow them), or ([], why none)."""
    try:
        found, why = dev.candidates(config.get("RDMAMW_VERBS_DEVICE"),
                                    config.get("RDMAMW_VERBS_PORT"),
                                    config.get("RDMAMW_VERBS_GID_INDEX"))
    except ProviderUnavailable as e:
        return [], str(e)
    declared = declared_fabric()
    ports = []
    for d, p, index in found:
        label = f"{d['name']} port {p['port']}"
        gids = {i: g for i, g, _t in p["gids"]}
        if index not in gids:
            why.append(f"{label} has no GID at index {index}")
            continue
        link = LINKS.get(p.get("link_layer", 0), "infiniband")
        fabric, no = declared or fabric_of(d["name"], p["port"], index, gids[index], link)
        if not fabric:
            why.append(f"{label}: {no}")
            continue
        ports.append(Port(d["name"], p["port"], index, gids[index], link, fabric))
    if ports:
        return ports[:MAX_PORTS], ""
    return [], "no usable RDMA port: " + ("; ".join(why) or "none matches the settings")


def declared_fabric() -> tuple[str, str] | None:
    """("net:NAME", "") from RDMAMW_VERBS_FABRIC, None when unset; ConfigError when
    it is not a short printable name."""
    name = config.get("RDMAMW_VERBS_FABRIC")
    if not name:
        return None
    if len(name) > MAX_FABRIC or not name.isprintable():
        raise ConfigError(f"RDMAMW_VERBS_FABRIC={name!r} is not a name of 1 to "
                          f"{MAX_FABRIC} printable characters")
    return f"net:{name}", ""


def advertise(ip: str, slots: int, slot_size: int, pin: Any,
              listen: Callable[..., Any]) -> tuple[dict, Any]:
    """This rank's ``"verbs"`` descriptor entry and the verbs listener it names, made
    with ``listen`` (the provider's; None when there is no usable port: the entry says
    why)."""
    ports, why = local_ports()
    if not ports:
        log.info("verbs: no usable port on this host: %s", why)
        return {"why": why}, None
    lst = listen(f"{ip}:0", slots=slots, slot_size=slot_size, pin=pin)
    return {"addr": lst.address, "ports": [p.as_dict() for p in ports]}, lst


def _bad(rank: Any, what: str) -> ProtocolError:
    return ProtocolError(f"rank {rank}'s verbs descriptor from the store is malformed or "
                         f"inconsistent: {what}")


def parse(desc: dict) -> tuple[str, list[Port]] | str:
    """A rank's ``"verbs"`` entry checked: (listener address, ports), or the reason the
    rank has no verbs; ProtocolError for anything malformed or self-contradicting."""
    rank = desc.get("rank")
    v = desc.get("verbs")
    if not isinstance(v, dict):
        raise _bad(rank, f"entry {v!r} is not a map")
    if set(v) == {"why"}:
        if not isinstance(v["why"], str):
            raise _bad(rank, "'why' is not a string")
        return v["why"]
    if set(v) != {"addr", "ports"}:
        raise _bad(rank, f"keys {sorted(v)} are not ['addr', 'ports'] or ['why']")
    addr = v["addr"]
    if not isinstance(addr, str) or not addr.startswith("verbs://"):
        raise _bad(rank, f"listener address {addr!r} is not verbs://HOST:PORT")
    try:
        parse_where(addr[len("verbs://"):])
    except ValueError as e:
        raise _bad(rank, str(e)) from None
    raw = v["ports"]
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_PORTS:
        raise _bad(rank, f"'ports' is not a list of 1 to {MAX_PORTS} ports")
    return addr, [_port(rank, p) for p in raw]


def _port(rank: Any, p: Any) -> Port:
    keys = ("dev", "port", "gid_index", "gid", "link", "fabric")
    if not isinstance(p, dict) or set(p) != set(keys):
        raise _bad(rank, f"port {p!r} does not have exactly the keys {list(keys)}")
    types = (str, int, int, bytes, str, str)
    for k, t in zip(keys, types, strict=True):
        if not isinstance(p[k], t) or isinstance(p[k], bool):
            raise _bad(rank, f"port field {k!r} is not {t.__name__}")
    port = Port(**p)
    if not (0 < len(port.dev) <= 64 and 1 <= port.port <= 255
            and 0 <= port.gid_index <= 0xFFFF and len(port.gid) == 16 and any(port.gid)):
        raise _bad(rank, f"port {port.dev!r} {port.port} GID index {port.gid_index} "
                         f"GID {port.gid.hex()}: out of range")
    if port.link not in ("infiniband", "ethernet"):
        raise _bad(rank, f"link layer {port.link!r}")
    if port.fabric.startswith("net:"):      # declared (RDMAMW_VERBS_FABRIC)
        if not 0 < len(port.fabric) - 4 <= MAX_FABRIC or not port.fabric.isprintable():
            raise _bad(rank, f"declared fabric {port.fabric!r}")
        return port
    if port.link == "infiniband":
        if port.fabric != "ib:" + port.gid[:8].hex():
            raise _bad(rank, f"fabric {port.fabric!r} is not the subnet prefix of GID "
                             f"{port.gid.hex()}")
        return port
    ip = ipaddress.IPv6Address(port.gid)
    ip = ip.ipv4_mapped or ip
    try:
        net = ipaddress.ip_network(port.fabric.removeprefix("roce:"))
    except ValueError:
        net = None
    if not port.fabric.startswith("roce:") or net is None or ip not in net:
        raise _bad(rank, f"fabric {port.fabric!r} does not hold the GID's address {ip}")
    return port


def pair(lower: dict, higher: dict) -> tuple[Port, Port] | str:
    """The ports two ranks use (the lower rank's first port whose fabric the other has,
    and the other's first port on it), or why there is none. Both ranks compute it
    from the same two descriptors, so they agree."""
    a, b = parse(lower), parse(higher)
    for d, p in ((lower, a), (higher, b)):
        if isinstance(p, str):
            return f"rank {d.get('rank')} has no usable RDMA port ({p})"
    assert not isinstance(a, str) and not isinstance(b, str)
    for pa in a[1]:
        for pb in b[1]:
            if pa.fabric == pb.fabric:
                return pa, pb
    fa = sorted({p.fabric for p in a[1]})
    fb = sorted({p.fabric for p in b[1]})
    return (f"no common fabric: rank {lower.get('rank')} is on {', '.join(fa)}, rank "
            f"{higher.get('rank')} on {', '.join(fb)}")


def can_connect(me: dict, peer: dict) -> tuple[int, str]:
    """(preference, why): :data:`PREFERENCE` when the two share a fabric, else 0."""
    lower, higher = sorted((me, peer), key=lambda d: d.get("rank", 0))
    got = pair(lower, higher)
    if isinstance(got, str):
        return 0, got
    pa, pb = got
    return PREFERENCE, (f"common fabric {pa.fabric} ({pa.dev} port {pa.port} / {pb.dev} "
                        f"port {pb.port})")
