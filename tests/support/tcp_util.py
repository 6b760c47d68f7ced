"""A hand-made tcp peer for tests: authenticates and says hello like rdmamw, then
lets the test put any bytes on the wire (frames the real provider would never send)."""

from __future__ import annotations

import socket
import struct

from rdmamw import auth
from rdmamw.providers.tcp import provider as tcp
from rdmamw.transport.wire import recv_frame, send_frame

FRAME = struct.Struct("<HHIQ")       # type, region, length, offset
WRITE, PUBLISH, WAKE, READ_REQ, READ_RESP, HEARTBEAT, WRITE_IMM = range(1, 8)
XREAD_REQ, XWRITE, READ_ERR, RCHAIN, RDONE = range(8, 13)
#: a region operation's descriptor in an RCHAIN frame (rm_tcp_region.h rt_rdesc):
#: op (1 READ, 2 WRITE, 3 FETCH_ADD, 4 CMP_SWAP), key, tag, address, length, reserved
RDESC = struct.Struct("<HHIQII")
OP_READ, OP_WRITE, OP_FADD, OP_CSWAP = 1, 2, 3, 4
#: an atomic's payload (its two operands) and its answer (the word's old value)
OPERANDS, WORD = struct.Struct("<QQ"), struct.Struct("<Q")


def raw_peer(address: str, slots: int = 16, slot_size: int = 4096,
             key: bytes | None = None, rid: int = 0, ratom: int = 0) -> socket.socket:
    """Connect to an rdmamw tcp listener as an opener and finish the handshake; with
    ``rid`` (a region identity), the listener's channel may post region chains to it
    (and atomics too with ``ratom`` 1)."""
    host, port = tcp.parse(address.partition("://")[2])
    s = socket.create_connection((host, port), timeout=5)
    auth.open_side(s, key)
    hello = {"v": 1, "slots": slots, "slot_size": slot_size, "mode": "batched", "hb": 0.25}
    send_frame(s, {**hello, "rid": rid, **({"ratom": ratom} if ratom else {})} if rid
               else hello)
    recv_frame(s)
    return s


def frame(kind: int, region: int = 0, offset: int = 0, payload: bytes = b"",
          length: int | None = None) -> bytes:
    return FRAME.pack(kind, region, len(payload) if length is None else length,
                      offset) + payload


def rchain(ops: list[tuple], payloads: list[bytes] = ()) -> bytes:
    """An RCHAIN frame: ``ops`` are (op, key, tag, address, length[, reserved]), then the
    payloads of its WRITEs and atomics (OPERANDS) as given (a test may send fewer bytes
    than it announces)."""
    descs = b"".join(RDESC.pack(*op, *(() if len(op) == 6 else (0,))) for op in ops)
    return FRAME.pack(RCHAIN, len(ops), len(descs), 0) + descs + b"".join(payloads)


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = s.recv(min(n - len(out), 1 << 20))
        if not got:
            raise EOFError(f"the connection ended after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


def next_frame(s: socket.socket) -> tuple[int, int, int, int, bytes]:
    """The next answer to a READ or a chain (READ_RESP, READ_ERR, RDONE) as (type, region,
    length, offset, payload), past what the engine sends on its own (its writes, words,
    wake-ups, heartbeats)."""
    while True:
        kind, region, length, offset = FRAME.unpack(recv_exact(s, FRAME.size))
        body = recv_exact(s, length) if kind in (WRITE, PUBLISH, WRITE_IMM, XWRITE,
                                                 READ_RESP) else b""
        if kind in (READ_RESP, READ_ERR, RDONE):
            return kind, region, length, offset, body


REGION = 4096        # region size of rdmamw.providers.tcp._transport.apply_stream's harness


def random_frame(rng) -> bytes:
    """One frame, mostly near the edges of what is legal (``rng``: random.Random)."""
    kind = rng.choice([WRITE, WRITE, PUBLISH, PUBLISH, WAKE, HEARTBEAT, READ_REQ, READ_RESP,
                       WRITE_IMM, 0, 8, rng.randrange(1 << 16)])
    region = rng.choice([0, 1, 2, 3, 3, 4, rng.randrange(1 << 16)])
    edge = [0, 8, REGION - 8, REGION, REGION + 8, rng.randrange(REGION + 64),
            (1 << 64) - 8, rng.randrange(1 << 64)]
    offset = rng.choice(edge)
    length = rng.choice([0, 1, 8, 16, REGION - offset % REGION, REGION, REGION + 8,
                         rng.randrange(64), 0xFFFFFFFF])
    length &= 0xFFFFFFFF
    body = rng.randbytes(min(length, REGION + 64, rng.choice([0, length, length, 64])))
    raw = FRAME.pack(kind, region, length, offset) + body
    if rng.random() < 0.1:                                  # a torn or garbled frame
        cut = rng.randrange(len(raw) + 1)
        raw = raw[:cut] + rng.randbytes(rng.randrange(24))
    return raw


def random_stream(rng, max_frames: int = 6) -> bytes:
    """A few legal frames, then whatever random_frame gives."""
    legal = [frame(WRITE, 3, rng.randrange(0, REGION - 64, 8), rng.randbytes(64)),
             frame(PUBLISH, 1, 0, rng.randbytes(8)), frame(WAKE), frame(HEARTBEAT)]
    out = [rng.choice(legal) for _ in range(rng.randrange(3))]
    out += [random_frame(rng) for _ in range(rng.randrange(1, max_frames))]
    return b"".join(out)
