"""Fuzz the tcp decoders (short runs; bench/fuzz_tcp.py does a million inputs):
the frame decoder of the progress thread, the token handshake, and the hellos of
the channel handshake and the bootstrap store. Malformed input must end in a
ProtocolError or a dropped connection: never a crash, a hang, or a write outside
the registered regions."""

from __future__ import annotations

import random
import socket
import threading

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdmamw
from rdmamw import auth
from rdmamw.providers.tcp import provider as tcp
from rdmamw.transport import wire as _wire
from tests.support.hooks import apply_stream
from tests.support.tcp_util import FRAME, REGION, random_stream

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


#: ways to get a handshake message wrong, each one change from the right one
FORGERIES = st.one_of(
    st.tuples(st.just("right"), st.just(0)),
    st.tuples(st.just("flip"), st.integers(0, 8 * auth.PROOF_BYTES - 1)),   # any one bit
    st.tuples(st.just("cut"), st.integers(1, auth.PROOF_BYTES)),            # bytes short
    st.tuples(st.sampled_from(["other key", "key prefix", "empty key", "other label",
                               "swapped nonces", "other challenge", "zero mac",
                               "bad version", "no mac"]), st.just(0)))


def _forge(how: tuple, key: bytes, label: bytes, mine: bytes, theirs: bytes,
           head: bytes) -> bytes:
    """``head`` + the MAC over (``theirs``, ``mine``) under ``label``, changed as ``how``
    says (the wire order of auth._mac: the challenger's nonce first)."""
    kind, arg = how
    k = {"other key": key + b"x", "key prefix": key[:-1], "empty key": b""}.get(kind, key)
    lab = b"accept" if kind == "other label" and label == b"open" else \
        b"open" if kind == "other label" else label
    a, b = (mine, theirs) if kind == "swapped nonces" else (theirs, mine)
    if kind == "other challenge":
        a = bytes(x ^ 1 for x in a)
    msg = head + (b"\0" * auth.MAC if kind == "zero mac" else auth._mac(k, lab, a, b))
    if kind == "bad version":
        msg = msg[:4] + bytes([auth.VERSION + 1]) + msg[5:]
    elif kind == "no mac":
        msg = head
    elif kind == "flip":
        msg = bytearray(msg)
        msg[arg // 8 % len(msg)] ^= 1 << arg % 8
        msg = bytes(msg)
    elif kind == "cut":
        msg = msg[:max(0, len(msg) - arg)]
    return msg


def _half(fn, sock, key: bytes) -> dict:
    """Run one half of the handshake in a thread; it hangs up when done or refused."""
    out: dict = {}

    def run() -> None:
        try:
            fn(sock, key)
            out["ok"] = True
        except auth.AuthError as e:
            out["err"] = e
        finally:
            sock.shutdown(socket.SHUT_RDWR)

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _rest(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


HANDSHAKE = settings(max_examples=200, deadline=None)
KEY = b"the shared token"


@HANDSHAKE
@given(FORGERIES)
def test_fuzz_listener_accepts_only_the_right_proof(how):
    """The opener's proof, right or changed in one way: the listener accepts exactly
    the right one (and then proves itself), refuses every other with AuthError and
    sends nothing after its challenge, so the opener learns nothing."""
    lst, opener = socket.socketpair()
    with lst, opener:
        opener.settimeout(5)
        lst.settimeout(5)
        side = _half(auth.accept_side, lst, KEY)
        hello = auth._recv_exact(opener, auth.HELLO_BYTES)
        nonce_l, nonce_o = hello[5:], bytes(range(auth.NONCE))
        head = auth.MAGIC + bytes([auth.VERSION]) + nonce_o
        opener.sendall(_forge(how, KEY, b"open", nonce_o, nonce_l, head))
        opener.shutdown(socket.SHUT_WR)
        answer = _rest(opener)
        side["thread"].join(5)
    if how[0] == "right":
        assert side.get("ok") and answer == auth._mac(KEY, b"accept", nonce_o, nonce_l)
    else:
        assert isinstance(side.get("err"), auth.AuthError), (how, side)
        assert answer == b"", how


@HANDSHAKE
@given(FORGERIES)
def test_fuzz_opener_accepts_only_the_right_listener(how):
    """The listener's challenge and proof, right or changed in one way: the opener
    finishes only with the right ones and raises AuthError on any other."""
    lst, opener = socket.socketpair()
    with lst, opener:
        lst.settimeout(5)
        opener.settimeout(5)
        side = _half(auth.open_side, opener, KEY)
        nonce_l = bytes(range(100, 100 + auth.NONCE))
        lst.sendall(auth.MAGIC + bytes([auth.VERSION]) + nonce_l)
        proof = auth._recv_exact(lst, auth.PROOF_BYTES)
        nonce_o = auth.check_proof(proof, KEY, nonce_l)        # the opener is honest
        answer = _forge(how, KEY, b"accept", nonce_l, nonce_o, b"")
        lst.sendall(answer)
        lst.shutdown(socket.SHUT_WR)
        _rest(lst)
        side["thread"].join(5)
    if answer == auth._mac(KEY, b"accept", nonce_o, nonce_l):
        assert side.get("ok"), (how, side)
    else:
        assert isinstance(side.get("err"), auth.AuthError), (how, side)


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
    "rank": st.one_of(st.integers(-2, 2**32), values),
    "rid": st.one_of(st.integers(0, 2**64 - 1), values),
    "ratom": st.one_of(st.integers(-1, 2), values)})


@FAST
@given(st.one_of(hellos.map(msgpack.packb), st.binary(max_size=64)), st.booleans())
def test_fuzz_channel_hello(data, accepting):
    try:
        out = tcp.parse_hello(_wire.decode(data), accepting)
    except rdmamw.ProtocolError:
        return
    assert 1 <= out["slots"] and 64 <= out["slot_size"] and 0 <= out["hb"] <= 60
    assert type(out["ratom"]) is int and out["ratom"] in (0, 1)


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
