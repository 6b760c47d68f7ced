"""tcp-only behaviour: addresses, the token check, hostile frames, liveness, READ.
(The whole channel suite also runs on tcp through conftest.LISTEN_ADDRESS.)"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import threading
import time

import pytest

import rdmamw
from rdmamw import auth
from rdmamw.errors import ConfigError
from rdmamw.providers.tcp import provider as tcp
from tests.support import hooks
from tests.support.tcp_util import HEARTBEAT, PUBLISH, READ_REQ, READ_RESP, WRITE, frame, raw_peer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def accept_in_thread(lst, timeout=10):
    got: dict = {}

    def run():
        try:
            got["ch"] = lst.accept(timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got["err"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, got


def test_listener_reports_bound_port_and_port_in_use_is_clear():
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        port = int(lst.address.rsplit(":", 1)[1])
        assert port > 0 and lst.address == f"tcp://127.0.0.1:{port}"
        with pytest.raises(rdmamw.RdmamwError, match="already in use"):
            rdmamw.listen(lst.address)


def test_open_nobody_listening_is_peer_not_found():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(rdmamw.PeerNotFound):
        rdmamw.Channel.open(f"tcp://127.0.0.1:{port}", timeout=0.3)


@pytest.mark.parametrize("garbage", [
    b"", b"GET / HTTP/1.1\r\n\r\n", b"RDMW\x01" + b"\0" * 48, os.urandom(200),
])
def test_unauthenticated_or_garbled_peers_are_dropped_and_logged(garbage, caplog):
    caplog.set_level(logging.WARNING, logger="rdmamw.tcp")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        t, got = accept_in_thread(lst)
        host, port = tcp.parse(lst.address[6:])
        bad = socket.create_connection((host, port), timeout=5)
        try:
            bad.sendall(garbage)
            bad.shutdown(socket.SHUT_WR)
            while bad.recv(100):            # whatever it says first, it then hangs up
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass                            # ... or resets, perhaps before our shutdown
        except OSError as e:
            if e.errno != errno.ENOTCONN:   # (the reset came first: shutdown says so)
                raise
        bad.close()
        a = rdmamw.Channel.open(lst.address, timeout=5)      # the listener still works
        t.join()
        assert "err" not in got
        a.send(b"fine")
        assert bytes(got["ch"].recv(timeout=5)) == b"fine"
        a.close(), got["ch"].close()
    assert any("dropped connection" in r.getMessage() for r in caplog.records)


def test_wrong_token_never_reaches_a_channel(caplog):
    caplog.set_level(logging.WARNING, logger="rdmamw.tcp")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        t, got = accept_in_thread(lst, timeout=1.0)
        # refused: the listener hangs up without proving itself (a listener that took
        # the wrong proof would answer, and the opener would refuse its answer instead)
        with pytest.raises(rdmamw.ProtocolError, match="hung up during authentication"):
            raw_peer(lst.address, key=b"not the token")
        t.join()
        assert isinstance(got.get("err"), rdmamw.Timeout)
    assert any("prove the shared token" in r.getMessage() for r in caplog.records)


def test_opener_checks_the_listener_too():
    """A listener that does not know the token cannot pass itself off as the peer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def impostor():
        c, _ = srv.accept()
        c.sendall(auth.MAGIC + bytes([auth.VERSION]) + os.urandom(auth.NONCE))
        c.recv(auth.PROOF_BYTES)
        c.sendall(os.urandom(auth.MAC))          # cannot compute the right MAC
        c.close()

    t = threading.Thread(target=impostor)
    t.start()
    with pytest.raises(rdmamw.ProtocolError, match="listener failed to prove"):
        rdmamw.Channel.open(f"tcp://127.0.0.1:{srv.getsockname()[1]}", timeout=5)
    t.join()
    srv.close()


def assert_hung_up(s: socket.socket) -> None:
    """Read until the other side closes (TimeoutError if it does not within 5 s)."""
    s.settimeout(5)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass


def guarded_channel(lst):
    """(accepted channel, raw socket of the peer): the test speaks frames directly."""
    t, got = accept_in_thread(lst)
    s = raw_peer(lst.address)
    t.join()
    return got["ch"], s


@pytest.mark.parametrize("bad", [
    frame(WRITE, region=4, payload=b"x"),                          # no such region
    frame(WRITE, region=3, offset=1 << 40, payload=b"x"),          # far outside
    frame(WRITE, region=0, offset=4090, payload=b"12345678"),      # straddles the end
    frame(WRITE, region=0, offset=4089, payload=b"12345678"),      # ends one byte past it
    frame(WRITE, region=0, offset=4097, payload=b"x"),             # starts one byte past it
    frame(WRITE, region=1, offset=0, length=0xFFFFFFFF),           # huge length
    frame(PUBLISH, region=1, offset=4, payload=b"12345678"),       # unaligned words
    frame(PUBLISH, region=3, offset=0, payload=bytes(65536)),      # more than a publish holds
    frame(READ_RESP, payload=b"unasked"),                          # no READ outstanding
    frame(READ_REQ, region=0, offset=4090, length=8),              # a READ past the end
    frame(99),                                                     # unknown type
    frame(HEARTBEAT, region=1),                                    # junk in an empty frame
])
def test_malformed_frame_drops_the_connection(bad):
    with rdmamw.listen("tcp://127.0.0.1:0", slots=16, slot_size=4096) as lst:
        ch, s = guarded_channel(lst)
        s.sendall(frame(WRITE, region=3, offset=64, payload=b"ok"))   # a legal write
        s.sendall(bad)
        with pytest.raises(rdmamw.PeerLost, match="malformed frame"):   # not the silence
            ch.recv(timeout=5)                      # of a raw peer that sends no heartbeat
        assert_hung_up(s)                           # ...and it hung up on the peer
        s.close()
        ch.close()


