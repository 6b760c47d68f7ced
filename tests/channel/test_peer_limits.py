"""What a hostile peer may make us do: allocate no more than the settings allow (hello
caps, RDMAMW_MAX_MESSAGE_SIZE), and hold no wait past its deadline or on a spinning
core (a tcp READ nobody answers, a sequence gap)."""

from __future__ import annotations

import contextlib
import ctypes
import socket
import struct
import threading
import time
import tracemalloc

import msgpack
import numpy as np
import pytest

import rdmamw
from rdmamw.channel import channel as channel_mod
from rdmamw.channel import rendezvous as _rendezvous
from rdmamw.errors import ConfigError
from rdmamw.providers.tcp import provider as tcp
from rdmamw.transport import layout
from rdmamw.transport import wire as _wire
from tests.support import hooks
from tests.support.helpers import make_pair, unique_name
from tests.support.tcp_util import HEARTBEAT, PUBLISH, READ_RESP, WRITE, frame, raw_peer

SLOT = 4096
BIG = 3 * SLOT + 123
DESC = struct.Struct("<QQQIHH")     # addr, length, index, key, kind, entry
HDR = struct.Struct("<QIHHII")      # seq, used, count, flags, check, reserved
HUGE_RINGS = [(1 << 20, 65536), (16, 1 << 30), (1 << 20, 8192)]


def _accept_in_thread(lst, timeout=10.0):
    got: dict = {"errors": []}

    def run():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and "ch" not in got:
            try:
                got["ch"] = lst.accept(timeout=max(0.01, deadline - time.monotonic()))
            except rdmamw.ProtocolError as e:  # a refused peer: go on accepting
                got["errors"].append(e)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                got["err"] = e
                return

    t = threading.Thread(target=run)
    t.start()
    return t, got


def _still_serves(lst, t, got) -> None:
    """A proper peer still gets through the listener that refused the hostile one."""
    a = rdmamw.Channel.open(lst.address, timeout=5, slots=16, slot_size=SLOT)
    t.join(10)
    assert "err" not in got, got.get("err")
    b = got["ch"]
    a.send(b"fine")
    assert bytes(b.recv(timeout=5)) == b"fine"
    a.close(), b.close()


# ---- hello caps ---------------------------------------------------------------------

@pytest.mark.parametrize("slots,slot_size", HUGE_RINGS)
def test_hello_decoders_refuse_a_ring_above_the_cap(slots, slot_size):
    hello = {"v": 1, "slots": slots, "slot_size": slot_size, "mode": "batched"}
    with pytest.raises(rdmamw.ProtocolError, match="RDMAMW_MAX_PEER_RING"):
        _wire.check_hello(hello, 1, None)
    with pytest.raises(rdmamw.ProtocolError, match="RDMAMW_MAX_PEER_RING"):
        tcp.parse_hello(hello, accepting=True)


def test_default_cap_fits_the_default_and_ps_rings_with_margin():
    for slots, slot_size in [(128, 65536), (16, 1 << 20), (3, 64 << 20)]:
        hello = {"v": 1, "slots": slots, "slot_size": slot_size, "mode": "ack"}
        assert _wire.check_hello(hello, 1, None) == (slots, slot_size, "ack")
        assert tcp.parse_hello(hello, accepting=True)["slots"] == slots


def test_peer_ring_cap_setting(monkeypatch):
    hello = {"v": 1, "slots": 16, "slot_size": 1 << 20, "mode": "ack"}
    monkeypatch.setenv("RDMAMW_MAX_PEER_RING", "8M")
    with pytest.raises(rdmamw.ProtocolError, match="RDMAMW_MAX_PEER_RING"):
        tcp.parse_hello(hello, accepting=True)
    monkeypatch.setenv("RDMAMW_MAX_PEER_RING", "1G")
    assert tcp.parse_hello(hello, accepting=True)["slot_size"] == 1 << 20
    monkeypatch.setenv("RDMAMW_MAX_PEER_RING", "lots")
    with pytest.raises(ConfigError, match="RDMAMW_MAX_PEER_RING"):
        layout.max_peer_ring()


@pytest.mark.parametrize("slots,slot_size", HUGE_RINGS[:2])
def test_tcp_hello_with_a_huge_ring_is_refused_and_the_listener_goes_on(slots, slot_size):
    with rdmamw.listen("tcp://127.0.0.1:0", slots=16, slot_size=SLOT) as lst:
        t, got = _accept_in_thread(lst)
        s = raw_peer(lst.address, slots=slots, slot_size=slot_size)
        s.settimeout(5)
        assert s.recv(1) == b""             # refused: the listener hung up
        s.close()
        _still_serves(lst, t, got)


