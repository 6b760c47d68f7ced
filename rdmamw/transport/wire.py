"""Length-prefixed msgpack frames for connection set-up (shm, tcp, verbs, the
bootstrap store): one reader that refuses oversized, malformed or non-map frames with a
ProtocolError instead of trusting the peer."""

from __future__ import annotations

import socket
import struct

import msgpack

from rdmamw.errors import ProtocolError
from rdmamw.transport import layout
from rdmamw.vocabulary import MODES as MODES  # the channel modes, for those importing them here
from rdmamw.vocabulary import check_mode

MAX_HELLO = 4096
#: the version every provider's hello carries (docs/protocol.md); bumped on any change
#: to the ring layout, the slot headers or the control words
PROTOCOL_VERSION = 1


def send_frame(conn: socket.socket, obj: dict) -> None:
    data = msgpack.packb(obj)
    conn.sendall(struct.pack("<I", len(data)) + data)


def recv_exact(conn: socket.socket, n: int, error: type[Exception] = ProtocolError,
               why: str = "peer closed the connection during the handshake") -> bytes:
    """Exactly n bytes, or ``error(why)`` when the peer hangs up first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise error(why)
        buf += chunk
    return bytes(buf)


def decode(data: bytes) -> dict:
    """A msgpack map, or ProtocolError (also the fuzz target of the decoders)."""
    try:
        obj = msgpack.unpackb(data, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:
        raise ProtocolError(f"malformed handshake frame: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("handshake frame is not a map")
    return obj


def recv_frame(conn: socket.socket, limit: int = MAX_HELLO) -> dict:
    (n,) = struct.unpack("<I", recv_exact(conn, 4))
    if n > limit:
        raise ProtocolError(f"handshake frame of {n} bytes (limit {limit})")
    return decode(recv_exact(conn, n))


def field(hello: dict, key: str, kind: type):
    """hello[key] if it is a ``kind`` (bool never counts as int), else ProtocolError."""
    value = hello.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProtocolError(f"handshake field {key!r} missing or not {kind.__name__}")
    return value


def check_hello(peer: dict, version: int, mode: str | None) -> tuple[int, int, str]:
    """The peer's (slots, slot_size, mode); ``mode`` is ours if we opened, else None."""
    if field(peer, "v", int) != version:
        raise ProtocolError(f"peer speaks protocol version {peer['v']}, we speak {version}")
    peer_slots, peer_slot_size = field(peer, "slots", int), field(peer, "slot_size", int)
    layout.check_peer_ring(peer_slots, peer_slot_size)
    if mode is None:
        mode = check_mode(field(peer, "mode", str), ProtocolError, "the mode a peer asks for")
    return peer_slots, peer_slot_size, mode

