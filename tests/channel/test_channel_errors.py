"""Bad input gets a clear, typed error and loses nothing."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import rdmamw
from rdmamw.errors import RdmamwError
from tests.support import hooks
from tests.support.helpers import make_pair, unique_name, within


def test_error_hierarchy():
    for cls in (rdmamw.PeerLost, rdmamw.ChannelClosed, rdmamw.Timeout, rdmamw.MessageTooLarge,
                rdmamw.ProtocolError, rdmamw.PeerNotFound, rdmamw.ProviderUnavailable):
        assert issubclass(cls, RdmamwError)
    assert issubclass(rdmamw.Timeout, TimeoutError)
    assert issubclass(rdmamw.PeerLost, ConnectionError)


def test_non_buffer_in_batch_sends_nothing(pair):
    a, b = pair
    with pytest.raises(TypeError, match="message 1"):
        a.send_batch([b"ok", object(), b"never"])
    with pytest.raises(TypeError):
        a.send_batch(b"bytes is one message, not a batch")
    with pytest.raises(TypeError):
        a.send_batch([np.arange(10)[::2]])          # not contiguous
    with pytest.raises(rdmamw.Timeout):
        b.recv(timeout=0.05)                        # nothing was sent
    a.send(b"still usable")
    assert bytes(b.recv(timeout=5)) == b"still usable"
    assert a.stats()["messages"] == 1


def test_message_too_large_sends_nothing(mode, provider):
    """With rendezvous off, the eager limit is the largest message."""
    a, b, lst = make_pair(mode, provider=provider, rendezvous="off")
    limit = a.eager_limit
    with pytest.raises(rdmamw.MessageTooLarge):
        a.send_batch([b"small", b"x" * (limit + 1)])
    with pytest.raises(ValueError):                 # MessageTooLarge is a ValueError too
        a.send(bytes(limit + 1))
    a.send_batch([b"y" * limit, b"z" * (limit - 8), b"w"])   # the edges fit
    got = []
    while len(got) < 3:
        got += [bytes(m) for m in b.recv_batch(timeout=5)]
    assert got == [b"y" * limit, b"z" * (limit - 8), b"w"]
    a.close(), b.close(), lst.close()


def test_open_missing_peer_fails_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(rdmamw.PeerNotFound):
        rdmamw.Channel.open(f"shm://{unique_name('nobody')}", timeout=0.3)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("address", ["shm:/x", "nope", "shm://", "", "udp://x"])
def test_bad_addresses(address):
    with pytest.raises(ValueError):
        rdmamw.Channel.open(address, timeout=0.1)


def test_planned_providers_say_so():
    with pytest.raises(rdmamw.ProviderUnavailable):
        rdmamw.Channel.open("verbs://127.0.0.1:1", timeout=0.1)


def test_bad_parameters():
    with pytest.raises(ValueError):
        rdmamw.Channel.open("shm://x", mode="fast", timeout=0.1)
    with pytest.raises(ValueError):
        rdmamw.listen(f"shm://{unique_name()}", slots=0)
    with pytest.raises(ValueError):
        rdmamw.listen(f"shm://{unique_name()}", slot_size=8)


def test_listen_twice_is_an_error():
    name = f"shm://{unique_name()}"
    with rdmamw.listen(name):
        with pytest.raises(RdmamwError, match="already"):
            rdmamw.listen(name)


def test_accept_timeout():
    with rdmamw.listen(f"shm://{unique_name()}") as lst:
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.05)


def test_send_times_out_on_full_ring_and_reports_what_went(provider):
    a, b, lst = make_pair(slots=2, slot_size=64, peer_slots=2, peer_slot_size=64,
                          provider=provider)
    with pytest.raises(rdmamw.Timeout) as ei:
        a.send_batch([b"q" * 60] * 5, timeout=0.2)  # 2 fit, nobody reads
    assert ei.value.sent == 2
    got = [bytes(m) for m in b.recv_batch(timeout=5)]
    got += [bytes(m) for m in b.recv_batch(timeout=5)]
    assert got == [b"q" * 60] * 2
    with pytest.raises(rdmamw.Timeout):
        b.recv(timeout=0.05)
    a.close(), b.close(), lst.close()


# ---- handshake: garbage from a local process ----------------------------------------

def _raw_connect(name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(b"\0rdmamw-shm/" + name.encode())
    return s


@pytest.mark.parametrize("frame", [
    struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1",                   # invalid msgpack
    struct.pack("<I", 1 << 30),                                         # absurd length
    struct.pack("<I", 2) + b"\x91\x01",                                 # not a map
    struct.pack("<I", 4) + b"\x81\xa1v\x07",                            # wrong version
    b"",                                                                # hang up
])
def test_accept_drops_garbage_handshake(frame, caplog):
    caplog.set_level(logging.WARNING, logger="rdmamw.shm")
    name = unique_name()
    with rdmamw.listen(f"shm://{name}") as lst:
        s = _raw_connect(name)
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.5)             # dropped, not handed to the caller
        s.close()
        # the listener still works for a proper peer
        got = {}
        t = threading.Thread(target=lambda: got.update(ch=lst.accept(timeout=5)))
        t.start()
        a = rdmamw.Channel.open(f"shm://{name}", timeout=5)
        t.join()
        a.send(b"fine")
        assert bytes(got["ch"].recv(timeout=5)) == b"fine"
        a.close(), got["ch"].close()
    head = (f"rdmamw: dropped connection from pid {os.getpid()} (uid {os.getuid()}) to "
            f"shm://{name}: ")
    assert [r.getMessage().startswith(head) for r in caplog.records] == [True]


def test_hostile_ring_parameters_rejected(caplog):
    caplog.set_level(logging.WARNING, logger="rdmamw.shm")
    name = unique_name()
    import msgpack
    with rdmamw.listen(f"shm://{name}") as lst:
        s = _raw_connect(name)
        hello = msgpack.packb({"v": 1, "slots": 1 << 40, "slot_size": 64, "mode": "ack"})
        s.sendall(struct.pack("<I", len(hello)) + hello)
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.5)
        s.close()
    assert len(caplog.records) == 1 and "peer ring" in caplog.records[0].getMessage()


# ---- corrupted slots in the ring --------------------------------------------------

HDR = struct.Struct("<QIHHII")   # seq, used, count, flags, check, reserved


def _poke(addr: int, data: bytes) -> None:
    ctypes.memmove(addr, data, len(data))


def _peek(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def _corrupt_header(ch, slot: int, **fields) -> None:
    addr = hooks.slot_address(ch, slot)
    seq, used, count, flags, check, res = HDR.unpack(_peek(addr, HDR.size))
    vals = dict(seq=seq, used=used, count=count, flags=flags, check=check, reserved=res)
    vals.update(fields)
    if "seq" in fields and "check" not in fields:
        vals["check"] = ~fields["seq"] & 0xFFFFFFFF
    _poke(addr, HDR.pack(vals["seq"], vals["used"], vals["count"], vals["flags"],
                         vals["check"], vals["reserved"]))


@pytest.mark.parametrize("fields, says", [
    (dict(seq=12345), "sequence number 12345"),              # out of the window
    (dict(seq=4), "sequence number 4 "),                     # one past it (4 slots from 0)
    (dict(seq=0, check=0), "sequence number 0 .check 0x0"),  # torn: check does not match
    (dict(used=1 << 20), "malformed header: used=1048576"),  # larger than the slot
    (dict(used=257), "malformed header: used=257"),          # one byte larger
    (dict(count=0), "malformed header: .* count=0 "),
    (dict(flags=7), "malformed header: .* flags=7"),
    (dict(count=5000), "malformed header: .* count=5000"),   # more records than bytes
    (dict(count=20), "malformed header: .* count=20 "),      # fewer bytes than 20 headers
])
@pytest.mark.parametrize("many", [False, True], ids=["recv_batch", "recv_many_into"])
def test_corrupted_header_is_protocol_error(fields, says, many):
    """Refused by the header check that names the field, not by a later accident; by
    recv_many_into as by recv_batch."""
    if many:
        buf, lens = bytearray(64), np.zeros(4, np.uint32)
        _refused_after_corrupting(lambda a: a.send_many(b"abcdefg", [3, 4]),
                                  lambda b, t: b.recv_many_into(buf, lens, timeout=t),
                                  fields, says)
    else:
        _refused_after_corrupting(lambda a: a.send_batch([b"abc", b"defg"]),
                                  lambda b, t: b.recv_batch(timeout=t), fields, says)


def _refused_after_corrupting(send, recv, fields, says) -> None:
    """``send`` one slot, corrupt its header's ``fields``: ``recv`` raises
    ProtocolError saying ``says``, and again after (the channel stays failed)."""
    a, b, lst = make_pair(slots=4, slot_size=256)
    send(a)
    (slot,) = b.diagnostics()["pending"]
    _corrupt_header(b, slot, **fields)
    with pytest.raises(rdmamw.ProtocolError, match=says):
        recv(b, 1)
    with pytest.raises(rdmamw.ProtocolError):       # the channel stays failed
        recv(b, 0)
    a.close(), b.close(), lst.close()


@pytest.mark.parametrize("fields, says", [
    (dict(seq=12345), "sequence number 12345"),
    (dict(seq=0, check=0), "sequence number 0 .check 0x0"),
    (dict(flags=7), "malformed header: .* flags=7"),
])
def test_corrupted_header_of_one_message_is_protocol_error_on_recv(fields, says):
    """recv()'s first look (one slot arrived, the next in sequence) checks the header
    as recv_batch's does."""
    _refused_after_corrupting(lambda a: a.send(b"abc"), lambda b, t: b.recv(timeout=t),
                              fields, says)


