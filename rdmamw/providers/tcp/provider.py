"""The ``tcp`` provider's control path: listen / connect, token check, ring hellos.

``tcp://HOST:PORT`` (``PORT`` 0 = ephemeral; the listener reports the bound port).
Each connection first proves the shared token both ways (rdmamw.auth), then the
two sides exchange msgpack hellos with their ring sizes, allocate their blocks and
hand the socket to the C progress thread (rdmamw/providers/tcp/_transport.pyx). The listener
serves handshakes concurrently (rdmamw/listener.py): a peer that fails any
step or its deadline is logged and dropped; the listener keeps accepting.

Liveness judges the peer process and its host apart. A killed process closes its
socket (EOF/RST): PeerLost at once. A process stopped or starved sends nothing, but
its kernel still acknowledges our heartbeats: it is lost only after
``RDMAMW_TCP_PEER_TIMEOUT`` (s without a byte from it, default 30; also the kernel's
TCP_USER_TIMEOUT, which cannot tell a stopped peer whose buffers are full from a dead
host). A host that acknowledges nothing either (link down, power off) is lost after
``RDMAMW_TCP_HOST_TIMEOUT`` (default 1.5). ``RDMAMW_TCP_HEARTBEAT``: s between
heartbeats while idle (default 0.25).

Each hello also carries ``rid``, the endpoint's random identity, which the references
of the regions it exposes carry (docs/remote-memory.md); a peer without it has no
regions. ``ratom`` 1 says the endpoint serves atomics on its regions (a peer without it
is never sent one: an older owner would hang up on it)."""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from rdmamw import auth, config
from rdmamw.errors import ConfigError, PeerNotFound, ProtocolError, RdmamwError, Timeout
from rdmamw.listener import KERNEL_BACKLOG, HandshakeListener
from rdmamw.providers import Connected
from rdmamw.providers.base import Advert, RankPair
from rdmamw.providers.tcp._transport import TcpTransport, alloc_block, free_block
from rdmamw.transport import layout
from rdmamw.transport.wire import PROTOCOL_VERSION, check_hello, field, recv_frame, send_frame
from rdmamw.vocabulary import WRITE

log = logging.getLogger("rdmamw.tcp")


def heartbeat() -> float:
    return config.get("RDMAMW_TCP_HEARTBEAT")


def peer_timeout() -> float:
    return config.get("RDMAMW_TCP_PEER_TIMEOUT")


def host_timeout() -> float:
    return config.get("RDMAMW_TCP_HOST_TIMEOUT")


def parse(where: str) -> tuple[str, int]:
    """``"HOST:PORT"`` / ``"[V6]:PORT"`` -> (host, port), or ConfigError (a ValueError)."""
    host, sep, port = where.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"tcp address {where!r} is not HOST:PORT (PORT 0..65535)")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, int(port)


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tune(sock: socket.socket) -> None:
    """No Nagle; a dead peer is noticed by the kernel too (keepalive, user timeout: the
    peer timeout, as the kernel cannot tell a stopped peer from a dead host)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                    max(1, int(peer_timeout() * 1000)))


def parse_hello(peer: dict, accepting: bool) -> dict:
    """The checked fields of a peer's hello, or ProtocolError (a fuzz target)."""
    slots, slot_size, mode = check_hello(peer, PROTOCOL_VERSION, None if accepting else "")
    out = {"slots": slots, "slot_size": slot_size}
    hb = peer.get("hb", 0.25)
    if not isinstance(hb, (int, float)) or isinstance(hb, bool) or not 0 <= hb <= 60:
        raise ProtocolError("handshake field 'hb' is not a heartbeat interval")
    out["hb"] = float(hb)
    rid = peer.get("rid", 0)
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid < 1 << 64:
        raise ProtocolError("handshake field 'rid' is not a region identity")
    out["rid"] = rid
    ratom = peer.get("ratom", 0)
    if not isinstance(ratom, int) or isinstance(ratom, bool) or ratom not in (0, 1):
        raise ProtocolError("handshake field 'ratom' is not 0 or 1")
    out["ratom"] = ratom
    if accepting:
        out["mode"] = mode
        if "rank" in peer:
            out["rank"] = field(peer, "rank", int)
            if not 0 <= out["rank"] < 1 << 31:
                raise ProtocolError(f"peer claims rank {out['rank']}")
        if "gen" in peer:
            out["gen"] = field(peer, "gen", int)
            if not 0 <= out["gen"] < 1 << 31:
                raise ProtocolError(f"peer claims generation {out['gen']}")
    return out


def handshake(conn: socket.socket, slots: int, slot_size: int, mode: str | None,
              rank: int | None, peer_name: str | None = None, gen: int = 0) -> Connected:
    """Token check, hellos, blocks; ``mode`` is given by the opener, None on accept.
    Any connected stream socket will do (a provider may run the tcp transport over
    its own sockets: tests/uds_provider.py); ``peer_name`` names the peer (default
    ``tcp://HOST:PORT`` of the socket's peer)."""
    layout.check_ring(slots, slot_size)
    if mode is None:
        auth.accept_side(conn)
    else:
        auth.open_side(conn)
    rid = secrets.randbits(64) | 1         # never 0: "no regions"
    hello = {"v": PROTOCOL_VERSION, "slots": slots, "slot_size": slot_size,
             "hb": heartbeat(), "rid": rid, "ratom": 1}
    if mode is not None:
        hello["mode"] = mode
        if rank is not None:
            hello["rank"] = rank
            if gen:
                hello["gen"] = gen      # a re-joined rank's process (bootstrap/rejoin.py)
    send_frame(conn, hello)
    peer = parse_hello(recv_frame(conn), accepting=mode is None)
    peer_slots, peer_slot_size, peer_hb = peer["slots"], peer["slot_size"], peer["hb"]
    mode = mode or peer["mode"]
    mine = layout.endpoint_layout(slots, slot_size, peer_slots)
    theirs = layout.endpoint_layout(peer_slots, peer_slot_size, slots)
    if peer_name is None:
        host, port = conn.getpeername()[:2]
        peer_name = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    block = alloc_block(mine.total)
    evfd = -1
    try:
        evfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        tp = TcpTransport()
        conn.setblocking(False)
        tp._attach(conn.fileno(), evfd, block, mine.total, mine.regions(), theirs.regions(),
                   heartbeat(), max(peer_timeout(), 4 * peer_hb), host_timeout())
        tp._set_region_ids(rid, peer["rid"], peer["ratom"] == 1)
    except BaseException:
        free_block(block, mine.total)
        if evfd >= 0:
            os.close(evfd)
        raise
    conn.detach()               # the transport owns the socket, eventfd and block now
    return Connected(tp, slots, slot_size, peer_slots, peer_slot_size, mode, peer_name,
                     peer.get("rank"), peer.get("gen", 0))


