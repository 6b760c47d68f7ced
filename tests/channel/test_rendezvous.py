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
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import rdmamw
from tests.support import hooks
from tests.support.helpers import LISTEN_ADDRESS, make_pair

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    verbs: the send and receive threads expose memory at once, tests/providers/test_verbs.py)."""
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


def _desc_addresses(ch, n: int = 1) -> list[int]:
    """Addresses of the ``n`` descriptors in the (only) pending rendezvous slot."""
    deadline = time.monotonic() + 10
    while not ch.diagnostics()["pending"] and time.monotonic() < deadline:
        time.sleep(0.001)           # tcp: the peer's frames land asynchronously
    (slot,) = ch.diagnostics()["pending"]
    addr = hooks.slot_address(ch, slot) + 64          # payload: PACKED records
    out = []
    for _ in range(n):
        length, flags = struct.unpack("<II", ctypes.string_at(addr, 8))
        assert (length, flags) == (DESC.size, 1)
        out.append(addr + 8)
        addr += 8 + DESC.size
    return out


def _desc_address(ch) -> int:
    """Address of the descriptor of the (only) pending rendezvous slot."""
    return _desc_addresses(ch)[0]


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


NAMES = ("addr", "length", "index", "key", "kind", "entry")
#: the fuzzed message, a message consumed before it (its key is stale: its exposure
#: was removed), another one still exposed; the destination sits between the sizes
OWN, STALE, OTHER, VIEW = 1000, 600, 3000, 2000
GUARD = 4096


def expected_outcome(v: dict, real: dict, live: dict, max_msg: int):
    """What receiving descriptor ``v`` must do, in the receiver's order of checks: an
    exception class, or the bytes it reads. ``live``: key -> (address, bytes) of what
    the sender exposes now."""
    if v["kind"] not in (1, 2):
        return rdmamw.ProtocolError
    if v["index"] != real["index"] or v["entry"] != v["index"] % 64:
        return rdmamw.ProtocolError
    if v["length"] == 0 or v["length"] > 0xFFFFFFFF:
        return rdmamw.ProtocolError
    if v["length"] > max_msg:
        return rdmamw.MessageTooLarge
    if v["kind"] == 2:              # written into a destination this side never advertised
        return rdmamw.ProtocolError
    if v["length"] > VIEW:
        return rdmamw.BufferTooSmall
    if v["key"] not in live:
        return rdmamw.ProtocolError
    base, data = live[v["key"]]
    off = v["addr"] - base
    if off < 0 or off + v["length"] > len(data):
        return rdmamw.ProtocolError
    return data[off:off + v["length"]]


def receive_fuzzed(make) -> None:
    """Expose three sources on the sender (one consumed: a stale key), let ``make``
    rewrite the pending descriptor of OWN (``make(real, exposures, max_message_size)``
    returns the fields; exposures: name -> (key, address, bytes)), and check that the
    receiver does exactly what :func:`expected_outcome` says: the refusal it names,
    nothing written anywhere on a refusal, the message still there after
    BufferTooSmall, the next one after MessageTooLarge, a broken channel after a
    ProtocolError."""
    a, b, lst = make_pair(slots=2, slot_size=256, rendezvous="read")
    try:
        srcs = {k: _pattern(n, seed) for seed, (k, n) in
                enumerate({"stale": STALE, "own": OWN, "other": OTHER}.items())}
        h = a.send(srcs["stale"])
        stale = DESC.unpack(ctypes.string_at(_desc_address(b), DESC.size))
        assert bytes(b.recv(timeout=5)) == srcs["stale"].tobytes()
        h.wait(timeout=5)           # the sender has taken its exposure down
        a.send_batch([srcs["own"], srcs["other"]])
        own_at, other_at = _desc_addresses(b, 2)
        real = dict(zip(NAMES, DESC.unpack(ctypes.string_at(own_at, DESC.size)), strict=True))
        other = dict(zip(NAMES, DESC.unpack(ctypes.string_at(other_at, DESC.size)),
                         strict=True))
        exposures = {"own": (real["key"], real["addr"], srcs["own"].tobytes()),
                     "other": (other["key"], other["addr"], srcs["other"].tobytes()),
                     "stale": (stale[3], stale[0], srcs["stale"].tobytes())}
        vals = make(real, exposures, b.max_message_size)
        vals["key"] &= 0xFFFFFFFF
        vals["entry"] &= 0xFFFF
        vals["kind"] &= 0xFFFF
        vals = {k: vals[k] % (1 << 64) for k in NAMES}
        ctypes.memmove(own_at, DESC.pack(*vals.values()), DESC.size)
        live = {key: (addr, data) for name, (key, addr, data) in exposures.items()
                if name != "stale"}
        want = expected_outcome(vals, real, live, b.max_message_size)
        mem = bytearray(b"\xa5" * (2 * GUARD + VIEW))
        view = memoryview(mem)[GUARD:GUARD + VIEW]
        if isinstance(want, bytes):
            assert b.recv_into(view, timeout=5) == len(want), vals
            assert bytes(view[:len(want)]) == want
            mem[GUARD:GUARD + len(want)] = b"\xa5" * len(want)
        else:
            with pytest.raises(want) as e:
                b.recv_into(view, timeout=5)
            assert type(e.value) is want, (vals, e.value)
        del view
        assert mem == b"\xa5" * len(mem), "written outside what was read"
        if want is rdmamw.BufferTooSmall:    # kept: received whole into a bigger buffer
            assert e.value.needed == vals["length"]
        elif want is rdmamw.MessageTooLarge:    # refused unread; the next one follows
            assert bytes(b.recv(timeout=5)) == srcs["other"].tobytes()
        elif want is rdmamw.ProtocolError:
            with pytest.raises(rdmamw.ProtocolError):   # a failed channel stays failed
                b.recv(timeout=0)
    finally:        # the broken receiver first: the sender's close stops waiting for it
        b.close(), a.close(), lst.close()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(min_size=DESC.size, max_size=DESC.size),
       keep=st.sets(st.sampled_from(NAMES)))
def test_fuzz_descriptor_decoder(raw, keep):
    """Any field may be anything: each descriptor gets exactly the outcome the checks
    name (a typed refusal, or the right bytes), never a write outside the destination."""
    fuzz = dict(zip(NAMES, DESC.unpack(raw), strict=True))
    receive_fuzzed(lambda real, _ex, _max: {k: real[k] if k in keep else fuzz[k] for k in NAMES})


KEYS = ("own", "own", "own", "other", "stale", "own+1", "own-1", "own+gen", "high", "zero")


@st.composite
def edge_reads(draw) -> tuple:
    """A READ whose key, start and end sit at or one off the limits of an exposure
    (own, another live one, a stale one) or of the destination and the size limits."""
    key = draw(st.sampled_from(KEYS))
    base = draw(st.sampled_from(["key", "key", "own", "other", "stale"]))
    edge = draw(st.sampled_from(["start", "end", "end", "size"]))
    if edge == "start":             # off at -1 / 0 / +1, any length from there
        off = draw(st.sampled_from([-1, 0, 1]))
        length = ("fit", draw(st.sampled_from([-1, 0, 1, -7])))
    elif edge == "end":             # the read ends one short of / at / one past the end
        off = draw(st.one_of(st.sampled_from([0, 0, 1, -1, 64]), st.integers(-8, 4096)))
        length = ("fit", draw(st.sampled_from([-1, 0, 1])))
    else:                           # the destination's, the wire's and max_message's limits
        off = draw(st.sampled_from([0, 0, 1]))
        length = ("abs", draw(st.sampled_from([1, VIEW - 1, VIEW, VIEW + 1, 0, 0xFFFFFFFF,
                                               1 << 32, "max", "max+1"])))
    return key, base, off, length


def _edge_fields(case: tuple, real: dict, ex: dict, max_msg: int) -> dict:
    key, base, off, (how, n) = case
    n = {"max": max_msg, "max+1": max_msg + 1}.get(n, n)
    name = key if key in ex else "own"
    k = {"own+1": real["key"] + 1, "own-1": real["key"] - 1, "own+gen": real["key"] + 0x100,
         "high": real["key"] | 0x10000, "zero": 0}.get(key, ex[name][0])
    target = ex[name if base == "key" else base]
    length = len(target[2]) - off + n if how == "fit" else n
    return {**real, "key": k, "addr": target[1] + off, "length": length}


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=edge_reads())
@example(case=("own", "key", 0, ("fit", 1)))        # one byte past the end
@example(case=("own", "key", -1, ("fit", 0)))       # one byte before the start
@example(case=("own", "key", 0, ("fit", 0)))        # exactly the exposure
@example(case=("own", "key", 1, ("fit", 0)))        # from the second byte to the end
@example(case=("own", "key", 1, ("fit", 1)))        # from the second byte to one past it
@example(case=("other", "own", 0, ("fit", 0)))      # another exposure's key
@example(case=("stale", "key", 0, ("fit", 0)))      # a key taken down
@example(case=("other", "key", 1000, ("fit", 0)))   # the other exposure, to its end
def test_fuzz_descriptor_bounds(case):
    """Reads at the edges: accepted up to the last exposed byte, refused one past it,
    under any key but the one of the exposure read (live, stale or never made). Few
    drawn cases besides the named ones: each READ refused by the bounds check costs
    the receiver DYING_NS (1 s) looking for the sender's death first. The same check
    gets many cases in test_shm_assist.py's job fuzz."""
    receive_fuzzed(lambda real, ex, max_msg: _edge_fields(case, real, ex, max_msg))


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
    """The glue to rdmamw.memory: its lookup decides "auto"; an option wins over it."""
    from rdmamw.channel import rendezvous as _rendezvous
    from rdmamw.memory import pool, thresholds
    from rdmamw.providers import provider
    seen = []
    monkeypatch.setattr(thresholds, "lookup",
                        lambda p, default=None: seen.append((p, default)) or {})
    assert _rendezvous.resolve("auto", None, "shm") == ("read", None)
    assert _rendezvous.resolve("auto", 1000, "shm") == ("read", 1000)
    assert _rendezvous.resolve("write", None, "shm") == ("write", None)
    shm = provider("shm").rendezvous_default        # the provider's untuned choice
    assert seen == [("shm", shm), ("shm", shm)]
    monkeypatch.setattr(thresholds, "lookup", lambda p, default=None: seen.append(
        (p, default)) or {"strategy": "write", "threshold": 12345})
    assert _rendezvous.resolve("auto", None, "tcp") == ("write", 12345)
    assert seen[-1] == ("tcp", provider("tcp").rendezvous_default)
    assert _rendezvous.resolve("auto", 7, "tcp") == ("write", 7)       # the option wins
    monkeypatch.setattr(pool, "allocate", lambda n: bytearray(n))
    assert type(_rendezvous.allocate(10)) is bytearray                  # the pool's buffer
    monkeypatch.setattr(thresholds, "lookup",
                        lambda p, default=None: {"strategy": "off", "threshold": -1})
    assert _rendezvous.resolve("auto", None, "tcp") == ("off", None)