def test_duplicate_sequence_number_is_protocol_error():
    a, b, lst = make_pair(slots=4, slot_size=256)
    a.send(b"one")
    a.send(b"two")
    s0, s1 = b.diagnostics()["pending"]
    _corrupt_header(b, s1, seq=0)
    with pytest.raises(rdmamw.ProtocolError):
        b.recv_batch(timeout=1)
    a.close(), b.close(), lst.close()


@pytest.mark.parametrize("past", [10_000, 1])
def test_record_overrun_is_protocol_error_not_a_wrong_message(past):
    """The second record claims ``past`` bytes more than the slot's used bytes hold."""
    a, b, lst = make_pair(slots=4, slot_size=256)
    a.send_batch([b"abc", b"defg"])
    (slot,) = b.diagnostics()["pending"]
    used = HDR.unpack(_peek(hooks.slot_address(b, slot), HDR.size))[1]
    addr = hooks.slot_address(b, slot) + 64 + 8 + 8          # second record's length
    _poke(addr, struct.pack("<I", used - 16 - 8 + past))     # after 16 bytes + its header
    got = b.recv_batch(max_messages=1, timeout=1)            # the first record is fine
    assert bytes(got[0]) == b"abc"
    with pytest.raises(rdmamw.ProtocolError):
        b.recv_batch(timeout=1)
    a.close(), b.close(), lst.close()