class TcpListener(HandshakeListener[Connected]):
    """Accepts tcp connections; bad or unauthenticated peers are logged and dropped."""

    provider = "tcp"

    def __init__(self, where: str, slots: int, slot_size: int) -> None:
        layout.check_ring(slots, slot_size)
        host, port = parse(where)
        self.slots, self.slot_size = slots, slot_size
        sock = socket.socket(_family(host), socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise RdmamwError(f"tcp://{where}: port {port} is already in use") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise RdmamwError(f"tcp://{where}: {host} is not an address of this "
                                  f"host") from None
            raise
        sock.listen(KERNEL_BACKLOG)
        self.host, self.port = host, sock.getsockname()[1]
        try:
            super().__init__(sock, log)
        except BaseException:
            sock.close()
            raise

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def _handshake(self, conn: socket.socket, addr) -> Connected:
        _tune(conn)
        return handshake(conn, self.slots, self.slot_size, None, None)


def listen(where: str, *, slots: int, slot_size: int) -> TcpListener:
    return TcpListener(where, slots, slot_size)


def connect(where: str, *, mode: str, timeout: float, slots: int, slot_size: int,
            rank: int | None = None, gen: int = 0,
            alive: Callable[[], None] | None = None) -> Connected:
    """Connect to ``tcp://where``, retrying until ``timeout`` while nobody listens (and
    ``alive()`` raises nothing: a rank's peer that ended)."""
    host, port = parse(where)
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket(_family(host), socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            conn.connect((host, port))
            break
        except (ConnectionRefusedError, ConnectionResetError):
            conn.close()
            if time.monotonic() >= deadline:
                raise PeerNotFound(f"nobody listens on tcp://{where} "
                                   f"(waited {timeout:g} s)") from None
            if alive is not None:
                alive()
            time.sleep(0.02)
        except (TimeoutError, OSError) as e:
            conn.close()
            raise PeerNotFound(f"tcp://{where} is unreachable: {e}") from None
    try:
        _tune(conn)
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        return handshake(conn, slots, slot_size, mode, rank, gen=gen)
    except TimeoutError:
        conn.close()
        raise Timeout(f"handshake with tcp://{where} timed out") from None
    except BaseException:
        if conn.fileno() >= 0:
            conn.close()
        raise


class TcpProvider:
    """tcp between any two hosts whose listener addresses route: the last resort. Its
    descriptor part is the address of the listener this rank accepts channels on."""

    scheme = "tcp"
    preference = 100
    network = True
    authenticates = True
    #: untuned: READ is a request/response round trip, WRITE pushes at once
    rendezvous_default = {"strategy": WRITE, "threshold": 64 << 10}
    listen = staticmethod(listen)
    connect = staticmethod(connect)

    def status(self) -> tuple[bool, str]:
        return True, "any host (sockets and a progress thread)"

    def info(self) -> list[str]:
        return []

    def can_connect(self, me: dict, peer: dict) -> tuple[int, str]:
        """tcp when both ranks advertised a listener address."""
        if not (isinstance(me.get("tcp"), str) and isinstance(peer.get("tcp"), str)):
            return 0, "a rank has no tcp listener address"
        return self.preference, "tcp reaches every host"

    def check_entry(self, entry: object) -> None:
        if isinstance(entry, dict) and set(entry) == {"why"} and isinstance(entry["why"], str):
            return              # this rank could not listen, and says why
        if not (isinstance(entry, str) and entry.startswith("tcp://") and len(entry) <= 300):
            raise ProtocolError(f"descriptor has a bad tcp address {entry[:80]!r}"
                                if isinstance(entry, str) else
                                f"descriptor has a bad tcp address {entry!r}")
        try:
            parse(entry.partition("://")[2])
        except ValueError as e:
            raise ProtocolError(f"descriptor has a bad tcp address {entry!r}: {e}") from None

    def advertise(self, advert: Advert) -> tuple[str, TcpListener]:
        lst = listen(f"{advert.ip}:0", slots=advert.slots, slot_size=advert.slot_size)
        return lst.address, lst

    def connect_rank(self, pair: RankPair, *, mode: str, timeout: float, slots: int,
                     slot_size: int) -> Connected:
        """The lower rank accepts on its listener; the other connects to its address."""
        if pair.lower:
            return pair.accept_within(pair.accept, timeout)
        return connect(pair.theirs["tcp"].partition("://")[2], mode=mode, timeout=timeout,
                       slots=slots, slot_size=slot_size, rank=pair.me,
                       gen=pair.mine.get("gen", 0), alive=pair.check_alive)


PROVIDER = TcpProvider()