def test_silent_peer_is_lost_after_the_peer_timeout(monkeypatch):
    monkeypatch.setenv("RDMAMW_TCP_PEER_TIMEOUT", "0.5")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        ch, s = guarded_channel(lst)       # s authenticates, then never says a word
        t0 = time.monotonic()
        with pytest.raises(rdmamw.PeerLost):
            ch.recv(timeout=10)
        assert time.monotonic() - t0 < 5.0      # generous: other jobs load this machine
        s.close()
        ch.close()


def test_idle_channel_survives_past_the_peer_timeout(monkeypatch):
    monkeypatch.setenv("RDMAMW_TCP_PEER_TIMEOUT", "0.5")
    monkeypatch.setenv("RDMAMW_TCP_HEARTBEAT", "0.05")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        t, got = accept_in_thread(lst)
        a = rdmamw.Channel.open(lst.address, timeout=5)
        t.join()
        b = got["ch"]
        with pytest.raises(rdmamw.Timeout):
            b.recv(timeout=1.5)              # heartbeats keep the idle peer alive
        a.send(b"still here")
        assert bytes(b.recv(timeout=5)) == b"still here"
        assert a.stats()["heartbeats_sent"] > 0
        a.close(), b.close()


def test_a_close_does_not_wait_out_the_responder_thread_s_sleep():
    """Closing a channel whose peer is alive joins its responder thread, which looks
    at the state every 100 ms unless woken; the close wakes it, so it costs the FIN
    exchange (about 1 ms here), not that sleep. Dask opens and closes comms freely on
    its event loop (docs/dask.md)."""
    took = []
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        for _ in range(7):
            t, got = accept_in_thread(lst)
            a = rdmamw.Channel.open(lst.address, timeout=5)
            t.join()
            b = got["ch"]
            a.send(b"x")
            assert bytes(b.recv(timeout=5)) == b"x"
            t0 = time.perf_counter()
            a.close()
            took.append(time.perf_counter() - t0)
            b.close()
    took.sort()
    assert took[3] < 0.05, took         # the median; 0.1 s each while it slept


def test_read_is_served_from_registered_regions_only():
    with rdmamw.listen("tcp://127.0.0.1:0", slots=4, slot_size=128) as lst:
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(c=lst._impl.accept(5)))
        t.start()
        a = tcp.connect(lst.address[6:], mode="batched", timeout=5, slots=4, slot_size=128)
        t.join()
        b = got["c"]
        ring = hooks.region_address(b.transport, 3)
        ctypes.memmove(ring + 100, b"remote bytes", 12)
        assert hooks.read_remote(a.transport, 3, 100, 12) == b"remote bytes"
        with pytest.raises(ValueError):
            hooks.read_remote(a.transport, 3, 1 << 30, 12)      # refused before anything is sent
        a.transport.close(), b.transport.close()


def test_token_file_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv("RDMAMW_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    auth.set_token(None)
    tok = auth.token()
    path = tmp_path / "rdmamw" / "token"
    assert path.read_bytes() == tok and (path.stat().st_mode & 0o077) == 0
    assert auth.token() == tok


def test_token_file_defaults_to_the_home_config(tmp_path, monkeypatch):
    monkeypatch.delenv("RDMAMW_TOKEN", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    auth.set_token(None)
    tok = auth.token()
    assert (tmp_path / ".config" / "rdmamw" / "token").read_bytes() == tok


def test_the_token_file_is_made_in_a_config_directory_that_exists(tmp_path, monkeypatch):
    """~/.config/rdmamw may be there before the token (the rendezvous tuning file)."""
    monkeypatch.delenv("RDMAMW_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "rdmamw").mkdir(mode=0o700)
    auth.set_token(None)
    tok = auth.token()
    assert (tmp_path / "rdmamw" / "token").read_bytes() == tok and len(tok) == 64


def test_an_empty_token_file_is_a_config_error_that_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("RDMAMW_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "rdmamw").mkdir()
    (tmp_path / "rdmamw" / "token").write_bytes(b"")     # its creator never wrote it
    auth.set_token(None)
    with pytest.raises(ConfigError, match=r"cannot be used \(the file is empty\)"):
        auth.token()


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        lst = rdmamw.listen("tcp://[::1]:0")
    except OSError as e:
        pytest.skip(f"no IPv6 loopback: {e}")
    with lst:
        assert lst.address.startswith("tcp://[::1]:")
        t, got = accept_in_thread(lst)
        a = rdmamw.Channel.open(lst.address, timeout=5)
        t.join()
        a.send(b"v6")
        assert bytes(got["ch"].recv(timeout=5)) == b"v6"
        a.close(), got["ch"].close()
