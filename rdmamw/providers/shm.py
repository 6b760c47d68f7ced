"""The ``shm`` provider's control path: rendezvous on an abstract Unix socket.

``shm://NAME`` is the abstract socket ``\\0rdmamw-shm/NAME`` (nothing on disk). A
connection exchanges msgpack hellos (ring sizes, mode), then each side hands the other
an anonymous memfd holding its block and an eventfd for wake-ups (SCM_RIGHTS). No
segment has a name, so nothing is ever left in /dev/shm, even after SIGKILL: the
memory goes when the last mapping does. Only processes of the same user may connect
(SO_PEERCRED)."""

from __future__ import annotations

import errno
import os
import socket
import struct
import time

import msgpack

from rdmamw import _layout
from rdmamw.errors import PeerNotFound, ProtocolError, RdmamwError, Timeout
from rdmamw.providers import Connected
from rdmamw.providers import _wire as fr
from rdmamw.providers._shm import ShmTransport

PROTOCOL_VERSION = 1
_PREFIX = b"\0rdmamw-shm/"


def _address(name: str) -> bytes:
    if not name or "\0" in name or "/" in name[:1]:
        raise ValueError(f"bad shm name {name!r}")
    raw = _PREFIX + name.encode()
    if len(raw) > 107:
        raise ValueError(f"shm name {name!r} is too long (max {107 - len(_PREFIX)} bytes)")
    return raw


def _check_peer_user(conn: socket.socket) -> None:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid() and os.getuid() != 0:
        raise RdmamwError(f"refusing shm peer of uid {uid}")


def _regions(lay: _layout.Layout) -> tuple:
    # order = RM_REGION_CTRL, ARRIVAL, RECLAIM, RING
    return (
        (lay.ctrl, _layout.CTRL_SIZE),
        (lay.arrival, lay.arrival_len),
        (lay.reclaim, lay.reclaim_len),
        (lay.ring, lay.ring_len),
    )


def _handshake(conn: socket.socket, name: str, slots: int, slot_size: int,
               mode: str | None) -> Connected:
    """Exchange hellos and blocks. ``mode`` is given by the opener, None on accept."""
    _layout.check_ring(slots, slot_size)
    hello = {"v": PROTOCOL_VERSION, "slots": slots, "slot_size": slot_size, "pid": os.getpid()}
    if mode is not None:
        hello["mode"] = mode
    fr.send_frame(conn, hello)
    peer_slots, peer_slot_size, mode = fr.check_hello(fr.recv_frame(conn), PROTOCOL_VERSION, mode)

    mine = _layout.endpoint_layout(slots, slot_size, peer_slots)
    theirs = _layout.endpoint_layout(peer_slots, peer_slot_size, slots)
    memfd = os.memfd_create(f"rdmamw-shm-{name}", os.MFD_CLOEXEC)
    evfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    peer_fds: list[int] = []
    try:
        os.fchmod(memfd, 0o600)   # no name to find it by; and no group/other rights either
        os.ftruncate(memfd, mine.total)
        socket.send_fds(conn, [msgpack.packb({"size": mine.total})], [memfd, evfd])
        data, peer_fds, _flags, _addr = socket.recv_fds(conn, fr.MAX_HELLO, 2)
        if len(peer_fds) != 2:
            raise ProtocolError(f"peer sent {len(peer_fds)} descriptors, expected 2")
        info = msgpack.unpackb(data) if data else None
        peer_size = os.fstat(peer_fds[0]).st_size
        if not isinstance(info, dict) or info.get("size") != theirs.total \
                or peer_size < theirs.total:
            raise ProtocolError(f"peer block is {peer_size} bytes, expected {theirs.total}")
        tp = ShmTransport()
        tp._attach(conn.fileno(), memfd, mine.total, peer_fds[0], theirs.total, evfd,
                   peer_fds[1], _regions(mine), _regions(theirs))
        conn.detach()           # the transport owns the socket now
        evfd = peer_fds[1] = -1  # ... and both eventfds
    finally:
        for fd in (memfd, evfd, *peer_fds[:1], *peer_fds[1:]):
            if fd >= 0:
                os.close(fd)
    return Connected(tp, slots, slot_size, peer_slots, peer_slot_size, mode, f"shm://{name}")


class ShmListener:
    """Accepts shm connections on ``shm://NAME``."""

    def __init__(self, name: str, slots: int, slot_size: int) -> None:
        _layout.check_ring(slots, slot_size)
        self.name, self.slots, self.slot_size = name, slots, slot_size
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(_address(name))
        except OSError as e:
            self._sock.close()
            if e.errno == errno.EADDRINUSE:
                raise RdmamwError(f"shm://{name} is already being listened on") from None
            raise
        self._sock.listen(128)

    @property
    def address(self) -> str:
        return f"shm://{self.name}"

    def accept(self, timeout: float | None) -> Connected:
        self._sock.settimeout(timeout)
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise Timeout(f"no connection to {self.address} within {timeout} s") from None
        try:
            conn.settimeout(10.0 if timeout is None else max(timeout, 1.0))
            _check_peer_user(conn)
            return _handshake(conn, self.name, self.slots, self.slot_size, None)
        except BaseException:
            if conn.fileno() >= 0:
                conn.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()


def listen(where: str, *, slots: int, slot_size: int) -> ShmListener:
    return ShmListener(where, slots, slot_size)


def connect(where: str, *, mode: str, timeout: float, slots: int, slot_size: int) -> Connected:
    """Connect to ``shm://where``, retrying until ``timeout`` while nobody listens."""
    addr = _address(where)
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            conn.connect(addr)
            break
        except (ConnectionRefusedError, FileNotFoundError):
            conn.close()
            if time.monotonic() >= deadline:
                raise PeerNotFound(f"nobody listens on shm://{where} "
                                   f"(waited {timeout:g} s)") from None
            time.sleep(0.01)
        except TimeoutError:
            conn.close()
            raise PeerNotFound(f"shm://{where} did not answer within {timeout:g} s") from None
    try:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        _check_peer_user(conn)
        return _handshake(conn, where, slots, slot_size, mode)
    except TimeoutError:
        conn.close()
        raise Timeout(f"handshake with shm://{where} timed out") from None
    except BaseException:
        if conn.fileno() >= 0:
            conn.close()
        raise