@pytest.mark.parametrize("length, flags", [(8 + 1, 0), (5 + 10_000, 0), (5, 2), (5, 1)])
def test_bad_record_is_protocol_error_for_recv_many_into(length, flags):
    """A bad second record (its length past the used bytes, unknown flags, a
    descriptor of the wrong size): recv_many_into delivers the first record alone, then
    ProtocolError, never a message made of the bad record's bytes."""
    a, b, lst = make_pair(slots=4, slot_size=256)
    a.send_many(b"abcdefgh", [3, 5])
    (slot,) = b.diagnostics()["pending"]
    _poke(hooks.slot_address(b, slot) + 64 + 16, struct.pack("<II", length, flags))
    buf, lens = bytearray(64), np.zeros(4, np.uint64)
    assert b.recv_many_into(buf, lens, timeout=1) == 1
    assert lens[0] == 3 and bytes(buf[:3]) == b"abc"
    with pytest.raises(rdmamw.ProtocolError):
        b.recv_many_into(buf, lens, timeout=1)
    a.close(), b.close(), lst.close()


@pytest.mark.parametrize("length, flags", [(8 + 1, 0), (5 + 10_000, 0), (5, 2), (5, 1)])
@pytest.mark.parametrize("call", ["recv_batch", "recv"])
def test_bad_record_is_protocol_error_for_recv_batch_and_recv(length, flags, call):
    """The same bad second record under recv_batch / recv (whose look at a PACKED
    slot's next record is inline, not peek's): the first record alone, then
    ProtocolError, never a message made of the bad record's bytes."""
    a, b, lst = make_pair(slots=4, slot_size=256)
    a.send_batch([b"abc", b"defgh"])
    (slot,) = b.diagnostics()["pending"]
    _poke(hooks.slot_address(b, slot) + 64 + 16, struct.pack("<II", length, flags))
    take = (lambda: b.recv_batch(timeout=1)) if call == "recv_batch" else \
        (lambda: [b.recv(timeout=1)])
    assert [bytes(m) for m in b.recv_batch(max_messages=1, timeout=1)] == [b"abc"]
    with pytest.raises(rdmamw.ProtocolError, match="record"):
        take()
    with pytest.raises(rdmamw.ProtocolError):       # the channel stays failed
        take()
    a.close(), b.close(), lst.close()