@pytest.mark.parametrize("slots,slot_size", HUGE_RINGS[:2])
def test_shm_hello_with_a_huge_ring_is_refused_and_the_listener_goes_on(slots, slot_size):
    name = unique_name()
    with rdmamw.listen(f"shm://{name}", slots=16, slot_size=SLOT) as lst:
        t, got = _accept_in_thread(lst)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(b"\0rdmamw-shm/" + name.encode())
        hello = msgpack.packb({"v": 1, "slots": slots, "slot_size": slot_size,
                               "mode": "batched", "pid": 1})
        s.sendall(struct.pack("<I", len(hello)) + hello)
        s.settimeout(5)
        try:
            while s.recv(4096):             # its hello, then EOF: refused
                pass
        except ConnectionResetError:
            pass
        s.close()
        _still_serves(lst, t, got)


# ---- the maximum message size -----------------------------------------------------

@pytest.mark.parametrize("text,value", [("64K", 65536), ("1G", 1 << 30), ("1048576", 1 << 20),
                                        ("4G", 0xFFFFFFFF)])
def test_max_message_size_setting(monkeypatch, text, value):
    monkeypatch.setenv("RDMAMW_MAX_MESSAGE_SIZE", text)
    assert channel_mod.message_limit() == value


def test_max_message_size_default_is_one_gib(monkeypatch):
    monkeypatch.delenv("RDMAMW_MAX_MESSAGE_SIZE", raising=False)
    assert channel_mod.message_limit() == 1 << 30


@pytest.mark.parametrize("bad", ["big", "-5", "0"])
def test_bad_max_message_size_is_config_error(monkeypatch, bad):
    monkeypatch.setenv("RDMAMW_MAX_MESSAGE_SIZE", bad)
    with pytest.raises(ConfigError, match="RDMAMW_MAX_MESSAGE_SIZE"):
        channel_mod.message_limit()
    with pytest.raises(ConfigError, match="max_message_size"):
        rdmamw.listen(f"shm://{unique_name()}", max_message_size=0)


def _desc_address(ch) -> int:
    deadline = time.monotonic() + 10
    while not ch.diagnostics()["pending"] and time.monotonic() < deadline:
        time.sleep(0.001)
    (slot,) = ch.diagnostics()["pending"]
    addr = hooks.slot_address(ch, slot) + 64
    assert struct.unpack("<II", ctypes.string_at(addr, 8)) == (DESC.size, 1)
    return addr + 8


@pytest.fixture
def alloc_spy(monkeypatch):
    sizes: list[int] = []
    real = _rendezvous.allocate

    def spy(n):
        sizes.append(n)
        return real(n)

    monkeypatch.setattr(_rendezvous, "allocate", spy)
    return sizes


@pytest.mark.parametrize("length,limit", [(0xFFFFFFFF, None), (BIG + 1, BIG)])
def test_oversized_descriptor_is_refused_once_and_the_channel_goes_on(
        provider, alloc_spy, length, limit):
    """A descriptor above max_message_size: MessageTooLarge once, naming both sizes,
    nothing allocated or read; the sender's handle completes; the next message comes."""
    kw = {} if limit is None else {"max_message_size": limit}
    a, b, lst = make_pair(slot_size=SLOT, provider=provider, rendezvous="read", **kw)
    try:
        src = np.full(BIG, 7, np.uint8)
        h = a.send(src)
        addr = _desc_address(b)
        vals = list(DESC.unpack(ctypes.string_at(addr, DESC.size)))
        vals[1] = length
        ctypes.memmove(addr, DESC.pack(*vals), DESC.size)
        tracemalloc.start()
        try:
            with pytest.raises(rdmamw.MessageTooLarge, match=f"{length}.*{limit or 1 << 30}"):
                b.recv(timeout=5)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert alloc_spy == [] and peak < 1 << 20
        h.wait(timeout=5)                   # the refusal completes the sender's handle
        a.send(b"next")
        assert bytes(b.recv(timeout=5)) == b"next"
        a.send(src)                         # and rendezvous goes on too
        assert bytes(b.recv(timeout=5)) == src.tobytes()
        assert alloc_spy == [BIG]
    finally:
        b.close(), a.close(), lst.close()


