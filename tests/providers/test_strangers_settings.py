"""The listener's limits on unproven connections are settings (issue 29, left item 1):
``RDMAMW_PROOF_TIMEOUT``, ``RDMAMW_UNPROVEN_PER_SOURCE``, ``RDMAMW_UNPROVEN_GRACE`` and
``RDMAMW_UNPROVEN_MAX`` (rdmamw/config.py, read by rdmamw/listener.py when
a listener is made). Each test here sets one of them away from its default and checks
a behaviour the default would not give; bad values are ConfigErrors naming the
variable."""

from __future__ import annotations

import logging
import socket
import time

import pytest

import rdmamw
from rdmamw import auth
from rdmamw.errors import ConfigError
from tests.providers.test_listener_dos import open_and_accept, raw_client
from tests.providers.test_strangers import strangers


def _serving(lst) -> int:
    """Start ``lst``'s accept loop; its port."""
    with pytest.raises(rdmamw.Timeout):
        lst.accept(timeout=0.05)
    return int(lst.address.rpartition(":")[2])


def held(socks: list[socket.socket], settle: float = 0.3) -> int:
    """How many of ``socks`` the listener still holds open (it sent each the challenge
    on accept; a dropped one then reads as closed)."""
    time.sleep(settle)
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            while True:
                got = s.recv(4096)
                if not got:
                    break               # dropped
        except BlockingIOError:
            n += 1                      # nothing more to read: still open
        except OSError:
            pass                        # reset: dropped
    return n


def _close(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def test_proof_timeout_is_a_setting(monkeypatch):
    """RDMAMW_PROOF_TIMEOUT=0.3: a stranger that never proves is cut after about
    0.3 s (the default would hold it 3 s)."""
    monkeypatch.setenv("RDMAMW_PROOF_TIMEOUT", "300ms")
    monkeypatch.setenv("RDMAMW_HANDSHAKE_TIMEOUT", "30")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        _serving(lst)
        s = raw_client(lst.address)
        s.settimeout(10)
        t0 = time.monotonic()
        assert len(s.recv(64)) == auth.HELLO_BYTES
        assert s.recv(64) == b""
        took = time.monotonic() - t0
        s.close()
    assert 0.2 <= took < 1.5, f"cut after {took:.2f} s"


def test_proof_timeout_is_capped_by_the_handshake_deadline(monkeypatch):
    monkeypatch.setenv("RDMAMW_PROOF_TIMEOUT", "60")
    monkeypatch.setenv("RDMAMW_HANDSHAKE_TIMEOUT", "0.4")
    from rdmamw import listener as _listener
    assert _listener.proof_timeout() == 0.4


def test_unproven_grace_is_a_setting(monkeypatch):
    """RDMAMW_UNPROVEN_GRACE=0: the per-source cap holds at once, so of 20 strangers
    opened in a burst 8 stay (with the default 1 s grace all 20 would)."""
    monkeypatch.setenv("RDMAMW_UNPROVEN_GRACE", "0")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        idle = strangers(_serving(lst), 20)
        try:
            assert held(idle) == 8
        finally:
            _close(idle)


@pytest.mark.parametrize("env, kept", [
    ({"RDMAMW_UNPROVEN_GRACE": "0", "RDMAMW_UNPROVEN_PER_SOURCE": "3"}, 3),
    ({"RDMAMW_UNPROVEN_MAX": "5"}, 5),
], ids=["per_source", "max"])
def test_unproven_caps_are_settings(env, kept, monkeypatch):
    """RDMAMW_UNPROVEN_PER_SOURCE=3 (no grace): 3 of 20 strangers from one address
    stay (the default: 8). RDMAMW_UNPROVEN_MAX=5: of 20 young strangers (held whole
    per address by the grace) 5 stay in all (the default 256 would hold all 20). A
    token holder still gets in at once."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        idle = strangers(_serving(lst), 20)
        try:
            assert held(idle) == kept
            took, a, b = open_and_accept(lst, timeout=5)
            assert took <= 1.0
            a.close(), b.close()
        finally:
            _close(idle)


@pytest.mark.parametrize("name, text", [
    ("RDMAMW_PROOF_TIMEOUT", "0"), ("RDMAMW_PROOF_TIMEOUT", "-1"),
    ("RDMAMW_PROOF_TIMEOUT", "soon"), ("RDMAMW_PROOF_TIMEOUT", "1e18"),
    ("RDMAMW_UNPROVEN_PER_SOURCE", "0"), ("RDMAMW_UNPROVEN_PER_SOURCE", "2.5"),
    ("RDMAMW_UNPROVEN_PER_SOURCE", str((1 << 16) + 1)),
    ("RDMAMW_UNPROVEN_GRACE", "-0.5"), ("RDMAMW_UNPROVEN_GRACE", "x"),
    ("RDMAMW_UNPROVEN_MAX", "0"), ("RDMAMW_UNPROVEN_MAX", "many"),
    ("RDMAMW_UNPROVEN_MAX", "1000000000"),
])
def test_bad_values_are_config_errors_when_a_listener_is_made(name, text, monkeypatch):
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError, match=name):
        rdmamw.listen("tcp://127.0.0.1:0").close()


def test_a_flood_of_strangers_is_logged_in_a_bounded_number_of_lines(caplog):
    """100 connections that hang up at once: the first DROPS_LOGGED are logged one by
    one, the other 80 in one line that counts them (a line per connection would let
    any stranger fill the job's log); a token holder still gets in."""
    from rdmamw import listener as _listener

    caplog.set_level(logging.WARNING, logger="rdmamw.tcp")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        port = _serving(lst)
        for _ in range(100):
            socket.create_connection(("127.0.0.1", port)).close()
        deadline = time.monotonic() + 10
        while lst._impl._drops[1] < 100:
            assert time.monotonic() < deadline, lst._impl._drops
            time.sleep(0.05)
        took, a, b = open_and_accept(lst, timeout=5)
        a.close(), b.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "rdmamw.tcp"]
    assert len(lines) == _listener.DROPS_LOGGED + 1, lines
    assert "dropped 80 more connections" in lines[-1], lines[-1]
