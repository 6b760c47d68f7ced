"""Fuzz the tcp decoders (short runs; bench/fuzz_tcp.py does a million inputs):
the frame decoder of the progress thread, the token handshake, and the hellos of
the channel handshake and the bootstrap store. Malformed input must end in a
ProtocolError or a dropped connection: never a crash, a hang, or a write outside
the registered regions."""

from __future__ import annotations

import random

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rdmamw.providers._tcp import apply_stream

import rdmamw
from rdmamw import auth
from rdmamw.providers import _wire, tcp
from tests.tcp_util import FRAME, REGION, random_stream

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

frames = st.builds(
    lambda kind, region, off, length, body: FRAME.pack(kind, region, length, off) + body,
    st.one_of(st.integers(0, 9), st.integers(0, 2**16 - 1)),
    st.one_of(st.integers(0, 5), st.integers(0, 2**16 - 1)),
    st.one_of(st.integers(0, REGION + 16), st.integers(0, 2**64 - 1)),
    st.one_of(st.integers(0, REGION + 16), st.integers(0, 2**32 - 1)),
    st.binary(max_size=REGION + 32),
)


@FAST
@given(st.lists(st.one_of(frames, st.binary(max_size=64)), min_size=1, max_size=6))
def test_fuzz_frame_decoder(parts):
    applied, why, intact = apply_stream(b"".join(parts))
    assert intact, "a frame wrote outside the registered regions"
    assert why in ("peer closed the connection", "malformed frame", "socket error")


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32))
def test_fuzz_frame_decoder_near_the_edges(seed):
    applied, why, intact = apply_stream(random_stream(random.Random(seed)))
    assert intact


@FAST
@given(st.binary(max_size=2 * auth.PROOF_BYTES))
def test_fuzz_token_handshake(data):
    key = b"k"
    try:
        auth.check_hello(data)
    except auth.AuthError:
        pass
    try:
        auth.check_proof(data, key, b"\0" * auth.NONCE)
        raise AssertionError("random bytes proved the token")
    except auth.AuthError:
        pass


values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                               max_size=4),
    max_leaves=12)
hellos = st.fixed_dictionaries({}, optional={
    "v": st.one_of(st.just(1), values), "slots": st.one_of(st.integers(0, 2**21), values),
    "slot_size": st.one_of(st.integers(0, 2**31), values), "hb": values,
    "mode": st.one_of(st.sampled_from(["batched", "ack"]), values),
    "rank": st.one_of(st.integers(-2, 2**32), values)})


@FAST
@given(st.one_of(hellos.map(msgpack.packb), st.binary(max_size=64)), st.booleans())
def test_fuzz_channel_hello(data, accepting):
    try:
        out = tcp.parse_hello(_wire.decode(data), accepting)
    except rdmamw.ProtocolError:
        return
    assert 1 <= out["slots"] and 64 <= out["slot_size"] and 0 <= out["hb"] <= 60


joins = st.fixed_dictionaries({}, optional={
    "rank": st.one_of(st.none(), st.integers(-2, 8), values),
    "role": st.one_of(st.none(), st.sampled_from(["server", "worker"]), values),
    "desc": st.one_of(st.fixed_dictionaries({}, optional={"tcp": values, "host": values}),
                      values)})


@FAST
@given(st.one_of(joins.map(msgpack.packb), st.binary(max_size=64)))
def test_fuzz_store_join(data):
    """Whatever a rank sends the store: a checked join or ProtocolError."""
    from rdmamw.bootstrap.store import _Ranks, parse_join
    try:
        rank, role, desc = parse_join(_wire.decode(data))
        _Ranks(4, {"server": range(1, 2), "worker": range(2, 4)}).assign(rank, role)
    except rdmamw.ProtocolError:
        return
    assert isinstance(desc, dict)
