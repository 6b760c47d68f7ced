"""Fuzz the tcp region protocol (rm_tcp_region.h) with hypothesis, on both sides of a
real connection, over a raw socket (tests/support/tcp_util.py):

* the owner's RCHAIN decoder: chains near the edges of three regions (one "rw", one
  "r", one "atomic", each between guard pages of one buffer), then the same bytes
  mutated. A chain the owner answers is checked against a model (accepted: every
  WRITE landed, every READ answered with the bytes of that moment, every FETCH_ADD /
  CMP_SWAP answered with the word's old value and the word changed as it says;
  refused: only its RDONE, nothing moved); whatever the bytes, nothing outside the
  "rw" and "atomic" regions changes (the whole buffer compared), and the owner still
  serves a fresh peer.
* the initiator's RDONE / READ_RESP decoder: our read chain answered by random
  frames. The read ends (done, a typed error, Timeout, PeerLost) and nothing but its
  destination is ever written (guards around it compared)."""

from __future__ import annotations

import contextlib
import socket
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rdmamw
from rdmamw.channel.remote import RegionRef
from rdmamw.errors import ProviderUnavailable, RdmamwError
from tests.support.regions import pattern
from tests.support.tcp_util import (
    FRAME,
    OP_CSWAP,
    OP_FADD,
    OP_READ,
    OP_WRITE,
    OPERANDS,
    RCHAIN,
    RDESC,
    RDONE,
    READ_ERR,
    READ_RESP,
    WORD,
    next_frame,
    raw_peer,
    rchain,
    recv_exact,
)

PAGE = 4096
RW_AT, RO_AT, AT_AT = PAGE, 3 * PAGE, 5 * PAGE   # the regions' offsets in the buffer
ATOMICS = (OP_FADD, OP_CSWAP)
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


class Owner:
    """Our listener; a buffer of seven pages: guard, "rw" region, guard, "r" region,
    guard, "atomic" region, guard; each example gets a fresh channel and raw peer."""

    def __init__(self, lst) -> None:
        self.lst = lst
        self.buf = pattern(7 * PAGE, 11)
        self.ch = self.s = None
        self.regions: list = []

    @contextlib.contextmanager
    def connection(self):
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(ch=self.lst.accept(timeout=10)))
        t.start()
        s = raw_peer(self.lst.address)
        t.join()
        s.settimeout(5)
        ch = got["ch"]
        rw = ch.expose(self.buf[RW_AT:RW_AT + PAGE], "rw")
        ro = ch.expose(self.buf[RO_AT:RO_AT + PAGE], "r")
        at = ch.expose(self.buf[AT_AT:AT_AT + PAGE], "atomic")
        try:
            yield ch, s, rw.ref, ro.ref, at.ref
        finally:
            s.close()
            ch.close()

    def serves(self) -> None:
        """A fresh peer's honest chain gets the right bytes."""
        with self.connection() as (_, s, rw, _ro, _at):
            s.sendall(rchain([(OP_READ, rw.key, rw.tag, rw.base, PAGE)]))
            kind, *_, body = next_frame(s)
            assert kind == READ_RESP and body == self.buf[RW_AT:RW_AT + PAGE].tobytes()


@pytest.fixture(scope="module")
def owner():
    mp = pytest.MonkeyPatch()
    mp.setenv("RDMAMW_TCP_PEER_TIMEOUT", "10")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        yield Owner(lst)
    mp.undo()


