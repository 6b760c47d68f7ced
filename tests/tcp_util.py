"""A hand-made tcp peer for tests: authenticates and says hello like rdmamw, then
lets the test put any bytes on the wire (frames the real provider would never send)."""

from __future__ import annotations

import socket
import struct

from rdmamw import auth
from rdmamw.providers import tcp
from rdmamw.providers._wire import recv_frame, send_frame

FRAME = struct.Struct("<HHIQ")       # type, region, length, offset
WRITE, PUBLISH, WAKE, READ_REQ, READ_RESP, HEARTBEAT, WRITE_IMM = range(1, 8)


def raw_peer(address: str, slots: int = 16, slot_size: int = 4096,
             key: bytes | None = None) -> socket.socket:
    """Connect to an rdmamw tcp listener as an opener and finish the handshake."""
    host, port = tcp.parse(address.partition("://")[2])
    s = socket.create_connection((host, port), timeout=5)
    auth.open_side(s, key)
    send_frame(s, {"v": 1, "slots": slots, "slot_size": slot_size, "mode": "batched",
                   "hb": 0.25})
    recv_frame(s)
    return s


def frame(kind: int, region: int = 0, offset: int = 0, payload: bytes = b"",
          length: int | None = None) -> bytes:
    return FRAME.pack(kind, region, len(payload) if length is None else length,
                      offset) + payload
