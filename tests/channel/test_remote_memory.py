"""Remote memory (docs/remote-memory.md): a peer reads and writes a buffer the owner
exposed, one-sided and batched; every refused access leaves the owner's buffer as it
was and the channel usable (on verbs, a refusal by the owner's device ends the
connection instead); a revoke ends every access before it returns; the owner's death
is PeerLost. verbs runs in the soft-RoCE VM (device tests)."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmamw.channel import remote
from rdmamw.channel.remote import REF_BYTES, RegionRef
from rdmamw.errors import (
    AccessDenied,
    ForeignReference,
    OutOfRange,
    PeerLost,
    ProviderUnavailable,
    RegionRevoked,
    RemoteAccessError,
)
from tests.support.helpers import LISTEN_ADDRESS, make_pair, within
from tests.support.regions import ROOT, VERBS, WITH, WITHOUT

#: where the owner's device refuses an access it was not granted (a forged or revoked
#: reference): a remote access error, which ends the RC connection on both sides
BY_DEVICE = {"verbs"}
#: the providers with fetch_add / compare_swap (shm: CPU atomics on the peer's mapping
#: of the owner's shared memory; tcp: the owner's progress thread runs them; verbs: the
#: owner's device). Their words are rdmamw.memory.shared() memory, which shm needs
#: (tests/channel/test_shm_atomics.py: any other buffer is refused there)
ATOMICS = {"shm", "tcp", "verbs"}


def _words(values) -> np.ndarray:
    """``values`` as uint64 words in memory a peer can map (rdmamw.memory.shared)."""
    import rdmamw.memory
    words = rdmamw.memory.shared(8 * len(values)).view(np.uint64)
    words[:] = values
    return words


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _usable(owner, peer) -> None:
    """The channel still carries messages both ways and a fresh region still works."""
    peer.send(b"ping")
    assert bytes(owner.recv(timeout=5)) == b"ping"
    owner.send(b"pong")
    assert bytes(peer.recv(timeout=5)) == b"pong"
    data = _pattern(4096, 99)
    with owner.expose(data, "r") as reg:
        out = np.zeros_like(data)
        peer.read(reg.ref, out).wait()
        assert np.array_equal(out, data)


@pytest.mark.parametrize("n", [1, 4095, 65536, 4 * 2**20 + 13])
def test_read_and_write_round_trip(rpair, n):
    owner, peer = rpair
    buf = _pattern(n, 1)
    keep = buf.copy()
    reg = owner.expose(buf, "rw")
    out = np.zeros(n, np.uint8)
    h = peer.read(reg.ref, out)
    assert h.done() and h.wait() is None
    assert np.array_equal(out, keep)
    src = _pattern(n, 2)
    peer.write(src, bytes(reg.ref)).wait()          # the bytes of the reference work too
    assert np.array_equal(buf, src)
    if n > 2:                                       # offsets: only that range changes
        part = _pattern(n // 2, 3)
        peer.write(part, reg.ref, offset=1)
        expect = src.copy()
        expect[1:1 + n // 2] = part
        assert np.array_equal(buf, expect)
        tail = np.zeros(n - 2, np.uint8)
        peer.read(reg.ref, tail, offset=2)
        assert np.array_equal(tail, expect[2:])
    reg.revoke()


def test_the_reference_pickles_and_round_trips_as_bytes(rpair):
    owner, peer = rpair
    buf = _pattern(1000, 4)
    reg = owner.expose(buf, "r")
    ref = pickle.loads(pickle.dumps(reg.ref))
    assert ref == reg.ref == RegionRef.from_bytes(bytes(reg.ref))
    assert len(bytes(ref)) == REF_BYTES
    out = np.zeros(1000, np.uint8)
    peer.read(ref, out)
    assert np.array_equal(out, buf)


def test_a_batch_is_one_chain(rpair):
    owner, peer = rpair
    bufs = [_pattern(8192, s) for s in range(4)]
    regs = [owner.expose(b, "rw") for b in bufs]
    srcs = [_pattern(100, 10 + s) for s in range(4)]
    outs = [np.zeros(8192, np.uint8) for _ in range(4)]
    before = peer.stats()
    ops = peer.batch()
    for reg, out in zip(regs, outs, strict=True):
        ops.read(reg.ref, out)
    for i, (reg, src) in enumerate(zip(regs, srcs, strict=True)):
        ops.write(src, reg.ref, offset=i * 100)
    assert len(ops) == 8
    ops.post().wait()
    after = peer.stats()
    assert after["rmem_ops"] - before["rmem_ops"] == 8
    assert after["rmem_chains"] - before["rmem_chains"] == 1
    assert after["doorbells"] - before["doorbells"] == 1
    for i, (buf, out) in enumerate(zip(bufs, outs, strict=True)):
        expect = _pattern(8192, i)
        assert np.array_equal(out, expect)          # read before the write in the chain
        expect[i * 100:(i + 1) * 100] = srcs[i]
        assert np.array_equal(buf, expect)


def test_notify_comes_after_the_bytes_are_visible(rpair):
    owner, peer = rpair
    n = 32 * 2**20
    buf = np.zeros(n, np.uint8)
    reg = owner.expose(buf, "w")
    seen: list = []

    def watch() -> None:
        for _ in range(3):
            msg = owner.recv(timeout=20)
            k = int(bytes(msg))
            # the last byte first (a write lands front to back), then all of them: k, or
            # a later write landing
            seen.append(bool(buf[-1] >= k and (buf >= k).all()))

    t = threading.Thread(target=watch)
    t.start()
    for k in (1, 2, 3):
        peer.write(np.full(n, k, np.uint8), reg.ref, notify=b"%d" % k)
    t.join(30)
    assert seen == [True, True, True]


def _refused(owner, peer, buf, call, exc) -> None:
    keep = buf.copy()
    with pytest.raises(exc):
        call()
    assert np.array_equal(buf, keep)        # nothing of the owner's buffer changed
    _usable(owner, peer)


def _refused_by_owner(owner, peer, buf, call, exc) -> None:
    """A refusal only the owner's side can make (its exposure table, or its device):
    ``exc`` and the channel usable on shm and tcp; on verbs RegionRevoked (the device
    does not say which rule), and the connection lost on both sides."""
    if owner.provider not in BY_DEVICE:
        _refused(owner, peer, buf, call, exc)
        return
    keep = buf.copy()
    with pytest.raises(RegionRevoked, match="device refused"):
        call()
    assert np.array_equal(buf, keep)
    with pytest.raises(PeerLost, match=r"status 10\b"):      # IBV_WC_REM_ACCESS_ERR
        peer.read(RegionRef(peer._transport.region_ids()[1], 1, 1, 4096, 8, 1),
                  np.zeros(8, np.uint8))
    with pytest.raises(PeerLost):
        owner.recv(timeout=10)


def _forge(ref: RegionRef, **fields) -> RegionRef:
    d = dict(ref.__dict__)
    d.update(fields)
    return RegionRef(**d)


def test_outside_the_range_is_refused(rpair):
    owner, peer = rpair
    buf = _pattern(10000, 5)
    reg = owner.expose(buf, "rw")
    big = np.zeros(10001, np.uint8)
    _refused(owner, peer, buf, lambda: peer.read(reg.ref, big), OutOfRange)
    _refused(owner, peer, buf, lambda: peer.write(big[:10], reg.ref, offset=9995), OutOfRange)
    _refused(owner, peer, buf, lambda: peer.write(big[:1], reg.ref, offset=-1), OutOfRange)


@pytest.mark.parametrize("write", [True, False], ids=["write", "read"])
def test_a_reference_claiming_more_is_refused(rpair, write):
    """A reference that claims more than was exposed: the provider refuses it."""
    owner, peer = rpair
    buf = _pattern(10000, 5)
    reg = owner.expose(buf, "rw")
    big = np.zeros(10001, np.uint8)
    liar = _forge(reg.ref, length=20000)
    call = ((lambda: peer.write(big, liar, offset=5000)) if write
            else (lambda: peer.read(liar, big, offset=5000)))
    _refused_by_owner(owner, peer, buf, call, OutOfRange)


@pytest.mark.parametrize("field", ["tag", "key", "key0"])
def test_a_forged_reference_is_refused(rpair, field):
    owner, peer = rpair
    buf = _pattern(4096, 6)
    reg = owner.expose(buf, "rw")
    src = np.zeros(16, np.uint8)
    forged = {"tag": _forge(reg.ref, tag=reg.ref.tag + 1),
              "key": _forge(reg.ref, key=reg.ref.key ^ 1),
              "key0": _forge(reg.ref, key=0)}[field]
    _refused_by_owner(owner, peer, buf, lambda: peer.write(src, forged), RegionRevoked)


def test_a_revoked_reference_is_refused(rpair):
    owner, peer = rpair
    buf = _pattern(4096, 6)
    reg = owner.expose(buf, "rw")
    src = np.zeros(16, np.uint8)
    peer.write(src, reg.ref)                    # it worked before the revoke
    buf[:16] = _pattern(16, 60)
    if owner.provider in BY_DEVICE:             # one refusal per connection there
        reg.revoke()
        owner.expose(buf, "rw")                 # the same buffer again: a new key
        _refused_by_owner(owner, peer, buf, lambda: peer.write(src, reg.ref),
                          RegionRevoked)
        return
    reg.revoke()
    _refused(owner, peer, buf, lambda: peer.write(src, reg.ref), RegionRevoked)
    again = owner.expose(buf, "rw")             # the same slot may come back: new tag
    _refused(owner, peer, buf, lambda: peer.write(src, reg.ref), RegionRevoked)
    again.revoke()


def test_the_wrong_access_is_refused(rpair):
    owner, peer = rpair
    buf = _pattern(4096, 7)
    ro = owner.expose(buf, "r")
    src = np.zeros(8, np.uint8)
    _refused(owner, peer, buf, lambda: peer.write(src, ro.ref), AccessDenied)
    _refused(owner, peer, buf, lambda: peer.fetch_add(ro.ref, 0, 1), AccessDenied)
    atomic = _forge(ro.ref, access=7)
    _refused(owner, peer, buf, lambda: peer.compare_swap(atomic, 4, 0, 1), AccessDenied)


@pytest.mark.parametrize("exposed", ["r", "w"])
def test_access_bits_raised_by_hand_are_refused(rpair, exposed):
    """The reference's access bits raised by hand: the owner's exposure says no."""
    owner, peer = rpair
    buf = _pattern(4096, 7)
    reg = owner.expose(buf, exposed)
    src = np.zeros(8, np.uint8)
    forged = _forge(reg.ref, access=3)
    call = ((lambda: peer.write(src, forged)) if exposed == "r"
            else (lambda: peer.read(forged, src)))
    _refused_by_owner(owner, peer, buf, call, AccessDenied)


def test_a_reference_from_another_channel_is_refused(rpair):
    owner, peer = rpair
    a2, b2, lst2 = make_pair("batched", provider=owner.provider)
    try:
        other = _pattern(4096, 8)
        reg2 = a2.expose(other, "rw")
        buf = _pattern(4096, 9)
        owner.expose(buf, "rw")
        src = np.zeros(16, np.uint8)
        _refused(owner, peer, other, lambda: peer.write(src, reg2.ref), ForeignReference)
        # and the owner's side cannot use its own reference on itself
        _refused(owner, peer, buf, lambda: owner.read(reg2.ref, src), ForeignReference)
    finally:
        a2.close()
        b2.close()
        lst2.close()


def test_garbage_is_not_a_reference(rpair):
    owner, peer = rpair
    buf = _pattern(4096, 10)
    reg = owner.expose(buf, "rw")
    raw = bytearray(bytes(reg.ref))
    raw[20] ^= 1                                # the tag, without fixing the check word
    _refused(owner, peer, buf, lambda: peer.write(b"x", bytes(raw)), RemoteAccessError)
    _refused(owner, peer, buf, lambda: peer.write(b"x", b"short"), RemoteAccessError)


def test_the_exposure_keeps_a_dropped_buffer_alive(rpair):
    owner, peer = rpair
    n = 8 * 2**20                               # above malloc's mmap threshold: freed
    buf = _pattern(n, 11)                       # memory would be unmapped at once
    keep = buf.copy()
    reg = owner.expose(buf, "rw")
    del buf
    gc.collect()
    junk = [np.full(n, 0xEE, np.uint8) for _ in range(4)]
    out = np.zeros(n, np.uint8)
    peer.read(reg.ref, out)
    assert np.array_equal(out, keep)
    assert len(junk) == 4


def _write_until_revoked(peer, ref, size, offset, stop, outcome, lost) -> None:
    """Write ``size`` bytes of 0x55 at ``offset`` again and again until ``stop``; the
    outcome ("revoked", "lost", or the unexpected exception) goes to ``outcome``, what a
    PeerLost said to ``lost``."""
    src = np.full(size, 0x55, np.uint8)
    try:
        while not stop.is_set():
            peer.write(src, ref, offset=offset)
    except RegionRevoked:
        outcome.append("revoked")
    except PeerLost as e:
        outcome.append("lost")
        lost.append(str(e))
    except BaseException as e:  # noqa: BLE001 - reported by the test
        outcome.append(e)


@pytest.mark.parametrize("rnd", range(5))      # a race: each round may catch it
@pytest.mark.parametrize("sizes", [(1,), (4096, 1)], ids=["one", "two-threads"])
def test_no_byte_moves_after_revoke_returns(rpair, rnd, sizes):
    """One writer; or two threads of the peer writing at once, a short chain and a long
    one (the short one ends and starts again while the long one copies): the revoke
    waits for every chain in progress, not only the one that began first. On verbs
    the device refuses every later request and the revoke waits for the chains the
    peer had posted (a WRITE accepted before is checked at its first packet only)."""
    owner, peer = rpair
    n = 16 * 2**20
    buf = np.zeros(n, np.uint8)
    reg = owner.expose(buf, "rw")
    stop = threading.Event()
    outcome: list = []
    lost: list = []
    sizes = [n if s == 1 else s for s in sizes]
    threads = [threading.Thread(target=_write_until_revoked,
                                args=(peer, reg.ref, size, n - size, stop, outcome, lost))
               for size in sizes]
    for t in threads:
        t.start()
    while not buf[0]:                           # the long write has landed: they run
        time.sleep(0.001)
    time.sleep(0.01 * rnd)
    reg.revoke()
    buf[:] = 0xAA                               # ours again, on every provider
    time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(10)
    if owner.provider in BY_DEVICE and len(sizes) > 1:
        # the device refused one thread's WRITE: the connection is lost, and the other
        # thread's chain either failed with it (RegionRevoked) or began after (PeerLost)
        assert "revoked" in outcome and set(outcome) <= {"revoked", "lost"}, lost
    else:
        assert outcome == ["revoked"] * len(sizes), lost
    assert (buf == 0xAA).all()


def test_two_threads_read_large_regions_at_once(rpair):
    """Large reads of two threads at once (each may ask the owner's help: one job
    record) come back whole."""
    owner, peer = rpair
    n = 6 * 2**20
    bufs = [_pattern(n, 40 + i) for i in range(2)]
    regs = [owner.expose(b, "r") for b in bufs]
    bad: list = []

    def idle_owner() -> None:                   # in the engine: it may help copy
        try:
            owner.recv(timeout=30)
        except Exception:  # noqa: BLE001 - the test's end
            pass

    def reader(i: int) -> None:
        out = np.zeros(n, np.uint8)
        for _ in range(15):
            peer.read(regs[i].ref, out)
            if not np.array_equal(out, bufs[i]):
                bad.append(i)

    helper = threading.Thread(target=idle_owner)
    helper.start()
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    peer.send(b"end")
    helper.join(10)
    assert bad == []


def test_a_revoke_during_a_read_is_reported(rpair):
    owner, peer = rpair
    n = 32 * 2**20
    buf = _pattern(n, 12)
    reg = owner.expose(buf, "r")
    out = np.zeros(n, np.uint8)
    outcome: list = []

    def reader() -> None:
        try:
            while True:
                peer.read(reg.ref, out)
                assert np.array_equal(out, buf)     # a read that returned is whole
        except RegionRevoked:
            outcome.append("revoked")
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.1)
    reg.revoke()
    t.join(10)
    assert outcome == ["revoked"]


OWNER = textwrap.dedent("""
    import sys, time, numpy as np, rdmamw
    lst = rdmamw.listen(sys.argv[1])
    print(lst.address, flush=True)              # tcp: the port it was given
    ch = lst.accept(timeout=60)
    buf = np.ones(256 * 2**20, np.uint8)
    reg = ch.expose(buf, "rw")
    ch.send(bytes(reg.ref))
    time.sleep(120)
