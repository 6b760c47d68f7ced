"""A provider made outside the package, from docs/architecture.md ("Where a newcomer adds
a provider") alone: ``uds://NAME``, the tcp provider's transport over a Unix-domain
stream socket (an abstract name: nothing on disk), between processes of one host.

It is registered through ``RDMAMW_PROVIDER_PLUGINS=uds_provider`` (with this folder on
``PYTHONPATH``) in every process of a test job, and tests/providers/test_provider_shape.py shows
that the channel suite passes on it and that the bootstrap chooses it (its preference,
400, beats shm's) with no change anywhere else."""

from __future__ import annotations

import logging
import socket
import time

from rdmamw.errors import PeerNotFound, ProtocolError, RdmamwError, Timeout
from rdmamw.listener import HandshakeListener
from rdmamw.providers import Connected
from rdmamw.providers.base import Advert, RankPair
from rdmamw.providers.tcp import provider as tcp
from rdmamw.transport import layout

log = logging.getLogger("rdmamw.uds")
_PREFIX = b"\0rdmamw-uds-test/"


def _address(name: str) -> bytes:
    if not name or "/" in name or len(name) > 80:
        raise ValueError(f"uds name {name!r} is not 1 to 80 characters without '/'")
    return _PREFIX + name.encode()


class UdsListener(HandshakeListener[Connected]):
    """Accepts uds:// connections; each runs the tcp handshake (token, hellos, blocks)."""

    def __init__(self, name: str, slots: int, slot_size: int) -> None:
        layout.check_ring(slots, slot_size)
        self.name, self.slots, self.slot_size = name, slots, slot_size
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(_address(name))
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise RdmamwError(f"uds://{name} cannot listen: {e}") from None
        super().__init__(sock, log)

    @property
    def address(self) -> str:
        return f"uds://{self.name}"

    def _handshake(self, conn: socket.socket, addr) -> Connected:
        return tcp.handshake(conn, self.slots, self.slot_size, None, None,
                             f"uds://{self.name}")


def listen(where: str, *, slots: int, slot_size: int) -> UdsListener:
    return UdsListener(where, slots, slot_size)


def connect(where: str, *, mode: str, timeout: float, slots: int, slot_size: int,
            rank: int | None = None) -> Connected:
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            conn.connect(_address(where))
            break
        except (ConnectionRefusedError, FileNotFoundError):
            conn.close()
            if time.monotonic() >= deadline:
                raise PeerNotFound(f"nobody listens on uds://{where}") from None
            time.sleep(0.01)
    try:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        return tcp.handshake(conn, slots, slot_size, mode, rank, f"uds://{where}")
    except TimeoutError:
        raise Timeout(f"handshake with uds://{where} timed out") from None
    finally:
        if conn.fileno() >= 0:
            conn.close()


class UdsProvider:
    scheme = "uds"
    preference = 400            # beats shm: a job that loads it uses it inside a host
    network = False
    authenticates = True
    rendezvous_default = tcp.PROVIDER.rendezvous_default    # the same transport
    listen = staticmethod(listen)
    connect = staticmethod(connect)

    def status(self) -> tuple[bool, str]:
        return True, "this host (tests/support/uds_provider.py)"

    def info(self) -> list[str]:
        return ["a test provider: the tcp transport over Unix-domain sockets"]

    def can_connect(self, me: dict, peer: dict) -> tuple[int, str]:
        if not (isinstance(me.get("uds"), str) and isinstance(peer.get("uds"), str)):
            return 0, "a rank has no uds listener"
        if me.get("host") != peer.get("host"):
            return 0, "different hosts"
        return self.preference, "same host, uds listeners on both"

    def check_entry(self, entry: object) -> None:
        if not (isinstance(entry, str) and entry.startswith("uds://")):
            raise ProtocolError(f"descriptor has a bad uds address {entry!r}")

    def advertise(self, advert: Advert) -> tuple[str, UdsListener]:
        lst = listen(f"{id(advert):x}-{time.monotonic_ns()}", slots=advert.slots,
                     slot_size=advert.slot_size)
        return lst.address, lst

    def connect_rank(self, pair: RankPair, *, mode: str, timeout: float, slots: int,
                     slot_size: int) -> Connected:
        if pair.lower:
            return pair.accept(timeout)
        return connect(pair.theirs["uds"].partition("://")[2], mode=mode, timeout=timeout,
                       slots=slots, slot_size=slot_size, rank=pair.me)


PROVIDER = UdsProvider()
