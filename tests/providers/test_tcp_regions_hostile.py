"""Remote memory on tcp against a hostile peer (docs/remote-memory.md): a hand-made
peer on a raw socket forges region chains (rm_tcp_region.h) outside what we exposed,
after a revoke, with another channel's exposure, with the wrong access, or malformed,
and stalls in the middle of one. Each time the answer is the refusal the shm path
types (RDONE {why, index}: 1 RegionRevoked, 2 OutOfRange, 3 AccessDenied), or the
connection is dropped for a frame rdmamw never makes; and no byte of ours moved."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

import rdmamw
from tests.support.tcp_util import (
    FRAME,
    OP_READ,
    OP_WRITE,
    RCHAIN,
    RDESC,
    RDONE,
    READ_ERR,
    READ_RESP,
    XREAD_REQ,
    XWRITE,
    frame,
    next_frame,
    raw_peer,
    rchain,
)

GONE, RANGE, ACCESS = 1, 2, 3
MiB = 1 << 20


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@contextlib.contextmanager
def owner_and_raw_peers(monkeypatch, count: int = 1):
    """([our channel to each raw peer], [the raw peers' sockets])."""
    monkeypatch.setenv("RDMAMW_TCP_PEER_TIMEOUT", "10")    # bounds a failing run
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        chans, socks = [], []
        try:
            for _ in range(count):
                got: dict = {}
                t = threading.Thread(target=lambda g=got: g.update(ch=lst.accept(timeout=10)))
                t.start()
                s = raw_peer(lst.address)
                t.join()
                s.settimeout(10)
                chans.append(got["ch"])
                socks.append(s)
            yield chans, socks
        finally:
            for s in socks:
                s.close()
            for ch in chans:
                ch.close()


@pytest.fixture
def owner(monkeypatch):
    with owner_and_raw_peers(monkeypatch) as (chans, socks):
        yield chans[0], socks[0]


def _ask(s, ops, payloads=()) -> list[tuple]:
    """Send one chain; the frames that answer it, up to its RDONE."""
    s.sendall(rchain(ops, payloads))
    got = []
    while True:
        got.append(next_frame(s))
        if got[-1][0] == RDONE:
            return got


def _refusal(answer: list[tuple]) -> tuple[int, int]:
    """(why, index) of a chain's RDONE, which must be the only answer of a refused
    chain: no READ_RESP, so no byte of ours went out."""
    assert [f[0] for f in answer] == [RDONE], answer
    return answer[0][1], answer[0][3]


def test_an_honest_chain_works_over_the_raw_socket(owner):
    """The harness can succeed: a WRITE then a READ of what it wrote, in order."""
    ch, s = owner
    buf = _pattern(4096, 1)
    expect = buf.copy()
    reg = ch.expose(buf, "rw")
    k, t, base = reg.ref.key, reg.ref.tag, reg.ref.base
    data = bytes(range(100))
    answer = _ask(s, [(OP_WRITE, k, t, base + 10, 100), (OP_READ, k, t, base, 200)], [data])
    expect[10:110] = np.frombuffer(data, np.uint8)
    assert [f[0] for f in answer] == [READ_RESP, RDONE]
    assert answer[0][4] == expect[:200].tobytes()       # the READ saw the WRITE before it
    assert answer[1][1:4:2] == (0, 0)
    assert np.array_equal(buf, expect)


@pytest.mark.parametrize("where", ["past the end", "before the start", "wrapping",
                                   "larger than the region"])
@pytest.mark.parametrize("op", [OP_READ, OP_WRITE])
def test_outside_the_region_is_out_of_range(owner, where, op):
    ch, s = owner
    guard = _pattern(3 * 4096, 2)                   # the region is the middle page
    keep = guard.copy()
    reg = ch.expose(guard[4096:8192], "rw")
    k, t, base = reg.ref.key, reg.ref.tag, reg.ref.base
    addr, n = {"past the end": (base + 4090, 16), "before the start": (base - 8, 16),
               "wrapping": (2**64 - 8, 16), "larger than the region": (base, 4097)}[where]
    payload = [bytes(n)] if op == OP_WRITE else []
    assert _refusal(_ask(s, [(op, k, t, addr, n)], payload)) == (RANGE, 0)
    assert np.array_equal(guard, keep)              # nothing of ours changed
    assert _ask(s, [(OP_READ, k, t, base, 8)])[0][4] == keep[4096:4104].tobytes()


def test_a_chain_is_checked_whole_before_any_byte_moves(owner):
    """Its first WRITE is legal, its second is not: neither lands."""
    ch, s = owner
    buf = _pattern(4096, 3)
    keep = buf.copy()
    reg = ch.expose(buf, "rw")
    k, t, base = reg.ref.key, reg.ref.tag, reg.ref.base
    ops = [(OP_WRITE, k, t, base, 64), (OP_READ, k, t, base, 64), (OP_WRITE, k, t, base + 4064, 64)]
    assert _refusal(_ask(s, ops, [bytes(64), bytes(64)])) == (RANGE, 2)
    assert np.array_equal(buf, keep)


def test_a_revoked_region_refuses_every_later_access(owner):
    ch, s = owner
    buf = _pattern(4096, 4)
    reg = ch.expose(buf, "rw")
    k, t, base = reg.ref.key, reg.ref.tag, reg.ref.base
    reg.revoke()
    keep = buf.copy()
    assert _refusal(_ask(s, [(OP_WRITE, k, t, base, 16)], [bytes(16)])) == (GONE, 0)
    assert _refusal(_ask(s, [(OP_READ, k, t, base, 16)])) == (GONE, 0)
    again = ch.expose(buf, "rw")        # the same slot, the same key generation or not
    assert _refusal(_ask(s, [(OP_WRITE, k, t, base, 16)], [bytes(16)])) == (GONE, 0)
    assert np.array_equal(buf, keep)
    again.revoke()


def test_another_channels_exposure_is_refused(monkeypatch):
    """Peer 1 names what we exposed to peer 2 (its key, tag and address): not exposed on
    this channel, whatever the key's slot holds here."""
    with owner_and_raw_peers(monkeypatch, 2) as ((ch1, ch2), (s1, _s2)):
        mine = _pattern(4096, 5)
        theirs = _pattern(4096, 6)
        keep = theirs.copy()
        ch1.expose(mine, "rw")                      # the same slot as below, likely
        other = ch2.expose(theirs, "rw")
        k, t, base = other.ref.key, other.ref.tag, other.ref.base
        assert _refusal(_ask(s1, [(OP_WRITE, k, t, base, 16)], [bytes(16)])) == (GONE, 0)
        assert _refusal(_ask(s1, [(OP_READ, k, t, base, 4096)])) == (GONE, 0)
        assert np.array_equal(theirs, keep)


@pytest.mark.parametrize("access, op", [("r", OP_WRITE), ("w", OP_READ)])
def test_the_wrong_access_is_denied(owner, access, op):
    ch, s = owner
    buf = _pattern(4096, 7)
    keep = buf.copy()
    reg = ch.expose(buf, access)
    k, t, base = reg.ref.key, reg.ref.tag, reg.ref.base
    payload = [bytes(16)] if op == OP_WRITE else []
    assert _refusal(_ask(s, [(op, k, t, base, 16)], payload)) == (ACCESS, 0)
    assert np.array_equal(buf, keep)


def test_a_rendezvous_read_cannot_name_a_region(owner):
    """XREAD_REQ (untagged) never matches a region's (tagged) exposure."""
    ch, s = owner
    buf = _pattern(4096, 8)
    reg = ch.expose(buf, "rw")
    s.sendall(frame(XREAD_REQ, region=reg.ref.key, offset=reg.ref.base, length=64))
    assert next_frame(s)[0] == READ_ERR


def _hung_up(s) -> bool:
    try:
        while s.recv(65536):
            pass
    except (ConnectionError, TimeoutError):
        return False
    return True


def _bad_chains(k: int, t: int, base: int) -> dict[str, bytes]:
    desc = RDESC.pack(OP_WRITE, k, t, base, 16, 0)
    return {
        "a rendezvous write at a region": frame(XWRITE, region=k, offset=base,
                                                payload=bytes(16)),
        "an unknown operation": rchain([(3, k, t, base, 16)]),
        "a reserved field set": rchain([(OP_WRITE, k, t, base, 16, 1)], [bytes(16)]),
        "more than 1 GiB": rchain([(OP_WRITE, k, t, base, (1 << 30) + 1)]),
        "no operation": FRAME.pack(RCHAIN, 0, 0, 0),
        "a length that is not its descriptors'": FRAME.pack(RCHAIN, 1, len(desc) + 8, 0) + desc,
        "an RDONE nobody asked for": frame(RDONE),
    }


@pytest.mark.parametrize("kind", list(_bad_chains(1, 1, 0)))
def test_a_malformed_chain_hangs_up_and_moves_nothing(monkeypatch, kind):
    with owner_and_raw_peers(monkeypatch, 2) as ((ch, other), (s, s2)):
        buf = _pattern(4096, 9)
        keep = buf.copy()
        reg = ch.expose(buf, "rw")
        s.sendall(_bad_chains(reg.ref.key, reg.ref.tag, reg.ref.base)[kind])
        assert _hung_up(s)
        assert np.array_equal(buf, keep)
        reg2 = other.expose(buf, "r")               # the owner's other channel serves on
        answer = _ask(s2, [(OP_READ, reg2.ref.key, reg2.ref.tag, reg2.ref.base, 32)])
        assert answer[0][4] == keep[:32].tobytes()


def test_a_writer_that_stalls_mid_payload_cannot_hold_revoke(owner):
    """It announces 4 MiB, sends 256 KiB and stops: revoke returns at once, and the
    rest it sends after lands nowhere."""
    ch, s = owner
    n = 4 * MiB
    buf = np.zeros(n, np.uint8)
    reg = ch.expose(buf, "rw")
    s.sendall(rchain([(OP_WRITE, reg.ref.key, reg.ref.tag, reg.ref.base, n)],
                     [b"\x11" * (256 << 10)]))
    deadline = time.monotonic() + 5
    while buf[(256 << 10) - 1] != 0x11:             # the first part landed: it is stuck
        assert time.monotonic() < deadline
        time.sleep(0.001)
    t0 = time.monotonic()
    reg.revoke()
    took = time.monotonic() - t0
    buf[:] = 0xAA                                   # ours again
    s.sendall(b"\x22" * (n - (256 << 10)))
    assert _refusal([next_frame(s)]) == (GONE, 0)
    assert took < 0.5, f"revoke took {took:.2f} s"
    assert (buf == 0xAA).all()


def test_a_reader_that_reads_nothing_cannot_hold_revoke(owner):
    """It asks for 32 MiB and reads nothing: revoke returns at once; what it reads
    afterwards is the region as it was before the revoke, not a byte of what we wrote
    after it."""
    ch, s = owner
    n = 32 * MiB
    buf = _pattern(n, 10)
    keep = buf.copy()
    reg = ch.expose(buf, "r")
    s.sendall(rchain([(OP_READ, reg.ref.key, reg.ref.tag, reg.ref.base, n)]))
    time.sleep(0.5)                                 # the responder filled the socket
    t0 = time.monotonic()
    reg.revoke()
    took = time.monotonic() - t0
    buf[:] = 0xAA
    kind, _region, length, _offset, body = next_frame(s)
    assert (kind, length) == (READ_RESP, n)
    assert body == keep.tobytes()
    assert next_frame(s)[0] == RDONE
    assert took < 1.0, f"revoke took {took:.2f} s"

