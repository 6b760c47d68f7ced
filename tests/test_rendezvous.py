"""Rendezvous: messages above the eager limit go as descriptors, the receiver READs
them (or the sender WRITEs them into a posted buffer); send handles complete on the
done bits; recv_into / post_recv put them into the user's memory."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdmamw
from tests.helpers import LISTEN_ADDRESS, make_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SLOT = 4096
BIG = 3 * SLOT + 123            # above the eager limit, not a multiple of anything


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(params=["read", "write"])
def strategy(request):
    return request.param


@pytest.fixture
def cma(request, monkeypatch):
    """The copy path (conftest generates it with the provider, from CMA_PATHS): shm both
    ways, with CMA (process_vm_readv) and with it forbidden (staged); the other
    providers have only the direct path."""
    if request.param == "staged":
        monkeypatch.setenv("RDMAMW_SHM_CMA", "0")
    return request.param


@pytest.fixture
def rpair(mode, provider, strategy, cma):
    a, b, lst = make_pair(mode, slots=8, slot_size=SLOT, provider=provider,
                          rendezvous=strategy)
    yield a, b
    a.close()
    b.close()
    lst.close()


def _in_thread(fn):
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["err"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _result(t, out):
    t.join(60)
    assert not t.is_alive()
    if "err" in out:
        raise out["err"]
    return out["value"]


def test_mixed_batch_keeps_order(rpair):
    a, b = rpair
    bigs = [_pattern(BIG + k, k) for k in range(3)]
    msgs = [b"s0", bigs[0], b"s1", b"s2", bigs[1], bigs[2], b"s3"]
    h = a.send_batch(msgs)
    got = []
    while len(got) < len(msgs):
        got += [bytes(m) for m in b.recv_batch(timeout=10)]
    assert got == [bytes(m) for m in msgs]
    h.wait(timeout=10)
    sa, sb = a.stats(), b.stats()
    assert sa["rndv_sends"] == 3 and sa["rndv_bytes"] == sum(x.nbytes for x in bigs)
    assert sb["rndv_received"] == 3 and sb["rndv_reads"] == 3   # nothing posted: READ
    assert sb["rndv_done_writebacks"] >= 1


def test_handle_completes_only_when_the_receiver_took_it(rpair):
    a, b = rpair
    big = _pattern(BIG, 1)
    h = a.send(big)
    assert not h.done()                 # the receiver has not READ it yet
    assert a.rndv_pending == 1
    t, out = _in_thread(lambda: (bytes(b.recv(timeout=10)), bytes(b.recv(timeout=10))))
    h.wait(timeout=10)                  # asks the receiver for its done bits
    assert h.done() and a.rndv_pending == 0
    a.send(b"end")
    got = _result(t, out)
    assert got == (big.tobytes(), b"end")


def test_recv_into_small_and_large(rpair):
    a, b = rpair
    big = _pattern(BIG, 2)
    a.send_batch([b"hello", big])
    buf = np.zeros(BIG + 100, np.uint8)
    assert b.recv_into(buf, timeout=10) == 5
    assert buf[:5].tobytes() == b"hello"
    assert b.recv_into(buf, timeout=10) == BIG
    assert np.array_equal(buf[:BIG], big)
    assert b.stats()["rndv_reads"] == 1


@pytest.mark.parametrize("size", [100, BIG])
def test_recv_into_too_small_keeps_the_message(rpair, size):
    a, b = rpair
    msg = _pattern(size, 3)
    a.send_batch([msg, b"after"])
    small = bytearray(size - 1)
    with pytest.raises(rdmamw.BufferTooSmall) as e:
        b.recv_into(small, timeout=10)
    assert e.value.needed == size and isinstance(e.value, ValueError)
    assert small == bytearray(size - 1)         # nothing was written
    buf = bytearray(size)
    assert b.recv_into(buf, timeout=10) == size and bytes(buf) == msg.tobytes()
    assert bytes(b.recv(timeout=10)) == b"after"


def test_recv_into_refuses_read_only_buffers(rpair):
    _a, b = rpair
    with pytest.raises(TypeError):
        b.recv_into(b"immutable", timeout=0)


def test_posted_buffer_receives_the_message(rpair, strategy, cma):
    a, b = rpair
    dst = [np.zeros(BIG, np.uint8) for _ in range(2)]
    for d in dst:
        b.post_recv(d)
    b.send(b"posted")       # behind the adverts in b's order: a has seen them after this
    assert bytes(a.recv(timeout=10)) == b"posted"
    msgs = [_pattern(BIG, 10), b"small", _pattern(BIG - 7, 11)]
    h = a.send_batch(msgs)
    got = []
    while len(got) < 3:
        got += b.recv_batch(timeout=10)
    assert bytes(got[1]) == b"small"
    for m, d, want in ((got[0], dst[0], msgs[0]), (got[2], dst[1], msgs[2])):
        view = np.frombuffer(m, np.uint8)
        assert np.shares_memory(view, d)         # landed in the posted buffer itself
        assert np.array_equal(view, want)
    del view
    for m in got:
        m.release()
    h.wait(timeout=10)
    sa, sb = a.stats(), b.stats()
    if strategy == "write" and cma == "direct":
        assert sa["rndv_writes"] == 2 and sb["rndv_reads"] == 0     # the sender WROTE
    else:
        assert sa["rndv_writes"] == 0 and sb["rndv_reads"] == 2


def test_posted_buffer_too_small_is_handed_back(rpair):
    a, b = rpair
    b.post_recv(np.zeros(SLOT + 1, np.uint8))
    big = _pattern(BIG, 12)
    a.send(big)
    with pytest.raises(rdmamw.BufferTooSmall):
        b.recv(timeout=10)
    m = b.recv(timeout=10)                  # now into a fresh destination
    assert bytes(m) == big.tobytes()


def test_many_large_messages_reuse_entries(rpair):
    """More rendezvous messages than entries (64): the sender waits for done bits."""
    a, b = rpair
    n = 150
    msgs = [np.full(SLOT + 1 + k, k % 251, np.uint8) for k in range(n)]

    def recv_all():
        got = []
        while len(got) < n:
            got += [bytes(m) for m in b.recv_batch(timeout=10)]
        return got

    t, out = _in_thread(recv_all)
    a.send_batch(msgs, timeout=30).wait(timeout=30)
    assert _result(t, out) == [m.tobytes() for m in msgs]
    assert a.rndv_pending == 0


def test_sources_stay_alive_until_done(rpair):
    a, b = rpair
    src = bytearray(_pattern(BIG, 4).tobytes())
    want = bytes(src)
    h = a.send(src)
    del src                             # the channel keeps the object until done
    assert bytes(b.recv(timeout=10)) == want
    h.wait(timeout=10)


def test_bytes_messages_go_by_rendezvous(rpair):
    a, b = rpair
    data = bytes(_pattern(BIG, 5))
    a.send(data)
    assert bytes(b.recv(timeout=10)) == data


def test_threshold_and_off(provider):
    a, b, lst = make_pair(slot_size=SLOT, provider=provider, rendezvous="read",
                          rndv_threshold=512)
    a.send_batch([bytes(512), bytes(513)])
    got = b.recv_batch(timeout=10)      # a rendezvous message starts a receive batch
    got += b.recv_batch(timeout=10)
    assert [len(m) for m in got] == [512, 513]
    assert a.stats()["rndv_sends"] == 1
    a.close(), b.close(), lst.close()
    a, b, lst = make_pair(slot_size=SLOT, provider=provider, rendezvous="off")
    assert a.rendezvous == "off"
    with pytest.raises(rdmamw.MessageTooLarge):
        a.send(bytes(SLOT + 1))
    with pytest.raises(ValueError):
        b.post_recv(bytearray(10))
    a.close(), b.close(), lst.close()


def test_bad_options():
    with pytest.raises(ValueError):
        rdmamw.Channel.open("shm://nobody-there", rendezvous="sideways", timeout=0.1)
    with pytest.raises(ValueError):
        rdmamw.Channel.open("shm://nobody-there", rndv_threshold=-1, timeout=0.1)


@pytest.mark.parametrize("size", [64 << 20])
def test_64_mib(rpair, size):
    """The issue's target size: 64 MiB by both strategies, into the user's buffer."""
    a, b = rpair
    src = np.arange(size // 8, dtype=np.uint64).view(np.uint8)
    dst = np.zeros(size, np.uint8)
    b.post_recv(dst)
    t, out = _in_thread(lambda: b.recv(timeout=30))
    h = a.send(src)
    m = _result(t, out)
    assert np.shares_memory(np.frombuffer(m, np.uint8), dst)
    m.release()
    assert np.array_equal(dst, src)
    h.wait(timeout=30)


def test_both_directions_at_once(rpair):
    """Each side READs from the other while the other READs from it (tcp: answers
    come from a responder thread, so full sockets on both sides cannot deadlock;
    verbs: the send and receive threads expose memory at once, tests/test_verbs.py)."""
    a, b = rpair
    n, size = 12, 1 << 20
    out = {}

    def side(name, ch, seed):
        msgs = [_pattern(size, seed + k) for k in range(n)]
        got = []
        t, res = _in_thread(lambda: ch.send_batch(msgs, timeout=30).wait(timeout=30))
        while len(got) < n:
            got += [bytes(m) for m in ch.recv_batch(timeout=30)]
        _result(t, res)
        out[name] = got

    t1, r1 = _in_thread(lambda: side("a", a, 100))
    side("b", b, 200)
    _result(t1, r1)
    assert out["b"] == [_pattern(size, 100 + k).tobytes() for k in range(n)]
    assert out["a"] == [_pattern(size, 200 + k).tobytes() for k in range(n)]


# ---- bad descriptors and faults ---------------------------------------------------

DESC = struct.Struct("<QQQIHH")     # addr, length, index, key, kind, entry


def _desc_address(ch) -> int:
    """Address of the descriptor of the (only) pending rendezvous slot."""
    deadline = time.monotonic() + 10
    while not ch._debug_state()["pending"] and time.monotonic() < deadline:
        time.sleep(0.001)           # tcp: the peer's frames land asynchronously
    (slot,) = ch._debug_state()["pending"]
    addr = ch._debug_slot_address(slot) + 64          # payload: one PACKED record
    length, flags = struct.unpack("<II", ctypes.string_at(addr, 8))
    assert (length, flags) == (DESC.size, 1)
    return addr + 8


@pytest.mark.parametrize("change", [
    dict(addr=+(1 << 20)),          # past the exposed range
    dict(addr=-64),                 # before it
    dict(length=+1),                # one byte too many
    dict(key=+1),                   # a key nobody exposed
    dict(kind=7),                   # unknown kind
    dict(index=+1),                 # out of order
    dict(entry=+1),                 # wrong done bit
    dict(length=-BIG),              # empty
])
def test_bad_descriptor_is_protocol_error_and_reads_nothing(provider, cma, change):
    a, b, lst = make_pair(slot_size=SLOT, provider=provider, rendezvous="read")
    try:
        a.send(_pattern(BIG, 6))
        addr = _desc_address(b)
        vals = dict(zip(("addr", "length", "index", "key", "kind", "entry"),
                        DESC.unpack(ctypes.string_at(addr, DESC.size)), strict=True))
        for k, v in change.items():
            vals[k] = v if k == "kind" else (vals[k] + v) % (1 << 64)
        vals["key"] &= 0xFFFFFFFF
        vals["entry"] &= 0xFFFF
        ctypes.memmove(addr, DESC.pack(*vals.values()), DESC.size)
        buf = bytearray(BIG + (1 << 21))
        with pytest.raises(rdmamw.ProtocolError):
            b.recv_into(buf, timeout=5)
        assert buf == bytearray(len(buf))       # nothing was read
        with pytest.raises(rdmamw.ProtocolError):   # a failed channel stays failed
            b.recv(timeout=0)
    finally:        # the broken receiver first: the sender's close stops waiting for it
        b.close(), a.close(), lst.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(raw=st.binary(min_size=DESC.size, max_size=DESC.size),
       keep=st.sets(st.sampled_from(["addr", "length", "index", "key", "kind", "entry"])))
def test_fuzz_descriptor_decoder(raw, keep):
    """Whatever the descriptor says: the right bytes, a typed error, never a write
    outside the destination or a crash."""
    a, b, lst = make_pair(slots=2, slot_size=256, rendezvous="read")
    try:
        src = _pattern(1000, 7)
        a.send(src)
        addr = _desc_address(b)
        names = ("addr", "length", "index", "key", "kind", "entry")
        real = dict(zip(names, DESC.unpack(ctypes.string_at(addr, DESC.size)), strict=True))
        fuzz = dict(zip(names, DESC.unpack(raw), strict=True))
        vals = {k: real[k] if k in keep else fuzz[k] for k in names}
        ctypes.memmove(addr, DESC.pack(*vals.values()), DESC.size)
        guard = 4096
        mem = bytearray(b"\xa5" * (2 * guard + 2000))
        view = memoryview(mem)[guard:guard + 2000]
        try:
            n = b.recv_into(view, timeout=2)
        except (rdmamw.ProtocolError, rdmamw.BufferTooSmall):
            pass
        else:       # only an in-bounds descriptor of the real message gets here
            off = vals["addr"] - real["addr"]
            assert bytes(view[:n]) == src.tobytes()[off:off + n]
        del view
        assert mem[:guard] == b"\xa5" * guard and mem[-guard:] == b"\xa5" * guard
    finally:        # the broken receiver first: the sender's close stops waiting for it
        b.close(), a.close(), lst.close()


SENDER_DIES = """
import os, signal, sys, numpy, rdmamw
ch = rdmamw.Channel.open(sys.argv[1], timeout=60, slot_size=4096, rendezvous="read")
ch.send(numpy.ones(8 << 20, numpy.uint8))
print("sent", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sender_dies_before_the_read_peer_lost(provider, cma):
    with rdmamw.listen(LISTEN_ADDRESS[provider](), slot_size=4096) as lst:
        p = subprocess.Popen([sys.executable, "-c", SENDER_DIES, lst.address],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
        ch = lst.accept(timeout=60)
        assert p.stdout.readline().strip() == "sent"
        p.wait(30)
        buf = np.zeros(8 << 20, np.uint8)
        if cma == "staged":     # the staged copy was complete before it died: delivered
            assert ch.recv_into(buf, timeout=10) == buf.nbytes and buf.all()
            with pytest.raises(rdmamw.PeerLost):
                ch.recv(timeout=10)
        else:
            with pytest.raises(rdmamw.PeerLost):
                n = ch.recv_into(buf, timeout=10)
                raise AssertionError(f"reported {n} bytes from a dead sender")
            assert not buf.any()        # not filled, and not reported as filled
        ch.close()


def test_a_read_refused_because_the_sender_died_is_peer_lost(provider):
    """A killed sender's registrations may go before its connection shows EOF (rxe
    then answers the READ 'remote access error'): a refused READ from a peer that is
    dead is PeerLost, not a ProtocolError blaming it. Here the refusal is a key the
    dead sender never exposed (the soak found the real case on verbs)."""
    with rdmamw.listen(LISTEN_ADDRESS[provider](), slot_size=4096, rendezvous="read") as lst:
        p = subprocess.Popen([sys.executable, "-c", SENDER_DIES, lst.address],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "RDMAMW_SHM_CMA": "1"})
        ch = lst.accept(timeout=60)
        assert p.stdout.readline().strip() == "sent"
        addr = _desc_address(ch)
        vals = list(DESC.unpack(ctypes.string_at(addr, DESC.size)))
        vals[3] = (vals[3] + 1) & 0xFFFFFFFF            # key: one the sender never had
        ctypes.memmove(addr, DESC.pack(*vals), DESC.size)
        p.wait(30)
        buf = np.zeros(8 << 20, np.uint8)
        with pytest.raises(rdmamw.PeerLost):
            ch.recv_into(buf, timeout=10)
        assert not buf.any()
        ch.close()


def test_auto_asks_the_tuned_thresholds(monkeypatch):
    """The glue to rdmamw.memory: its lookup decides "auto"; without it, read."""
    import types

    from rdmamw import _rendezvous
    monkeypatch.setattr(_rendezvous, "_memory", lambda name: None)
    assert _rendezvous.resolve("auto", None, "shm") == ("read", None)
    assert _rendezvous.resolve("auto", 1000, "shm") == ("read", 1000)
    assert _rendezvous.resolve("write", None, "shm") == ("write", None)
    seen = []
    fake = types.SimpleNamespace(
        lookup=lambda p: seen.append(p) or {"strategy": "write", "threshold": 12345},
        allocate=lambda n: bytearray(n))
    monkeypatch.setattr(_rendezvous, "_memory", lambda name: fake)
    assert _rendezvous.resolve("auto", None, "tcp") == ("write", 12345) and seen == ["tcp"]
    assert _rendezvous.resolve("auto", 7, "tcp") == ("write", 7)       # the option wins
    assert type(_rendezvous.allocate(10)) is bytearray                  # the pool's buffer
    fake.lookup = lambda p: {"strategy": "off", "threshold": -1}
    assert _rendezvous.resolve("auto", None, "tcp") == ("off", None)
