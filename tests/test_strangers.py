"""An unauthenticated connection costs almost nothing and never delays an authenticated
one (issue 29, finding 1): every listener that proves the token (tcp, verbs, the
bootstrap store; rdmamw/providers/_listener.py) sends its challenge first, gives the
proof a short deadline, holds a bounded number of unproven connections per source
(the oldest is dropped for a newcomer) and runs no thread for them, so 150 idle
strangers keep no token holder out."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

import rdmamw
from rdmamw import auth
from rdmamw.bootstrap import store
from rdmamw.providers import _listener
from tests.test_listener_dos import open_and_accept, raw_client

STRANGERS = 150


def strangers(port: int, n: int = STRANGERS) -> list[socket.socket]:
    """``n`` connections to 127.0.0.1:``port`` that say nothing and stay open."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        s.connect(("127.0.0.1", port))
        out.append(s)
    return out


def test_150_idle_strangers_do_not_delay_a_channel_peer():
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.05)                 # serving
        idle = strangers(int(lst.address.rpartition(":")[2]))
        try:
            took, a, b = open_and_accept(lst, timeout=3)
            assert took <= 1.0, f"a token holder waited {took:.2f} s behind {STRANGERS} strangers"
            a.send(b"in")
            assert bytes(b.recv(timeout=5)) == b"in"
            a.close(), b.close()
        finally:
            for s in idle:
                s.close()


def test_strangers_cost_no_thread_and_are_capped_per_source():
    """150 idle strangers: no handshake thread for any of them, and the listener keeps
    at most UNPROVEN_PER_SOURCE of them open (the rest are hung up on)."""
    base = threading.active_count()
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.05)
        idle = strangers(int(lst.address.rpartition(":")[2]))
        try:
            time.sleep(0.5)
            assert threading.active_count() <= base + 1, \
                f"{threading.active_count() - base - 1} threads for {STRANGERS} strangers"
            kept = 0
            for s in idle:
                s.settimeout(0.5)
                try:
                    s.recv(64)                   # the challenge, if it was accepted
                    s.settimeout(0.01)
                    kept += s.recv(64) != b""    # then b"" once it was dropped
                except TimeoutError:
                    kept += 1                    # still held open by the listener
                except OSError:
                    pass
            assert kept <= getattr(_listener, "UNPROVEN_PER_SOURCE", 16), kept
        finally:
            for s in idle:
                s.close()


def test_the_token_proof_has_a_deadline_shorter_than_the_handshake(monkeypatch, caplog):
    """A stranger that takes the challenge and never answers is cut at the proof
    deadline, long before RDMAMW_HANDSHAKE_TIMEOUT."""
    monkeypatch.setenv("RDMAMW_HANDSHAKE_TIMEOUT", "30")
    caplog.set_level(logging.WARNING, logger="rdmamw.tcp")
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.05)
        s = raw_client(lst.address)
        s.settimeout(10)
        t0 = time.monotonic()
        assert len(s.recv(64)) == auth.HELLO_BYTES        # the challenge comes first
        assert s.recv(64) == b""                          # ... then the hang-up
        took = time.monotonic() - t0
        s.close()
    assert took < 5, f"an unproven stranger was held {took:.1f} s"
    assert any("prove" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_150_idle_strangers_at_master_port_do_not_delay_8_ranks():
    """The bootstrap store of 8 ranks (the store and 7 joins in threads) with 150 idle
    strangers at its port: every rank joins, each within 1 s of starting."""
    sock = store.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    got: dict = {}

    def rank0():
        try:
            got[0] = store.serve(sock, 8, {"host": "h0"}, 20)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got[0] = e

    t0 = threading.Thread(target=rank0)
    t0.start()
    idle = strangers(port)
    took: dict[int, float] = {}

    def rank(r):
        start = time.monotonic()
        try:
            got[r] = store.join("127.0.0.1", port, r, None, lambda ip: {"host": f"h{r}"},
                                8, 20)
        except BaseException as e:  # noqa: BLE001
            got[r] = e
        took[r] = time.monotonic() - start

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(1, 8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        t0.join(30)
    finally:
        for s in idle:
            s.close()
    errors = {r: v for r, v in got.items() if isinstance(v, BaseException)}
    assert not errors, errors
    assert [got[r][2] for r in range(1, 8)] == list(range(1, 8))
    assert max(took.values()) <= 1.0 + 0.5, took    # 8 ranks' joins, all behind 150