""")


@pytest.mark.parametrize("provider", WITH)
def test_the_owner_dies_during_a_read(provider):
    addr = LISTEN_ADDRESS[provider]()
    p = subprocess.Popen([sys.executable, "-c", OWNER, addr], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        import rdmamw
        ch = rdmamw.Channel.open(p.stdout.readline().strip(), timeout=30)
        ref = bytes(ch.recv(timeout=30))
        out = np.zeros(256 * 2**20, np.uint8)
        ch.read(ref, out)
        assert (out == 1).all()
        killer = threading.Timer(0.05, os.kill, (p.pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(PeerLost):
            while time.monotonic() - t0 < 10:
                ch.read(ref, out)
        assert time.monotonic() - t0 < within(3.0)
        ch.close()
    finally:
        p.kill()
        p.wait()


WITH_ATOMICS = [p for p in WITH if p.values[0] in ATOMICS]


@pytest.mark.parametrize("provider", VERBS)
def test_a_batch_of_256_is_one_doorbell_and_one_completion(provider, monkeypatch):
    """256 one-sided operations on verbs: one chain, one ibv_post_send, one signaled
    WR (a chain is at most half the send queue: 1024 deep here)."""
    monkeypatch.setenv("RDMAMW_VERBS_SQ_DEPTH", "1024")
    owner, peer, lst = make_pair("batched", provider=provider)
    try:
        buf = _pattern(128 * 64, 70)
        keep = buf.copy()
        reg = owner.expose(buf, "rw")
        outs = [np.zeros(32, np.uint8) for _ in range(128)]
        srcs = [_pattern(32, 100 + i) for i in range(128)]
        before = peer.stats()
        ops = peer.batch()
        for i, out in enumerate(outs):
            ops.read(reg.ref, out, offset=i * 64)
        for i, src in enumerate(srcs):
            ops.write(src, reg.ref, offset=i * 64 + 32)
        ops.post().wait()
        after = peer.stats()
        keys = ("rmem_ops", "rmem_chains", "doorbells", "signaled_completions",
                "work_requests")
        assert {k: after[k] - before[k] for k in keys} == {
            "rmem_ops": 256, "rmem_chains": 1, "doorbells": 1,
            "signaled_completions": 1, "work_requests": 256}
        for i in range(128):
            assert np.array_equal(outs[i], keep[i * 64:i * 64 + 32])
            keep[i * 64 + 32:(i + 1) * 64] = srcs[i]
        assert np.array_equal(buf, keep)
    finally:
        owner.close()
        peer.close()
        lst.close()


@pytest.mark.parametrize("provider", VERBS)
def test_a_buffer_exposed_to_two_peers_is_registered_once(provider):
    """verbs: one registration (the process's shared domain), one window per peer."""
    pairs = [make_pair("batched", provider=provider) for _ in range(2)]
    try:
        buf = _pattern(1 << 20, 71)
        cache = pairs[0][0].regcache
        before = cache.registrations
        regs = [owner.expose(buf, "r") for owner, _, _ in pairs]
        assert cache.registrations - before == 1
        assert pairs[1][0].regcache is cache
        for (_, peer, _), reg in zip(pairs, regs, strict=True):
            out = np.zeros(1 << 20, np.uint8)
            peer.read(reg.ref, out)
            assert np.array_equal(out, buf)
        # each key opens the buffer to its own peer only
        with pytest.raises(ForeignReference):
            pairs[1][1].read(regs[0].ref, np.zeros(8, np.uint8))
    finally:
        for a, b, lst in pairs:
            a.close()
            b.close()
            lst.close()


@pytest.mark.parametrize("rpair", WITH_ATOMICS, indirect=True)
def test_atomics(rpair):
    """fetch_add and compare_swap on the words of an "atomic" region: the old value
    back, the owner's words changed as they should (and no other byte), the refusals
    the caller can check refused before anything is posted; each atomic one chain and
    one doorbell in stats()."""
    owner, peer = rpair
    words = _words([5, 7, 2**64 - 1, 0, 0, 0, 0, 0])
    reg = owner.expose(words, "atomic")
    assert peer.fetch_add(reg.ref, 0, 10).wait() == 5
    assert peer.fetch_add(reg.ref.__bytes__(), 0, 1).value == 15
    assert peer.fetch_add(reg.ref, 16, 2).wait() == 2**64 - 1      # wraps
    assert peer.compare_swap(reg.ref, 8, 7, 70).wait() == 7        # swapped
    assert peer.compare_swap(reg.ref, 8, 7, 99).wait() == 70       # not swapped
    expect = np.array([16, 70, 1, 0, 0, 0, 0, 0], np.uint64)
    assert np.array_equal(words, expect)
    _refused(owner, peer, words, lambda: peer.fetch_add(reg.ref, 4, 1), AccessDenied)
    _refused(owner, peer, words, lambda: peer.fetch_add(reg.ref, 64, 1), OutOfRange)
    plain = owner.expose(np.zeros(8, np.uint64), "rw")
    _refused(owner, peer, words, lambda: peer.fetch_add(plain.ref, 0, 1),
             AccessDenied)
    # an "atomic" region reads and writes as well
    out = np.zeros(8, np.uint64)
    peer.read(reg.ref, out)
    assert np.array_equal(out, expect)
    # the operands' buffer is the channel's, registered once, not once per atomic
    before = peer.stats()
    for _ in range(20):
        peer.fetch_add(reg.ref, 24, 1)
    after = peer.stats()
    expect[3] = 20
    assert np.array_equal(words, expect)
    assert after["registrations"] - before["registrations"] <= 1
    keys = ("rmem_ops", "rmem_chains", "doorbells", "rmem_bytes_read",
            "rmem_bytes_written")
    assert {k: after[k] - before[k] for k in keys} == {
        "rmem_ops": 20, "rmem_chains": 20, "doorbells": 20, "rmem_bytes_read": 0,
        "rmem_bytes_written": 0}


@pytest.mark.parametrize("rpair", WITH_ATOMICS, indirect=True)
@pytest.mark.parametrize("how", ["plain", "longer", "revoked", "tag", "key"])
def test_an_atomic_the_owner_did_not_grant_is_refused(rpair, how):
    """What only the owner can know: the region is not "atomic" (the reference's bits
    raised by hand), the word is past the region (the reference claims more), revoked,
    or a forged key or tag. Nothing of the owner's buffer changes."""
    owner, peer = rpair
    buf = _words(range(16))                 # the region is its first half: the word
    reg = owner.expose(buf[:8], "rw" if how == "plain" else "atomic")   # past it is ours
    ref, offset, exc = {
        "plain": (_forge(reg.ref, access=7), 0, AccessDenied),
        "longer": (_forge(reg.ref, length=128), 64, OutOfRange),
        "revoked": (reg.ref, 0, RegionRevoked),
        "tag": (_forge(reg.ref, tag=reg.ref.tag + 1), 0, RegionRevoked),
        "key": (_forge(reg.ref, key=reg.ref.key ^ 1), 0, RegionRevoked)}[how]
    if how == "revoked":
        assert peer.compare_swap(ref, 0, 0, 9).wait() == 0     # granted before
        buf[0] = 0
        reg.revoke()
    _refused_by_owner(owner, peer, buf, lambda: peer.fetch_add(ref, offset, 1), exc)
    if owner.provider not in BY_DEVICE:
        _refused(owner, peer, buf, lambda: peer.compare_swap(ref, offset, 0, 1), exc)


@pytest.mark.parametrize("provider", WITH_ATOMICS)
@pytest.mark.parametrize("op", ["fetch_add", "compare_swap"])
def test_two_peers_hammering_one_word_lose_no_update(provider, op):
    """Two peers (two channels to one owner, two threads: on tcp two progress threads
    of the owner serve them at once) update the same words: fetch_add hands every old
    value out at most once and the word ends at the exact total, with the owner's own
    atomic adds on it meanwhile (tcp: on verbs the device's atomics are not atomic
    with the CPU's); compare_swap increments (retried until they win) end at the exact
    total too."""
    from tests.support.hooks import atomic_adds
    n = 1500
    pairs = [make_pair("batched", provider=provider) for _ in range(2)]
    try:
        words = _words([0, 0, 0xABCDEF, 0])  # [2]: a neighbour no operation names
        refs = [owner.expose(words, "atomic").ref for owner, _, _ in pairs]
        olds: list[list[int]] = [[], []]
        failed: list = []
        stop = threading.Event()
        local = [0]                         # the owner's own adds

        def owner_adds() -> None:
            while not stop.is_set():
                atomic_adds(words.ctypes.data, 20000)
                local[0] += 20000

        def hammer(i: int) -> None:
            peer, ref = pairs[i][1], refs[i]
            try:
                for _ in range(n):
                    if op == "fetch_add":
                        olds[i].append(peer.fetch_add(ref, 0, 1).wait())
                        continue
                    seen = peer.fetch_add(ref, 8, 0).wait()
                    while (got := peer.compare_swap(ref, 8, seen, seen + 1).wait()) != seen:
                        seen = got
                    olds[i].append(seen)
            except BaseException as e:  # noqa: BLE001 - reported below
                failed.append(e)

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
        mine = op == "fetch_add" and provider not in BY_DEVICE
        if mine:
            threads.append(threading.Thread(target=owner_adds))
        for t in threads:
            t.start()
        for t in threads[:2]:
            t.join(120)
        stop.set()
        threads[-1].join(30)
        assert failed == []
        at = 0 if op == "fetch_add" else 1
        expect = np.array([0, 0, 0xABCDEF, 0], np.uint64)
        expect[at] = 2 * n + local[0]
        assert np.array_equal(words, expect)
        if mine:
            assert local[0] > 0 and len(set(olds[0] + olds[1])) == 2 * n
        else:
            assert sorted(olds[0] + olds[1]) == list(range(2 * n))
    finally:
        for a, b, lst in pairs:
            a.close()
            b.close()
            lst.close()


@pytest.mark.parametrize("provider", WITHOUT)
def test_providers_without_regions_say_so(provider):
    a, b, lst = make_pair("batched", provider=provider)
    try:
        with pytest.raises(ProviderUnavailable, match=provider):
            a.expose(np.zeros(64, np.uint8), "r")
        with pytest.raises(ProviderUnavailable, match=provider):
            b.read(bytes(_VALID), np.zeros(8, np.uint8))
        _msg = b"still usable"
        a.send(_msg)
        assert bytes(b.recv(timeout=5)) == _msg
    finally:
        a.close()
        b.close()
        lst.close()


# ---- the reference decoder --------------------------------------------------------

@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=0, max_size=2 * REF_BYTES))
def test_the_decoder_takes_any_bytes(data):
    """Anything is a RegionRef or RemoteAccessError, never another exception."""
    try:
        ref = RegionRef.from_bytes(data)
    except RemoteAccessError:
        return
    assert bytes(ref) == data