def test_sequence_gap_that_never_closes_is_protocol_error():
    a, b, lst = make_pair(slots=4, slot_size=256)
    a.send(b"one")
    (slot,) = b.diagnostics()["pending"]
    _corrupt_header(b, slot, seq=1)        # in the window, but seq 0 never comes
    t0 = time.monotonic()
    with pytest.raises(rdmamw.ProtocolError, match="never arrived"):
        while True:
            b.recv_batch(timeout=5)
    assert time.monotonic() - t0 < 4.0
    a.close(), b.close(), lst.close()


# ---- errors that are not ours reach the user as RdmamwError (issue 13, item 9) -----

@pytest.fixture
def no_token(tmp_path, monkeypatch):
    """No RDMAMW_TOKEN, no installed token, and a home where no config dir can be made
    (a regular file: unwritable even for root)."""
    from rdmamw import auth
    home = tmp_path / "home"
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("RDMAMW_TOKEN", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setattr(auth, "_installed", None)


def test_no_token_anywhere_is_config_error_on_open_and_listen(no_token):
    from rdmamw.errors import ConfigError
    with pytest.raises(ConfigError, match="RDMAMW_TOKEN.*writable"):
        rdmamw.listen("tcp://127.0.0.1:0")          # not a listener that drops everyone
    with pytest.raises(ConfigError, match="RDMAMW_TOKEN.*writable"):
        rdmamw.Channel.open("tcp://127.0.0.1:9", timeout=1)


def test_no_token_listener_side_of_the_store(no_token, monkeypatch):
    """The listener side of every authenticated handshake (here the bare auth step a
    tcp listener and the bootstrap store run) says why, instead of an OSError."""
    from rdmamw import auth
    from rdmamw.errors import ConfigError
    a, b = socket.socketpair()
    with a, b, pytest.raises(ConfigError, match="RDMAMW_TOKEN"):
        auth.accept_side(a)


def _fake_shm_listener(name: str, info: bytes):
    """A listener that speaks the shm hello, then hands over valid descriptors with a
    malformed ``info`` frame."""
    from rdmamw.transport import wire as fr
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(b"\0rdmamw-shm/" + name.encode())
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            fr.recv_frame(conn)
            fr.send_frame(conn, {"v": 1, "slots": 16, "slot_size": 4096})
            socket.recv_fds(conn, 4096, 3)
            fds = [os.memfd_create("x"), os.eventfd(0), os.memfd_create("y")]
            os.ftruncate(fds[0], 1 << 20)
            socket.send_fds(conn, [info], fds)
            for fd in fds:
                os.close(fd)
            conn.recv(1)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.mark.parametrize("info", [b"\xc1", b"\x81\xa4size", b"\x01\x02", b"\x81\x01\x02"])
def test_malformed_shm_hello_is_protocol_error(info):
    name = unique_name("badhello")
    srv, t = _fake_shm_listener(name, info)
    with srv, pytest.raises(rdmamw.ProtocolError):
        rdmamw.Channel.open(f"shm://{name}", timeout=5, slots=16, slot_size=4096)
    t.join(5)


def _resetting_server(delay: float = 0.2) -> tuple[socket.socket, threading.Thread]:
    """A TCP server that accepts one connection and resets it (RST, not FIN)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        time.sleep(delay)                           # the other side waits for a hello
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def test_tcp_reset_during_handshake_is_peer_lost():
    """A listener that resets the connection mid-handshake: PeerLost, not a raw
    ConnectionResetError."""
    srv, t = _resetting_server()
    with srv, pytest.raises(rdmamw.PeerLost, match="retry"):
        rdmamw.Channel.open(f"tcp://127.0.0.1:{srv.getsockname()[1]}", timeout=5)
    t.join(5)


def test_init_with_a_resetting_rank_zero_is_peer_lost(monkeypatch):
    from rdmamw import bootstrap
    srv, t = _resetting_server()
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(srv.getsockname()[1]))
    monkeypatch.setattr(bootstrap, "_world", None)
    with srv, pytest.raises(rdmamw.PeerLost, match="rdmamw.init"):
        rdmamw.init(timeout=5)
    t.join(5)


def test_a_handle_wait_past_its_timeout_is_the_typed_timeout(provider):
    """Nobody receives a rendezvous message: its handle's wait(timeout) ends with
    rdmamw.Timeout (a TimeoutError), on time, and the channel still works after."""
    a, b, lst = make_pair(provider=provider)
    try:
        h = a.send_batch([b"r" * (1 << 20)], timeout=5)
        t0 = time.monotonic()
        with pytest.raises(rdmamw.Timeout):
            h.wait(timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < within(2.0)
        assert len(b.recv(timeout=10)) == 1 << 20
        h.wait(timeout=10)
    finally:
        a.close(), b.close(), lst.close()
