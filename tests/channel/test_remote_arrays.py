"""gather / scatter (docs/remote-memory.md, "Many pieces as arrays"): many pieces of one
region given as integer arrays, checked in C, a work request a piece. Whole results
equal those of the per-operation calls (readv / writev) on every provider with regions
(verbs in the soft-RoCE VM), in private memory and in rdmamw.memory.shared() memory
(which shm copies through its mapping of the owner's pages); a refused piece, by the
caller's checks or the owner's, moves nothing on either side; a revoke ends the
mapped copies before it returns; hypothesis drives the checks against a model."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdmamw.aio as aio
import rdmamw.memory
from rdmamw.errors import (
    AccessDenied,
    ForeignReference,
    OutOfRange,
    PeerLost,
    RegionRevoked,
)
from tests.support.helpers import make_pair
from tests.support.regions import pattern

SIZE = 64 * 1024
#: where the owner's device refuses (the chain before the refused piece may have run)
BY_DEVICE = {"verbs"}


def _buffer(memory: str, n: int, seed: int) -> np.ndarray:
    """``n`` pattern bytes in private memory or in memory the peer can map."""
    buf = rdmamw.memory.shared(n) if memory == "shared" else np.zeros(n, np.uint8)
    buf[:] = pattern(n, seed)
    return buf


def _mapped(ch) -> int:
    """Region accesses ``ch`` copied through a mapping (shm; 0 elsewhere)."""
    return ch.stats().get("mapped_ops", 0)


@pytest.mark.parametrize("memory", ["shared", "private"])
def test_gather_equals_readv_and_scatter_equals_writev(rpair, memory):
    owner, peer = rpair
    rng = np.random.default_rng(3)
    bufs = [_buffer(memory, SIZE, 10 + i) for i in range(2)]
    regs = [owner.expose(b, "rw") for b in bufs]
    # equal pieces, overlapping and out of order, and pieces of given lengths
    offs = rng.integers(0, SIZE - 8, 2100)      # tcp: 3 chains of at most 1023
    lens = rng.integers(1, 600, 120)
    loffs = np.array([rng.integers(0, SIZE - n) for n in lens])
    ends = np.cumsum(lens)
    starts = ends - lens

    got8, want8 = np.zeros(8 * len(offs), np.uint8), np.zeros(8 * len(offs), np.uint8)
    gotv, wantv = np.zeros(ends[-1], np.uint8), np.zeros(ends[-1], np.uint8)
    before, mapped = peer.stats(), _mapped(peer)
    peer.gather(got8, regs[0].ref, offs, 8)
    peer.batch().gather(gotv, regs[0].ref, loffs, lens).post()
    after, mapped = peer.stats(), _mapped(peer) - mapped
    peer.readv([(want8[8 * i:8 * i + 8], regs[0].ref, int(o)) for i, o in enumerate(offs)])
    peer.readv([(wantv[s:e], regs[0].ref, int(o))
                for s, e, o in zip(starts, ends, loffs, strict=True)])
    assert np.array_equal(got8, want8) and np.array_equal(gotv, wantv)
    assert after["rmem_ops"] - before["rmem_ops"] == len(offs) + len(lens)
    cmax = getattr(peer._transport, "region_chain_max", 0) or len(offs)    # tcp, verbs
    assert after["rmem_chains"] - before["rmem_chains"] == \
        -(-len(offs) // cmax) + -(-len(lens) // cmax)
    assert after["rmem_bytes_read"] - before["rmem_bytes_read"] == 8 * len(offs) + ends[-1]
    if owner.provider == "shm":     # shared memory: copied through the peer's mapping
        assert mapped == (len(offs) + len(lens) if memory == "shared" else 0)

    # the same pieces written to region 0 by scatter, to region 1 by writev: the two
    # regions (which started equal) end equal, whole, overlaps resolved in order
    bufs[1][:] = bufs[0]
    src8, srcv = pattern(8 * len(offs), 5), pattern(int(ends[-1]), 6)
    peer.batch().scatter(src8, regs[0].ref, offs).scatter(srcv, regs[0].ref, loffs,
                                                          lens).post()
    peer.writev([(src8[8 * i:8 * i + 8], regs[1].ref, int(o)) for i, o in enumerate(offs)]
                + [(srcv[s:e], regs[1].ref, int(o))
                   for s, e, o in zip(starts, ends, loffs, strict=True)])
    assert np.array_equal(bufs[0], bufs[1])
    assert not np.array_equal(bufs[0], pattern(SIZE, 10))


def test_a_region_inside_shared_memory_is_copied_at_its_own_bytes(rpair):
    """A region that starts and ends inside pages of its shared memory (the mapping's
    first byte is not the region's): the pieces land at their offsets of the region,
    the bytes around it untouched."""
    owner, peer = rpair
    mem = _buffer("shared", 3 * 4096, 50)
    keep = mem.copy()
    reg = owner.expose(mem[1000:9000], "rw")
    offs = np.array([0, 7992, 4000, 3096])
    out = np.zeros(32, np.uint8)
    peer.gather(out, reg.ref, offs)
    assert np.array_equal(out, np.concatenate([keep[1000 + o:1008 + o] for o in offs]))
    src = pattern(32, 51)
    peer.scatter(src, reg.ref, offs)
    for i, o in enumerate(offs):
        keep[1000 + o:1008 + o] = src[8 * i:8 * i + 8]
    assert np.array_equal(mem, keep)


def test_a_gather_sees_the_writes_before_it_in_the_batch(rpair):
    owner, peer = rpair
    buf = _buffer("shared", SIZE, 1)
    reg = owner.expose(buf, "rw")
    out = np.zeros(16, np.uint8)
    ops = peer.batch().scatter(np.full(8, 9, np.uint8), reg.ref, [100])
    ops.gather(out, reg.ref, [96, 104], 8).scatter(np.full(8, 4, np.uint8), reg.ref, [100])
    assert len(ops) == 4
    assert ops.post().count == 4
    assert list(out[:4]) == list(pattern(SIZE, 1)[96:100]) and list(out[4:12]) == [9] * 8
    assert list(buf[100:108]) == [4] * 8


@pytest.mark.parametrize("write", [False, True])
@pytest.mark.parametrize("memory", ["shared", "private"])
def test_a_piece_the_checks_refuse_adds_nothing_and_moves_nothing(rpair, write, memory):
    owner, peer = rpair
    buf = _buffer(memory, SIZE, 2)
    keep = buf.copy()
    reg = owner.expose(buf, "rw")
    local = pattern(24, 3) if write else np.zeros(24, np.uint8)
    local_keep = local.copy()
    ops = peer.batch().read(reg.ref, np.zeros(4, np.uint8))
    add = ops.scatter if write else ops.gather
    call = peer.scatter if write else peer.gather
    with pytest.raises(OutOfRange):             # the middle piece is one byte over
        add(local, reg.ref, [0, SIZE - 7, 8])
    with pytest.raises(OutOfRange):
        call(local, reg.ref, np.array([0, -8, 8]))
    with pytest.raises(OutOfRange):             # a uint64 offset of 2^63 and above
        call(local, reg.ref, np.array([0, 2**63 + 5, 8], np.uint64))
    with pytest.raises(ValueError):             # pieces of 8, 0 and 16 bytes
        call(local, reg.ref, [0, 8, 16], [8, 0, 16])
    with pytest.raises(ValueError):             # the pieces hold 23 of the 24 bytes
        call(local, reg.ref, [0, 8, 16], [8, 8, 7])
    with pytest.raises(ValueError):             # 24 bytes do not cut into 5 pieces
        call(local, reg.ref, [0, 8, 16, 24, 32])
    with pytest.raises(TypeError):
        call(local, reg.ref, [0.0, 8.0, 16.0])
    assert len(ops) == 1
    offs = np.array([0, 8, 16], np.int64)       # checked when added: changing the
    add(local, reg.ref, offs, 8)                # caller's array after it changes
    offs[1] = SIZE                              # nothing of the batch
    ops.post()
    if write:
        keep[:24] = local                       # landed at 0, 8, 16 as checked
    assert np.array_equal(buf, keep)
    assert np.array_equal(local, local_keep if write else keep[:24])


@pytest.mark.parametrize("write", [False, True])
def test_the_wrong_access_and_another_channels_reference_are_refused(rpair, write):
    owner, peer = rpair
    buf = _buffer("shared", SIZE, 4)
    keep = buf.copy()
    reg = owner.expose(buf, "w" if not write else "r")
    local = pattern(16, 5) if write else np.zeros(16, np.uint8)
    call = peer.scatter if write else peer.gather
    with pytest.raises(AccessDenied):
        call(local, reg.ref, [0, 8])
    with pytest.raises(ForeignReference):       # the owner's own side is not its peer
        (owner.scatter if write else owner.gather)(local, reg.ref, [0, 8])
    assert np.array_equal(buf, keep)


@pytest.mark.parametrize("write", [False, True])
@pytest.mark.parametrize("how", ["revoked", "longer"])
def test_a_piece_the_owner_refuses_moves_nothing_of_the_batch(rpair, write, how):
    """The caller's checks pass; the owner's exposure refuses the middle array of the
    batch: the region was revoked, or its reference claims more than was exposed and
    its last piece lies past the exposure. Nothing of the batch moved, either side
    (verbs: the owner's device refuses at that piece, the ones before it may have
    moved, and the connection is lost)."""
    owner, peer = rpair
    bufs = [_buffer("shared", SIZE, 20 + i) for i in range(3)]
    regs = [owner.expose(b, "rw") for b in bufs]
    ref = regs[1].ref
    if how == "revoked":
        regs[1].revoke()
    else:
        ref = type(ref)(ref.channel, ref.key, ref.tag, ref.base, ref.length + 4096,
                        ref.access)
    keep = [b.copy() for b in bufs]
    locals_ = [pattern(64, 30 + i) if write else np.zeros(64, np.uint8) for i in range(3)]
    local_keep = [x.copy() for x in locals_]
    last = SIZE if how == "longer" else 32      # past the exposure / inside the revoked
    offs = [[0, 100, 200, 300], [8, 16, 24, last], [40, 50, 60, 70]]
    ops = peer.batch()
    for x, r, o in zip(locals_, [regs[0].ref, ref, regs[2].ref], offs, strict=True):
        (ops.scatter if write else ops.gather)(x, r, o, 16)
    by_device = owner.provider in BY_DEVICE     # the device does not say which rule
    with pytest.raises(RegionRevoked if how == "revoked" or by_device else OutOfRange):
        ops.post()
    if by_device:
        for b, k in zip(bufs[2:], keep[2:], strict=True):
            assert np.array_equal(b, k)
        with pytest.raises(PeerLost):
            peer.gather(np.zeros(8, np.uint8), regs[0].ref, [0])
        return
    for b, k in zip(bufs, keep, strict=True):
        assert np.array_equal(b, k)
    for x, k in zip(locals_, local_keep, strict=True):
        assert np.array_equal(x, k)
    out = np.zeros(16, np.uint8)                # the channel still serves
    peer.gather(out, regs[2].ref, [0, 8])
    assert np.array_equal(out, bufs[2][:16])


def _shm_pair():
    a, b, lst = make_pair("batched", provider="shm")
    return a, b, lst


def _until_revoked(call, outcome, stop) -> None:
    try:
        while not stop.is_set():
            call()
    except RegionRevoked:
        outcome.append("revoked")
    except BaseException as e:  # noqa: BLE001 - reported by the test
        outcome.append(e)


@pytest.mark.parametrize("rnd", range(5))      # a race: each round may catch it
def test_no_byte_moves_through_the_mapping_after_revoke_returns(rnd):
    """Two threads of the peer write the owner's shared memory through their mapping,
    one 16 MiB write and one scatter of many small pieces, again and again; the revoke
    returns only once both ended, so the owner's bytes after it stay its own."""
    owner, peer, lst = _shm_pair()
    try:
        n = 16 * 2**20
        buf = rdmamw.memory.shared(n)
        reg = owner.expose(buf, "rw")
        stop, outcome = threading.Event(), []
        big = np.full(n, 0x55, np.uint8)
        small = np.full(8 * 4096, 0x55, np.uint8)
        offs = np.arange(4096) * 4096
        mapped = _mapped(peer)
        threads = [threading.Thread(target=_until_revoked, args=(c, outcome, stop)) for c in
                   (lambda: peer.write(big, reg.ref),
                    lambda: peer.scatter(small, reg.ref, offs, 8))]
        for t in threads:
            t.start()
        while not buf[n - 1]:                   # the big write has landed: they run
            time.sleep(0.001)
        time.sleep(0.01 * rnd)
        reg.revoke()
        buf[:] = 0xAA                           # ours again
        time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(10)
        assert outcome == ["revoked", "revoked"]
        assert (buf == 0xAA).all()
        assert _mapped(peer) > mapped           # they went through the mapping
    finally:
        owner.close()
        peer.close()
        lst.close()


def test_a_revoke_during_a_mapped_read_is_reported():
    """A 32 MiB read through the mapping, again and again: each that returned is
    whole; the one the revoke overlapped (or the next) is RegionRevoked."""
    owner, peer, lst = _shm_pair()
    try:
        n = 32 * 2**20
        buf = _buffer("shared", n, 12)
        keep = buf.copy()
        reg = owner.expose(buf, "r")
        out = np.zeros(n, np.uint8)
        outcome: list = []

        def read() -> None:
            peer.read(reg.ref, out)
            assert np.array_equal(out, keep)    # a read that returned is whole

        t = threading.Thread(target=_until_revoked, args=(read, outcome, threading.Event()))
        t.start()
        time.sleep(0.1)
        reg.revoke()
        t.join(10)
        assert outcome == ["revoked"]
        assert _mapped(peer) > 0
    finally:
        owner.close()
        peer.close()
        lst.close()


def test_large_copies_through_the_mapping_beside_an_idle_owner_land_whole():
    """8 MiB reads and writes of shared memory while the owner idles in the engine (where
    it would help with an assisted copy): each lands whole, through the mapping, by
    the caller alone (measured faster than with the owner's help: remote-memory.md)."""
    owner, peer, lst = _shm_pair()
    try:
        n = 8 * 2**20
        buf = _buffer("shared", n, 60)
        reg = owner.expose(buf, "rw")
        out = np.zeros(n, np.uint8)
        mapped = _mapped(peer)
        idle = threading.Thread(target=lambda: owner.recv(timeout=60))
        idle.start()
        for k in range(12):
            src = pattern(n, 61 + k)
            peer.write(src, reg.ref)
            assert np.array_equal(buf, src)
            peer.read(reg.ref, out)
            assert np.array_equal(out, src)
        peer.send(b"end")
        idle.join(10)
        assert _mapped(peer) - mapped == 24
        assert peer.stats()["assist_jobs"] == 0 and owner.stats()["assist_bytes_given"] == 0
    finally:
        owner.close()
        peer.close()
        lst.close()


def test_awaited_gather_and_scatter():
    a, b, lst = _shm_pair()
    owner, peer = aio.Channel(a), aio.Channel(b)
    try:
        buf = _buffer("shared", SIZE, 8)
        reg = owner.expose(buf, "rw")

        async def main() -> None:
            out = np.zeros(32, np.uint8)
            h = await peer.gather(out, reg.ref, [0, 1000, 2000, 3000])
            assert h.count == 4
            await peer.scatter(out, reg.ref, np.array([100, 200]))
            got = np.zeros(32, np.uint8)
            await peer.batch().gather(got, reg.ref, [100, 200], [16, 16]).post()
            assert np.array_equal(got, out)
            with pytest.raises(OutOfRange):
                await peer.scatter(out, reg.ref, [0, SIZE])

        import asyncio
        asyncio.run(main())
    finally:
        a.close()
        b.close()
        lst.close()


# ---- the checks, against a model ------------------------------------------------------

REGION = 4096


@pytest.fixture(scope="module", params=["shm", "tcp"])
def model_pair(request):
    a, b, lst = make_pair("batched", provider=request.param)
    buf = _buffer("shared", REGION, 40)
    yield a, b, buf, a.expose(buf, "rw")
    a.close()
    b.close()
    lst.close()


def _model(n_local: int, offsets: list[int], size):
    """What gather/scatter must do: ("ok", [(local start, offset, length)]), or the
    error type the checks raise first."""
    n = len(offsets)
    if size is None:
        lens = [n_local // max(1, n)] * n
    elif isinstance(size, int):
        lens = [size] * n
    else:
        lens = size
    if len(lens) != n:
        return ValueError
    out, at = [], 0
    for o, length in zip(offsets, lens, strict=True):
        if length < 1:
            return ValueError
        if o < 0 or o + length > REGION:
            return OutOfRange
        out.append((at, o, length))
        at += length
    return ("ok", out) if at == n_local else ValueError


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), write=st.booleans())
def test_the_checks_match_a_model(model_pair, data, write):
    owner, peer, buf, reg = model_pair
    n = data.draw(st.integers(0, 12), label="pieces")
    size = data.draw(st.one_of(
        st.none(), st.integers(-1, 70),
        st.lists(st.integers(-1, 70), min_size=max(0, n - 1), max_size=n + 1)),
        label="size")
    n_local = data.draw(st.integers(0, 200), label="local bytes")
    if size is not None and not isinstance(size, int) and n_local == 0:
        n_local = sum(max(0, x) for x in size)
    each = [size if isinstance(size, int) else n_local // max(1, n) if size is None
            else size[i] if i < len(size) else 8 for i in range(n)]
    # anywhere, far outside, or at the region's end give or take two bytes
    offsets = [data.draw(st.one_of(st.integers(-3, REGION + 3),
                                   st.integers(-2**63, 2**63 - 1),
                                   st.integers(-2, 2).map(lambda d, L=L: REGION - L + d)),
                         label=f"offset {i}") for i, L in enumerate(each)]
    want = _model(n_local, offsets, size)
    before = buf.copy()
    local = pattern(n_local, 41) if write else np.full(n_local, 0xEE, np.uint8)
    local_before = local.copy()
    ops = peer.batch()
    add = ops.scatter if write else ops.gather
    if not isinstance(want, tuple):             # refused as it is added: nothing added
        with pytest.raises(want):
            add(local, reg.ref, np.array(offsets, np.int64), size)
        assert len(ops) == 0
        ops.post()
        assert np.array_equal(buf, before) and np.array_equal(local, local_before)
        return
    add(local, reg.ref, np.array(offsets, np.int64), size)
    assert len(ops) == len(want[1])
    assert ops.post().count == len(want[1])
    expect_buf, expect_local = before.copy(), local_before.copy()
    for at, o, length in want[1]:
        if write:
            expect_buf[o:o + length] = local_before[at:at + length]
        else:
            expect_local[at:at + length] = before[o:o + length]
    assert np.array_equal(buf, expect_buf) and np.array_equal(local, expect_local)