_VALID = RegionRef(channel=0x1234_5678_9ABC_DEF1, key=0x0305, tag=77, base=0x7F00_0000_1000,
                   length=65536, access=3)


@settings(max_examples=500, deadline=None)
@given(st.integers(0, REF_BYTES - 1), st.integers(1, 255))
def test_a_changed_byte_is_never_another_reference(pos, flip):
    raw = bytearray(bytes(_VALID))
    raw[pos] ^= flip
    with pytest.raises(RemoteAccessError):
        RegionRef.from_bytes(bytes(raw))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 0xFFFF), st.integers(0, 255), st.integers(0, 2**32 - 1),
       st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_impossible_fields_are_refused_even_with_a_good_check_word(reserved, access, tag,
                                                                   base, length):
    """A reference made by hand (the check word fits) with impossible fields."""
    ok = (not reserved and access in (1, 2, 3, 4, 5, 6, 7) and tag and length
          and base + length <= 2**64)
    head = remote._REF.pack(remote._MAGIC, remote._VERSION, access, reserved, 1, 2, tag,
                            base, length)
    raw = head + remote._check_word(head)
    if ok:
        assert RegionRef.from_bytes(raw) == RegionRef(1, 2, tag, base, length, access)
    else:
        with pytest.raises(RemoteAccessError):
            RegionRef.from_bytes(raw)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(1, 2**32 - 1),
       st.integers(0, 2**63), st.integers(1, 2**63), st.sampled_from([1, 2, 3, 7]))
def test_every_reference_round_trips(channel, key, tag, base, length, access):
    ref = RegionRef(channel, key, tag, base, length, access)
    assert RegionRef.from_bytes(bytes(ref)) == ref
    assert pickle.loads(pickle.dumps(ref)) == ref