def test_oversized_message_into_a_posted_buffer_is_refused_and_the_buffer_returned(provider):
    a, b, lst = make_pair(slot_size=SLOT, provider=provider, rendezvous="read",
                          max_message_size=2 * BIG)
    try:
        posted = bytearray(4 * BIG)
        b.post_recv(posted)
        src = np.full(BIG, 9, np.uint8)
        a.send(src)
        addr = _desc_address(b)
        vals = list(DESC.unpack(ctypes.string_at(addr, DESC.size)))
        vals[1] = 3 * BIG
        ctypes.memmove(addr, DESC.pack(*vals), DESC.size)
        with pytest.raises(rdmamw.MessageTooLarge):
            b.recv(timeout=5)
        assert posted == bytearray(len(posted))   # nothing read into it
        a.send(src)                               # the next goes to a new destination
        assert bytes(b.recv(timeout=5)) == src.tobytes()
    finally:
        b.close(), a.close(), lst.close()


def test_sender_refuses_locally_above_the_peers_limit(provider):
    """The receiver announces its limit; the sender raises MessageTooLarge before
    sending anything, and the channel goes on."""
    a, b, lst = make_pair(slot_size=SLOT, provider=provider, rendezvous="read",
                          max_message_size=BIG)
    try:
        deadline = time.monotonic() + 5
        while a.peer_max_message_size == 0 and time.monotonic() < deadline:
            time.sleep(0.001)               # tcp: the announcement is a frame
        assert a.peer_max_message_size == BIG
        with pytest.raises(rdmamw.MessageTooLarge, match="max_message_size"):
            a.send_batch([b"small", np.zeros(BIG + 1, np.uint8)])
        a.send(np.ones(BIG, np.uint8))
        assert bytes(b.recv(timeout=5)) == np.ones(BIG, np.uint8).tobytes()
    finally:
        b.close(), a.close(), lst.close()


# ---- waits sleep and end at their deadline ---------------------------------------

def _cpu_and_wall(fn):
    c0, w0 = time.process_time(), time.monotonic()
    try:
        fn()
        err = None
    except rdmamw.RdmamwError as e:
        err = e
    return time.process_time() - c0, time.monotonic() - w0, err


STRIDE = 64 + SLOT


def _slot(slot: int, seq: int, body: bytes, flags: int) -> bytes:
    """The frames that put one slot into the receiver's ring and publish it (its
    arrival bit: first use of every slot here, so phase 1)."""
    hdr = HDR.pack(seq, len(body), 1, flags, ~seq & 0xFFFFFFFF, 0)
    return frame(WRITE, 3, slot * STRIDE, hdr + bytes(64 - HDR.size) + body)


def _publish(slots: list[int]) -> bytes:
    return frame(PUBLISH, 1, 0, struct.pack("<Q", sum(1 << i for i in slots)))


def _raw_channel(lst):
    """(accepted channel, socket of a hand-made tcp peer)."""
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(ch=lst.accept(timeout=10)))
    t.start()
    s = raw_peer(lst.address, slots=16, slot_size=SLOT)
    t.join()
    return got["ch"], s


def _heartbeats(s, stop: threading.Event) -> threading.Thread:
    """Keep the hand-made peer alive (and drain what the receiver sends) until stop."""
    def run():
        while not stop.wait(0.1):
            try:
                s.sendall(frame(HEARTBEAT))
                s.setblocking(False)
                try:
                    while s.recv(1 << 16):
                        pass
                except BlockingIOError:
                    pass
                s.setblocking(True)
            except OSError:
                return

    hb = threading.Thread(target=run, daemon=True)
    hb.start()
    return hb