def _desc(draw, rw: RegionRef, ro: RegionRef, at: RegionRef) -> tuple:
    """One descriptor, legal three times in four, else near the edges: (op, key, tag,
    addr, length, reserved)."""
    reg = draw(st.sampled_from([rw, rw, ro, at, at]))
    if draw(st.integers(0, 3)):
        if reg is at and draw(st.integers(0, 2)):
            op = draw(st.sampled_from(ATOMICS))
            return op, at.key, at.tag, at.base + 8 * draw(st.integers(0, PAGE // 8 - 1)), 8, 0
        op = OP_WRITE if reg is not ro and draw(st.booleans()) else OP_READ
        off = draw(st.integers(0, PAGE - 1))
        return op, reg.key, reg.tag, reg.base + off, draw(st.integers(1, PAGE - off)), 0
    op = draw(st.sampled_from([OP_READ, OP_WRITE, OP_WRITE, OP_FADD, OP_CSWAP, 0, 5,
                               0xFFFF]))
    if op in ATOMICS and draw(st.booleans()):   # one thing wrong: where the word is
        reg = draw(st.sampled_from([at, at, at, rw]))
        off = draw(st.sampled_from([0, 4, PAGE - 4, PAGE, PAGE + 8, -8, -PAGE]))
        return op, reg.key, reg.tag, reg.base + off, 8, 0
    key = draw(st.sampled_from([reg.key, reg.key, reg.key, rw.key ^ ro.key, 0, 0xFFFF]))
    tag = draw(st.sampled_from([reg.tag, reg.tag, reg.tag, reg.tag + 1, 0,
                                rw.tag if reg is ro else ro.tag]))
    off = draw(st.sampled_from([0, 0, 1, 4, 8, PAGE - 8, PAGE - 4, PAGE - 1, PAGE, -8,
                                -PAGE]))
    length = draw(st.sampled_from([8, 8, 8, 16, 0] if op in ATOMICS else
                                  [1, 8, 8, 16, 100, PAGE, PAGE + 1, 0, 2 * PAGE]))
    reserved = draw(st.sampled_from([0, 0, 0, 0, 0, 1]))
    return op, key, tag, (reg.base + off) % 2**64, length, reserved


def _payload(op: int, n: int, i: int) -> bytes | None:
    """What the i-th operation carries: a WRITE its bytes, an atomic its operands."""
    if op == OP_WRITE:
        return pattern(n, i).tobytes()
    if op in ATOMICS:       # operands that make the word move either way
        a = int.from_bytes(pattern(8, i).tobytes(), "little")
        return OPERANDS.pack(a, a ^ 0xFF) if i % 3 else OPERANDS.pack(a, 0)
    return None


def _run_model(buf: np.ndarray, base: int, ops: list[tuple], payloads: list[bytes]
               ) -> tuple:
    """What an accepted chain does to ``buf`` (a copy of the owner's buffer, which is
    at ``base``): (the buffer after, each READ's and atomic's answer)."""
    after = buf.copy()
    answers = []
    w = 0
    for op, _, _, addr, n, _ in ops:
        at = addr - base
        if op == OP_READ:
            answers.append(after[at:at + n].tobytes())
            continue
        pay = payloads[w]
        w += 1
        if op == OP_WRITE:
            after[at:at + n] = np.frombuffer(pay, np.uint8)
            continue
        a, b = OPERANDS.unpack(pay)
        word = after[at:at + 8].view("<u8")
        old = int(word[0])
        answers.append(WORD.pack(old))
        if op == OP_FADD:
            word[0] = (old + a) % 2**64
        elif old == a:
            word[0] = b
    return after, answers


def _legal(ops: list[tuple]) -> bool:
    """Every descriptor one rdmamw could send (else the owner hangs up)."""
    return all(op in (OP_READ, OP_WRITE, *ATOMICS) and not r
               and (op not in ATOMICS or n == 8) for op, *_, n, r in ops)


def _answers(s: socket.socket) -> list[tuple] | None:
    """The frames answering one chain up to its RDONE; None if the owner hung up."""
    got = []
    try:
        while True:
            got.append(next_frame(s))
            if got[-1][0] == RDONE:
                return got
    except (EOFError, ConnectionError):
        return None


def _unchanged_outside_the_writable_regions(buf: np.ndarray, before: np.ndarray) -> None:
    for lo, hi in ((0, RW_AT), (RW_AT + PAGE, AT_AT), (AT_AT + PAGE, len(buf))):
        assert np.array_equal(buf[lo:hi], before[lo:hi])


@FUZZ
@given(st.data())
def test_chains_near_the_edges_do_what_the_model_says(owner, data):
    before = owner.buf.copy()
    with owner.connection() as (_, s, rw, ro, at):
        ops = data.draw(st.lists(st.composite(lambda draw: _desc(draw, rw, ro, at))(),
                                 min_size=1, max_size=4))
        payloads = [p for i, (op, *_, n, _r) in enumerate(ops)
                    if (p := _payload(op, n, i)) is not None]
        s.sendall(rchain(ops, payloads))
        got = _answers(s)
        event(("hung up" if got is None else "refused" if got[-1][1] else "accepted")
              + (" (atomics in it)" if any(op in ATOMICS for op, *_ in ops) else ""))
        if got is None:                                 # a frame rdmamw never makes
            assert not _legal(ops)
            assert np.array_equal(owner.buf, before)
        else:
            kind, why, _, index, _ = got[-1]
            if why:                                     # refused: nothing moved
                assert [f[0] for f in got] == [RDONE] and index < len(ops)
                assert np.array_equal(owner.buf, before)
            else:
                base = owner.buf.ctypes.data
                for op, key, tag, addr, n, _ in ops:    # only what was allowed
                    reg = {rw.key: rw, ro.key: ro, at.key: at}[key]
                    assert tag == reg.tag
                    assert reg.base <= addr and addr + n <= reg.base + PAGE
                    assert op == OP_READ or reg is not ro
                    assert op not in ATOMICS or (reg is at and addr % 8 == 0 and n == 8)
                    assert base <= addr
                after, answers = _run_model(before, base, ops, payloads)
                assert [f[4] for f in got[:-1]] == answers
                assert np.array_equal(owner.buf, after)
                assert all(f[0] == READ_RESP for f in got[:-1])
            # the connection still serves
            s.sendall(rchain([(OP_READ, rw.key, rw.tag, rw.base, 64)]))
            assert next_frame(s)[4] == owner.buf[RW_AT:RW_AT + 64].tobytes()
    _unchanged_outside_the_writable_regions(owner.buf, before)


@FUZZ
@given(st.data())
def test_mutated_chains_never_touch_outside_the_region(owner, data):
    before = owner.buf.copy()
    with owner.connection() as (ch, s, rw, ro, at):
        ops = [(OP_WRITE, rw.key, rw.tag, rw.base + 8, 64, 0),
               (OP_READ, ro.key, ro.tag, ro.base, 32, 0),
               (OP_FADD, at.key, at.tag, at.base + PAGE - 8, 8, 0),
               (OP_WRITE, rw.key, rw.tag, rw.base + PAGE - 16, 16, 0),
               (OP_CSWAP, at.key, at.tag, at.base, 8, 0)]
        raw = bytearray(rchain(ops, [bytes(64), OPERANDS.pack(3, 0), bytes(16),
                                     OPERANDS.pack(0, 1)]))
        for _ in range(data.draw(st.integers(1, 6))):
            how = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
            at = data.draw(st.integers(0, len(raw) - 1))
            if how == "flip":
                raw[at] ^= 1 << data.draw(st.integers(0, 7))
            elif how == "set":
                raw[at] = data.draw(st.integers(0, 255))
            elif how == "cut":
                del raw[at:at + data.draw(st.integers(1, 24))]
            else:
                raw[at:at] = data.draw(st.binary(min_size=1, max_size=24))
            if not raw:
                raw = bytearray(FRAME.pack(RCHAIN, 0, 0, 0))
        s.sendall(bytes(raw))
        s.shutdown(socket.SHUT_WR)              # then EOF: the owner stops waiting
        with contextlib.suppress(OSError):
            while s.recv(65536):
                pass
    _unchanged_outside_the_writable_regions(owner.buf, before)
    owner.serves()


# ---- the initiator's decoder --------------------------------------------------------

answer_frames = st.one_of(
    st.just(FRAME.pack(READ_RESP, 0, 64, 0) + bytes(range(64)) + FRAME.pack(RDONE, 0, 0, 0)),
    st.just(FRAME.pack(READ_RESP, 0, 8, 0) + bytes(range(8)) + FRAME.pack(RDONE, 0, 0, 0)),
    st.builds(lambda why, off: FRAME.pack(RDONE, why, 0, off),
              st.one_of(st.integers(0, 4), st.integers(0, 0xFFFF)),
              st.one_of(st.integers(0, 4), st.integers(0, 2**64 - 1))),
    st.builds(lambda n, body: FRAME.pack(READ_RESP, 0, n, 0) + body,
              st.sampled_from([0, 1, 63, 64, 65, 4096]), st.binary(max_size=80)),
    st.builds(lambda n, fill: FRAME.pack(READ_RESP, 0, n, 0) + bytes([fill]) * n,
              st.sampled_from([1, 63, 64, 65, 128, 4096]), st.integers(0, 255)),
    st.just(FRAME.pack(READ_ERR, 0, 0, 0)),
    st.builds(lambda t, r, n, o: FRAME.pack(t, r, n, o), st.integers(0, 14),
              st.integers(0, 3), st.integers(0, 64), st.integers(0, 64)),
    st.binary(min_size=1, max_size=40),
)


@pytest.mark.parametrize("op", ["read", "atomic"])
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(frames=st.lists(answer_frames, min_size=1, max_size=4))
def test_forged_answers_never_write_past_the_destination(owner, op, frames):
    """A read's destination, or an atomic's operands (the channel's 16 bytes, whose
    first 8 the answer replaces): nothing else is written, and the call ends."""
    rid = 0x1234567 * 2 + 1
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(ch=owner.lst.accept(timeout=10)))
    t.start()
    s = raw_peer(owner.lst.address, rid=rid, ratom=1)
    t.join()
    ch = got["ch"]
    s.settimeout(5)
    space = np.full(3 * 64, 0xEE, np.uint8)     # guard, destination, guard
    ref = RegionRef(rid, 7, 9, 1 << 40, 1 << 20, 7)
    outcome: list = []

    def reader() -> None:
        try:
            if op == "read":
                ch.read(ref, space[64:128], timeout=1.0)
            else:
                value = ch.fetch_add(ref, 64, 3, timeout=1.0).wait()
                assert value == int.from_bytes(bytes(range(8)), "little")
            outcome.append("done")
        except RdmamwError as e:
            outcome.append(type(e).__name__)

    r = threading.Thread(target=reader)
    r.start()
    try:
        kind, n, length, _ = FRAME.unpack(recv_exact(s, FRAME.size))
        while kind != RCHAIN:                   # past the engine's own frames
            recv_exact(s, length) if kind in (1, 2, 7) else None
            kind, n, length, _ = FRAME.unpack(recv_exact(s, FRAME.size))
        assert n == 1 and RDESC.unpack(recv_exact(s, length))[0] == (
            OP_READ if op == "read" else OP_FADD)
        if op == "atomic":
            assert OPERANDS.unpack(recv_exact(s, OPERANDS.size)) == (3, 0)
        with contextlib.suppress(OSError):
            s.sendall(b"".join(frames))
        r.join(5)
        assert not r.is_alive(), "the read did not end"
    finally:
        s.close()
        r.join(5)
        ch.close()
    event(f"{op}: {outcome[0] if outcome else None}")
    assert outcome and outcome[0] in ("done", "Timeout", "PeerLost", "RegionRevoked",
                                      "OutOfRange", "AccessDenied", "ChannelClosed")
    assert (space[:64] == 0xEE).all() and (space[128:] == 0xEE).all()
    if op == "atomic":      # the operands' buffer: its second word as the call left it
        words = ch._atomic_state[1]
        assert len(words) == 16 and words[8:] == bytes(8)
    owner.serves()


@pytest.mark.parametrize("how", ["single", "batch"])
def test_no_atomic_goes_to_a_peer_that_does_not_serve_them(owner, how):
    """A peer whose hello has no ``ratom`` (an earlier rdmamw, which would hang up on
    an atomic): ProviderUnavailable, nothing sent (not the batch's read either), the
    channel usable."""
    rid = 0x7654321 * 2 + 1
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(ch=owner.lst.accept(timeout=10)))
    t.start()
    s = raw_peer(owner.lst.address, rid=rid)
    t.join()
    ch = got["ch"]
    try:
        s.settimeout(0.5)
        ref = RegionRef(rid, 7, 9, 1 << 40, 1 << 20, 7)
        with pytest.raises(ProviderUnavailable, match="does not serve them"):
            if how == "single":
                ch.fetch_add(ref, 0, 1, timeout=1.0)
            else:
                ch.batch().read(ref, np.zeros(8, np.uint8), 8).fetch_add(ref, 0, 1) \
                    .post(timeout=1.0)
        ch.send(b"after")
        kind, _, length, _ = FRAME.unpack(recv_exact(s, FRAME.size))
        assert kind != RCHAIN                   # what came is the message, no chain
    finally:
        s.close()
        ch.close()
