"""Atomics in a batch (docs/remote-memory.md, "Atomics in a batch"): ``fetch_add`` and
``compare_swap`` mixed with reads and writes in one chain, run in the order added (on
verbs, fences where the device could reorder), their old values in the post's
``values``; one chain, one doorbell; an atomic the caller's checks refuse adds nothing
to the batch, one the owner refuses moves nothing of the chain (on verbs the device
refuses at the operation: placed first, nothing moved, the connection lost)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import rdmamw.aio as aio
from rdmamw.errors import (
    AccessDenied,
    ForeignReference,
    OutOfRange,
    ProviderUnavailable,
    RegionRevoked,
)
from tests.channel.test_remote_memory import (
    BY_DEVICE,
    WITH_ATOMICS,
    _forge,
    _refused,
    _refused_by_owner,
    _words,
)
from tests.support.regions import pattern

M64 = 2**64


@pytest.mark.parametrize("rpair", WITH_ATOMICS, indirect=True)
def test_a_batch_mixing_reads_writes_and_atomics_runs_in_order(rpair):
    """Every operation of the chain sees the ones before it (a read after an atomic,
    an atomic after a write of its word, a write after a read): the whole region,
    every read and every old value are exactly the sequential outcome."""
    owner, peer = rpair
    init = [5, 7, 9, M64 - 2, 0, 0, 0, 0, 11, 12, 13, 14, 15, 16, 17, 18]
    words = _words(init)
    side = pattern(4096, 3)                 # a plain region in the same chain
    side_keep = side.copy()
    reg, sreg = owner.expose(words, "atomic"), owner.expose(side, "rw")
    src = np.array([100, 200, 300, 400], np.uint64)
    out0, out1 = np.zeros(16, np.uint64), np.zeros(16, np.uint64)
    out2, sout = np.zeros(1, np.uint64), np.zeros(64, np.uint8)
    new_side = pattern(32, 4)
    before = peer.stats()
    ops = peer.batch()
    ops.read(reg.ref, out0)
    ops.fetch_add(reg.ref, 0, 5)                    # 5 -> 10
    ops.compare_swap(reg.ref, 8, 7, 70)             # swapped
    ops.compare_swap(reg.ref, 16, 8, 80)            # not swapped: 9 stays
    ops.read(sreg.ref, sout, 1000)
    ops.write(new_side, sreg.ref, 1000)             # after the read of those bytes
    ops.fetch_add(reg.ref, 24, 3)                   # wraps: M64-2 -> 1
    ops.write(src, reg.ref, 32)                     # words 4..7
    ops.read(reg.ref, out1)
    ops.fetch_add(reg.ref, 32, 1)                   # on the word just written
    ops.read(reg.ref, out2, 32)
    ops.compare_swap(reg.ref, 0, 10, M64 - 1)       # sees the first fetch_add
    assert len(ops) == 12
    done = ops.post()
    after = peer.stats()
    assert done.values == (5, 7, 9, M64 - 2, 100, 10)
    assert done.wait() == done.values and done.count == 12
    expect = np.array(init, np.uint64)
    assert np.array_equal(out0, expect)
    expect[:4] = [10, 70, 9, 1]
    expect[4:8] = src
    assert np.array_equal(out1, expect)
    expect[4] += 1
    assert np.array_equal(out2, expect[4:5])
    expect[0] = M64 - 1
    assert np.array_equal(words, expect)
    assert np.array_equal(sout, side_keep[1000:1064])
    side_keep[1000:1032] = new_side
    assert np.array_equal(side, side_keep)
    keys = ("rmem_ops", "rmem_chains", "doorbells")
    assert {k: after[k] - before[k] for k in keys} == {
        "rmem_ops": 12, "rmem_chains": 1, "doorbells": 1}
    if owner.provider == "verbs":           # one WR an operation, only the last signaled
        assert after["work_requests"] - before["work_requests"] == 12
        assert after["signaled_completions"] - before["signaled_completions"] == 1
    assert peer.batch().post().values == ()


@pytest.mark.parametrize("rpair", WITH_ATOMICS, indirect=True)
def test_batches_of_fetch_adds_from_two_threads_sum_exactly(rpair):
    """Two threads post batches of fetch_adds on one word over one channel at the same
    time: every old value is handed out once, the word ends at the exact total, each
    batch's values rise in its order, one chain a batch."""
    owner, peer = rpair
    batches, per = 40, 16
    words = _words([0, 0xABCDEF, 0, 0])     # [1]: a neighbour no operation names
    ref = owner.expose(words, "atomic").ref
    got: list[list[tuple[int, ...]]] = [[], []]
    failed: list = []

    def poster(i: int) -> None:
        try:
            for _ in range(batches):
                ops = peer.batch()
                for _ in range(per):
                    ops.fetch_add(ref, 0, 1)
                ops.fetch_add(ref, 16, 1 + i)       # a word per thread's total too
                got[i].append(ops.post().values)
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    before = peer.stats()
    threads = [threading.Thread(target=poster, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert failed == []
    total = 2 * batches * per
    assert np.array_equal(words, np.array([total, 0xABCDEF, 3 * batches, 0], np.uint64))
    olds = [v for g in got for vals in g for v in vals[:per]]
    assert sorted(olds) == list(range(total))
    assert all(list(vals[:per]) == sorted(vals[:per]) for g in got for vals in g)
    after = peer.stats()
    assert after["rmem_chains"] - before["rmem_chains"] == 2 * batches
    assert after["rmem_ops"] - before["rmem_ops"] == 2 * batches * (per + 1)
    # verbs: the batches' operand buffers are kept and registered once, not per post
    assert after["registrations"] - before["registrations"] <= 2


def _regions(owner):
    """An "atomic" region of 16 words and a plain one, with copies to compare."""
    words = _words(range(100, 116))
    side = pattern(4096, 8)
    return words, side, owner.expose(words, "atomic"), owner.expose(side, "rw")


@pytest.mark.parametrize("rpair", WITH_ATOMICS, indirect=True)
@pytest.mark.parametrize("op", ["fetch_add", "compare_swap"])
@pytest.mark.parametrize("how", ["unaligned", "plain", "outside", "foreign"])
def test_an_atomic_the_caller_refuses_adds_nothing(rpair, op, how):
    """The single atomics' checks, made when the atomic is added: its typed error,
    nothing posted, the batch keeps what it had (and then posts it whole)."""
    owner, peer = rpair
    words, side, reg, sreg = _regions(owner)
    keep, side_keep = words.copy(), side.copy()
    ref, offset, exc = {
        "unaligned": (reg.ref, 4, AccessDenied),
        "plain": (sreg.ref, 0, AccessDenied),
        "outside": (reg.ref, 128, OutOfRange),
        "foreign": (_forge(reg.ref, channel=reg.ref.channel ^ 1), 0, ForeignReference),
    }[how]
    src = pattern(16, 9)
    ops = peer.batch().write(src, sreg.ref, 64).fetch_add(reg.ref, 8, 1)
    before = peer.stats()
    with pytest.raises(exc):
        if op == "fetch_add":
            ops.fetch_add(ref, offset, 1)
        else:
            ops.compare_swap(ref, offset, 0, 1)
    assert len(ops) == 2 and peer.stats()["rmem_chains"] == before["rmem_chains"]
    assert np.array_equal(words, keep) and np.array_equal(side, side_keep)
    assert ops.post().values == (101,)
    keep[1] += 1
    side_keep[64:80] = src
    assert np.array_equal(words, keep) and np.array_equal(side, side_keep)


@pytest.mark.parametrize("rpair", WITH_ATOMICS, indirect=True)
@pytest.mark.parametrize("how", ["revoked", "raised", "tag"])
def test_an_atomic_the_owner_refuses_moves_nothing_of_the_batch(rpair, how):
    """A revoked region, access bits raised by hand, a forged tag: only the owner
    knows. On shm and tcp it checks the whole chain first: the refused atomic last,
    none of the writes and atomics before it moved, the channel usable. On verbs the
    device refuses at the operation, so it goes first: nothing moved, and the
    connection is lost (docs/remote-memory.md)."""
    owner, peer = rpair
    words, side, reg, sreg = _regions(owner)
    other = _words([1, 2, 3, 4])
    oreg = owner.expose(other, "rw" if how == "raised" else "atomic")
    bad = {"revoked": oreg.ref, "raised": _forge(oreg.ref, access=7),
           "tag": _forge(oreg.ref, tag=oreg.ref.tag + 1)}[how]
    if how == "revoked":
        oreg.revoke()
    exc = {"revoked": RegionRevoked, "raised": AccessDenied, "tag": RegionRevoked}[how]
    side_keep = side.copy()
    out = np.zeros(8, np.uint64)

    def call() -> None:
        ops = peer.batch()
        if owner.provider in BY_DEVICE:
            ops.fetch_add(bad, 8, 1)
        ops.write(pattern(64, 10), sreg.ref, 128).fetch_add(reg.ref, 0, 1)
        ops.read(reg.ref, out).compare_swap(reg.ref, 8, 101, 5)
        if owner.provider not in BY_DEVICE:
            ops.compare_swap(bad, 8, 2, 9)
        ops.post()

    keep = other.copy()
    _refused_by_owner(owner, peer, words, call, exc)
    assert np.array_equal(side, side_keep) and np.array_equal(other, keep)


@pytest.mark.parametrize("rpair", WITH_ATOMICS, indirect=True)
def test_an_atomic_batch_on_a_channel_usable_after_a_refusal(rpair):
    """A batch refused by the owner (shm, tcp) leaves the next one whole and exact."""
    owner, peer = rpair
    if owner.provider in BY_DEVICE:
        pytest.skip("on verbs a refusal ends the connection")
    words, side, reg, sreg = _regions(owner)
    gone = owner.expose(_words([0]), "atomic")
    gone.revoke()
    _refused(owner, peer, words, lambda: peer.batch().fetch_add(reg.ref, 0, 1)
             .fetch_add(gone.ref, 0, 1).post(), RegionRevoked)
    assert peer.batch().fetch_add(reg.ref, 0, 1).compare_swap(
        reg.ref, 0, 101, 7).post().values == (100, 101)
    assert int(words[0]) == 7


@pytest.mark.parametrize("rpair", WITH_ATOMICS, indirect=True)
def test_an_awaited_batch_gives_its_atomics_old_values(rpair):
    """The aio batch: the same operations, awaited, the same values and words."""
    owner, peer = rpair
    words, side, reg, sreg = _regions(owner)
    out = np.zeros(2, np.uint64)

    async def main() -> tuple[int, ...]:
        ops = aio.Channel(peer).batch().fetch_add(reg.ref, 0, 7).read(reg.ref, out)
        ops.compare_swap(reg.ref, 8, 101, 1).compare_swap(reg.ref, 16, 0, 1)
        assert len(ops) == 4
        return await (await ops.post(timeout=30))

    assert asyncio.run(main()) == (100, 101, 102)
    assert np.array_equal(out, [107, 101])
    expect = np.arange(100, 116, dtype=np.uint64)
    expect[:2] = [107, 1]
    assert np.array_equal(words, expect)


def test_a_provider_without_atomics_says_so():
    """A batch's atomic on a provider that cannot: ProviderUnavailable naming it, at
    the add (before anything is posted)."""
    from rdmamw.channel.remote import RegionRef, RemoteMemory

    class NoAtomics(RemoteMemory):
        provider, closed = "example", False

        class _transport:
            registers_memory = False
            region_atomics = False

            @staticmethod
            def region_ids():
                return 1, 2

        def _ops(self):
            return None

    ops = NoAtomics().batch()
    with pytest.raises(ProviderUnavailable, match="example"):
        ops.fetch_add(RegionRef(2, 1, 1, 4096, 64, 7), 0, 1)
    assert len(ops) == 0