READ_LEN = 100_000
PAYLOAD = bytes(range(256)) * (READ_LEN // 256) + bytes(READ_LEN % 256)
RNDV_RECORD = struct.pack("<II", DESC.size, 1) + DESC.pack(0x10000, READ_LEN, 0, 1, 1, 0)


@contextlib.contextmanager
def _silent_reader():
    """A tcp peer that sent one READ descriptor and heartbeats but answers no READ:
    yields (channel, socket, quiet); quiet() stops the heartbeats so the test may write
    frames itself. The heartbeats stop after 4 s anyway (the code before this fix
    waited for that)."""
    stop = threading.Event()
    with rdmamw.listen("tcp://127.0.0.1:0", slots=16, slot_size=SLOT) as lst:
        b, s = _raw_channel(lst)
        s.sendall(_slot(0, 0, RNDV_RECORD, 2) + _publish([0]))
        hb = _heartbeats(s, stop)
        killer = threading.Timer(4.0, stop.set)
        killer.start()

        def quiet():
            stop.set()
            hb.join()
            s.setblocking(True)

        try:
            yield b, s, quiet
        finally:
            killer.cancel()
            stop.set()
            s.close()               # first: b's close then need not wait for the peer
            b.close()


@pytest.mark.parametrize("first,then", [("recv", "recv"), ("recv", "recv_into"),
                                        ("recv_into", "recv"), ("recv_into", "recv_into")])
def test_tcp_rendezvous_read_obeys_the_timeout_and_sleeps(first, then):
    """A peer that heartbeats but never answers the READ: Timeout at the deadline,
    sleeping; the READ stays in flight and the next receive (of any kind) gets the
    message once the answer comes."""
    with _silent_reader() as (b, s, quiet):
        bufs = [bytearray(READ_LEN + 10), bytearray(READ_LEN)]
        call = {"recv": lambda buf: b.recv(timeout=0.5),
                "recv_into": lambda buf: b.recv_into(buf, timeout=0.5)}
        cpu, wall, err = _cpu_and_wall(lambda: call[first](bufs[0]))
        assert isinstance(err, rdmamw.Timeout), err
        assert wall < 1.5, wall
        assert cpu < 0.3 * wall, (cpu, wall)
        quiet()
        s.sendall(frame(READ_RESP, 0, 0, PAYLOAD))
        if then == "recv":
            assert bytes(b.recv(timeout=5)) == PAYLOAD
        else:
            assert b.recv_into(bufs[1], timeout=5) == READ_LEN
            assert bytes(bufs[1]) == PAYLOAD
        s.sendall(_slot(1, 1, b"after", 1) + _publish([0, 1]))
        assert bytes(b.recv(timeout=5)) == b"after"


def test_descriptor_rewritten_while_its_read_is_in_flight_is_protocol_error():
    with _silent_reader() as (b, s, quiet):
        with pytest.raises(rdmamw.Timeout):
            b.recv(timeout=0.3)
        quiet()                 # the peer makes the descriptor 10x longer, then answers
        bigger = struct.pack("<II", DESC.size, 1) + DESC.pack(0x10000, 10 * READ_LEN,
                                                              0, 1, 1, 0)
        s.sendall(_slot(0, 0, bigger, 2) + frame(READ_RESP, 0, 0, PAYLOAD))
        time.sleep(0.2)
        with pytest.raises(rdmamw.ProtocolError, match="rewrote"):
            b.recv(timeout=5)


def test_sequence_gap_that_closes_is_delivered_at_once():
    """Slot 1 arrives, slot 0 only 0.3 s later: the receiver sleeps meanwhile and
    delivers both as soon as the gap closes."""
    with rdmamw.listen("tcp://127.0.0.1:0", slots=16, slot_size=SLOT) as lst:
        b, s = _raw_channel(lst)
        try:
            s.sendall(_slot(1, 1, b"two", 1) + _publish([1]))
            later = threading.Timer(0.3, lambda: s.sendall(_slot(0, 0, b"one", 1)
                                                           + _publish([0, 1])))
            later.start()
            got = []
            cpu, wall, err = _cpu_and_wall(
                lambda: got.extend(bytes(m) for m in b.recv_batch(timeout=3)))
            later.join()
            assert err is None and got == [b"one", b"two"]
            assert wall < 1.0, wall         # at once: not after a gap timeout
            assert cpu < 0.5 * wall, (cpu, wall)
        finally:
            s.close()               # first: b's close then need not wait for the peer
            b.close()


def test_sequence_gap_sleeps_instead_of_spinning():
    a, b, lst = make_pair(slots=4, slot_size=256)
    try:
        a.send(b"one")
        (slot,) = b.diagnostics()["pending"]
        addr = hooks.slot_address(b, slot)
        hdr = list(HDR.unpack(ctypes.string_at(addr, HDR.size)))
        hdr[0], hdr[4] = 1, ~1 & 0xFFFFFFFF     # in the window, but seq 0 never comes
        ctypes.memmove(addr, HDR.pack(*hdr), HDR.size)
        cpu, wall, err = _cpu_and_wall(lambda: b.recv_batch(timeout=1.0))
        assert isinstance(err, rdmamw.Timeout), err
        assert 0.9 < wall < 1.6, wall
        assert cpu < 0.3 * wall, (cpu, wall)
        with pytest.raises(rdmamw.ProtocolError, match="never arrived"):
            b.recv_batch(timeout=3)         # the gap still fails after gap_timeout
    finally:
        a.close(), b.close(), lst.close()
