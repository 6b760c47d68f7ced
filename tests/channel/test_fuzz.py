"""Fuzz the decoders: whatever a peer writes into our ring or sends in a handshake,
we deliver in-bounds messages or raise ProtocolError; never crash, never read outside
the slot."""

from __future__ import annotations

import ctypes
import os
import socket
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdmamw
from rdmamw.providers.shm import provider as shm
from rdmamw.transport import wire as _wire
from tests.support import hooks
from tests.support.helpers import make_pair

SLOT = 256
HDR = struct.Struct("<QIHHII")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    used=st.one_of(st.integers(0, SLOT + 16), st.integers(0, 2**32 - 1)),
    count=st.one_of(st.integers(0, 40), st.integers(0, 2**16 - 1)),
    flags=st.integers(0, 4),
    body=st.binary(min_size=0, max_size=SLOT),
    keep_seq=st.booleans(),
)
def test_fuzz_slot_decoder(used, count, flags, body, keep_seq):
    a, b, lst = make_pair(slots=2, slot_size=SLOT)
    try:
        a.send_batch([b"seed-one", b"seed-two"])
        (slot,) = b.diagnostics()["pending"]
        addr = hooks.slot_address(b, slot)
        seq = 0 if keep_seq else 7
        ctypes.memmove(addr, HDR.pack(seq, used, count, flags, ~seq & 0xFFFFFFFF, 0), HDR.size)
        ctypes.memmove(addr + 64, body, len(body))
        lo, hi = addr + 64, addr + 64 + SLOT
        try:
            msgs = b.recv_batch(timeout=0.5)
        except rdmamw.ProtocolError:
            return
        for m in msgs:
            view = memoryview(m)
            assert len(view) <= SLOT
            buf_addr = _address(view)
            assert lo <= buf_addr and buf_addr + len(view) <= hi
            view.release()
            m.release()
    finally:
        a.close(), b.close(), lst.close()


def _address(view: memoryview) -> int:
    import numpy as np
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_fuzz_handshake_frame(payload):
    s1, s2 = socket.socketpair()
    try:
        s1.sendall(struct.pack("<I", len(payload)) + payload)
        s1.shutdown(socket.SHUT_WR)
        s2.settimeout(2)
        try:
            frame = _wire.recv_frame(s2)
        except rdmamw.ProtocolError:
            return
        assert isinstance(frame, dict)
    finally:
        s1.close(), s2.close()


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "slots", "slot_size", "mode", "pid", "x"]),
                       st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=8),
                                 st.booleans(), st.none(), st.binary(max_size=8))))
def test_fuzz_handshake_hello(hello):
    """Any hello map: accept either agrees to it or raises ProtocolError."""
    import msgpack
    s1, s2 = socket.socketpair()
    try:
        data = msgpack.packb(hello)
        s1.sendall(struct.pack("<I", len(data)) + data)
        s1.shutdown(socket.SHUT_WR)
        s2.settimeout(2)
        try:
            shm._handshake(s2, "fuzz", 4, 256, None, os.getpid())
        except rdmamw.ProtocolError:
            return
        raise AssertionError(f"handshake accepted {hello!r} from a peer that sent no fds")
    finally:
        s1.close(), s2.close()
