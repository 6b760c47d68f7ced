"""readv / writev (docs/remote-memory.md): many (local, ref, offset) ranges as one chain,
each range checked; a refused range, by the caller's checks or by the owner's, leaves
every buffer of both sides as it was (compared whole); on verbs the owner's device
refuses at the range, the ranges before it may have moved."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rdmamw.errors import AccessDenied, OutOfRange, PeerLost, RegionRevoked
from tests.support.regions import pattern as _pattern


def _regions(owner, n: int = 3, size: int = 64 * 1024, access: str = "rw"):
    bufs = [_pattern(size, 100 + i) for i in range(n)]
    return bufs, [owner.expose(b, access) for b in bufs]


def test_readv_reads_every_range_in_one_chain(rpair):
    owner, peer = rpair
    bufs, regs = _regions(owner)
    # ranges across regions, in any order, of any size, one of them a whole region
    want = [(2, 100, 1), (0, 0, 64 * 1024), (1, 65535, 1), (0, 777, 5000), (2, 0, 3)]
    outs = [np.zeros(n, np.uint8) for _, _, n in want]
    before = peer.stats()
    peer.readv([(out, regs[r].ref, off) for out, (r, off, _) in zip(outs, want, strict=True)])
    after = peer.stats()
    for out, (r, off, n) in zip(outs, want, strict=True):
        assert np.array_equal(out, bufs[r][off:off + n])
    assert after["rmem_chains"] - before["rmem_chains"] == 1
    assert after["rmem_ops"] - before["rmem_ops"] == len(want)
    assert after["rmem_bytes_read"] - before["rmem_bytes_read"] == sum(n for *_, n in want)


def test_writev_writes_every_range_and_nothing_else(rpair):
    owner, peer = rpair
    bufs, regs = _regions(owner)
    expect = [b.copy() for b in bufs]
    ranges = [(1, 10, 300), (0, 5000, 1), (2, 65000, 536), (1, 400, 7)]
    srcs = [_pattern(n, 200 + i) for i, (_, _, n) in enumerate(ranges)]
    before = peer.stats()
    peer.writev([(src, regs[r].ref, off) for src, (r, off, _) in zip(srcs, ranges, strict=True)])
    for src, (r, off, n) in zip(srcs, ranges, strict=True):
        expect[r][off:off + n] = src
    for buf, exp in zip(bufs, expect, strict=True):
        assert np.array_equal(buf, exp)
    assert peer.stats()["rmem_chains"] - before["rmem_chains"] == 1


def test_the_batch_takes_vectors_beside_single_operations(rpair):
    owner, peer = rpair
    bufs, regs = _regions(owner, 2)
    a, b = np.zeros(10, np.uint8), np.zeros(20, np.uint8)
    src = _pattern(30, 9)
    ops = peer.batch().readv([(a, regs[0].ref, 0), (b, regs[1].ref, 30)])
    ops.writev([(src, regs[1].ref, 0)]).read(regs[0].ref, c := np.zeros(5, np.uint8), 60)
    assert len(ops) == 4
    ops.post()
    assert np.array_equal(a, _pattern(64 * 1024, 100)[:10])
    assert np.array_equal(b, _pattern(64 * 1024, 101)[30:50])    # read before the write
    assert np.array_equal(bufs[1][:30], src)
    assert np.array_equal(c, bufs[0][60:65])


@pytest.mark.parametrize("write", [False, True])
def test_a_range_refused_by_the_checks_moves_nothing(rpair, write):
    owner, peer = rpair
    bufs, regs = _regions(owner, 2)
    keep = [b.copy() for b in bufs]
    locals_ = [_pattern(100, 50) if write else np.zeros(100, np.uint8) for _ in range(3)]
    local_keep = [x.copy() for x in locals_]
    bad = [(locals_[0], regs[0].ref, 0), (locals_[1], regs[1].ref, 64 * 1024 - 99),
           (locals_[2], regs[1].ref, 0)]                  # the middle one: 1 byte over
    call = peer.writev if write else peer.readv
    with pytest.raises(OutOfRange):
        call(bad)
    ops = peer.batch().readv([(np.zeros(4, np.uint8), regs[0].ref, 0)])
    with pytest.raises(OutOfRange):
        ops.writev(bad) if write else ops.readv(bad)
    assert len(ops) == 1                                  # the refused vector added none
    for buf, k in zip(bufs, keep, strict=True):
        assert np.array_equal(buf, k)
    for x, k in zip(locals_, local_keep, strict=True):
        assert np.array_equal(x, k)


@pytest.mark.parametrize("write", [False, True])
def test_a_range_the_owner_refuses_moves_nothing_of_the_chain(rpair, write):
    """The caller's checks pass (the reference says the region is there), the owner's
    table refuses the third range (revoked): none of the four moved, either side. On
    verbs the owner's device refuses at that range (it executes a chain in order): the
    two before it may have moved, nothing from it on, and the connection is lost."""
    owner, peer = rpair
    bufs, regs = _regions(owner, 3)
    gone_buf = _pattern(4096, 77)
    gone = owner.expose(gone_buf, "rw")
    gone.revoke()
    keep = [b.copy() for b in bufs]
    gone_keep = gone_buf.copy()
    locals_ = [_pattern(100, 60 + i) if write else np.zeros(100, np.uint8) for i in range(4)]
    local_keep = [x.copy() for x in locals_]
    ranges = [(locals_[0], regs[0].ref, 0), (locals_[1], regs[1].ref, 10),
              (locals_[2], gone.ref, 0), (locals_[3], regs[2].ref, 20)]
    with pytest.raises(RegionRevoked):
        (peer.writev if write else peer.readv)(ranges)
    by_device = owner.provider == "verbs"
    first = 2 if by_device else 0                       # the first range not to move
    for buf, k in list(zip(bufs, keep, strict=True))[first:]:
        assert np.array_equal(buf, k)
    assert np.array_equal(gone_buf, gone_keep)
    for x, k in list(zip(locals_, local_keep, strict=True))[first:]:
        assert np.array_equal(x, k)
    out = np.zeros(100, np.uint8)
    if by_device:
        with pytest.raises(PeerLost):
            peer.readv([(out, regs[1].ref, 10)])
        return
    peer.readv([(out, regs[1].ref, 10)])                # the channel still serves
    assert np.array_equal(out, bufs[1][10:110])


def test_a_write_range_into_a_read_only_region_is_refused(rpair):
    owner, peer = rpair
    bufs, regs = _regions(owner, 1)
    ro = _pattern(1000, 5)
    ro_keep, keep = ro.copy(), bufs[0].copy()
    rreg = owner.expose(ro, "r")
    with pytest.raises(AccessDenied):
        peer.writev([(_pattern(10, 1), regs[0].ref, 0), (_pattern(10, 2), rreg.ref, 0)])
    assert np.array_equal(ro, ro_keep) and np.array_equal(bufs[0], keep)


def test_threads_posting_vectors_at_once_each_get_their_own_ranges(rpair):
    """Four threads, each its own region and many ranges per chain, at the same time
    on one channel (tcp: one of them builds its chain in the connection's scratch, the
    others in their own arrays): every range read is the right one."""
    owner, peer = rpair
    bufs, regs = _regions(owner, 4, 16 * 1024)
    errors: list = []

    def worker(k: int) -> None:
        try:
            for it in range(60):
                n = 1 + (it * 7 + k) % 40
                offs = [(j * 389 + it) % (16 * 1024 - 64) for j in range(n)]
                outs = [np.zeros(64, np.uint8) for _ in range(n)]
                peer.readv([(o, regs[k].ref, off) for o, off in zip(outs, offs, strict=True)])
                for o, off in zip(outs, offs, strict=True):
                    assert np.array_equal(o, bufs[k][off:off + 64])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
