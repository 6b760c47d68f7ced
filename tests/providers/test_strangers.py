"""An unauthenticated connection costs almost nothing and never delays an authenticated
one (issue 29, finding 1): every listener that proves the token (tcp, verbs, the
bootstrap store; rdmamw/listener.py) sends its challenge first, gives the
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
from rdmamw import auth, config
from rdmamw import listener as _listener
from rdmamw.bootstrap import store
from tests.providers.test_listener_dos import open_and_accept, raw_client

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
    """150 idle strangers: no handshake thread for any of them, and once they are older
    than UNPROVEN_GRACE the next newcomer leaves at most 8 of them open."""
    base = threading.active_count()
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.05)
        port = int(lst.address.rpartition(":")[2])
        idle = strangers(port)
        try:
            time.sleep(config.get("RDMAMW_UNPROVEN_GRACE") + 0.3)
            idle += strangers(port, 1)          # a newcomer: the aged ones past 8 go
            time.sleep(0.3)
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
            assert kept <= 8, f"{kept} strangers from one source held open"
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


class Careless(_listener.HandshakeListener[socket.socket]):
    """A listener whose handshake forgets to check the token proof."""

    address = "careless"

    def _handshake(self, conn, addr):
        return conn

    def _discard(self, item):
        item.close()


def test_a_handshake_that_never_checks_the_proof_is_refused(caplog):
    caplog.set_level(logging.WARNING, logger="test.careless")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    lst = Careless(sock, logging.getLogger("test.careless"))
    try:
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.05)
        s = socket.create_connection(sock.getsockname(), timeout=5)
        with pytest.raises(auth.AuthError):
            auth.open_side(s, b"not the token")      # nobody checked: nobody answers
        s.close()
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.5)
    finally:
        lst.close()
    assert any("never checked the token" in r.getMessage() for r in caplog.records), \
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


INIT_ONLY = """
import json, sys, time, rdmamw
t0 = time.monotonic()
w = rdmamw.init(timeout=30)
print(json.dumps({"rank": w.rank, "took": time.monotonic() - t0}), flush=True)
rdmamw.finalize()
"""


@pytest.mark.slow
def test_init_of_8_processes_with_150_strangers_at_master_port():
    """rdmamw.init() of 8 rank processes while 150 idle strangers hold connections to
    MASTER_PORT (opened as soon as rank 0 listens): every rank meets."""
    import json
    import subprocess
    import sys

    from rdmamw.bootstrap.launch import free_port
    from tests.integrations.test_bootstrap import ROOT, clean_env
    from tests.support.helpers import reap
    port = free_port()
    env = dict(WORLD_SIZE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def start(r):
        return subprocess.Popen([sys.executable, "-c", INIT_ONLY], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=clean_env(RANK=str(r), **env))
    procs = [start(0)]
    idle: list[socket.socket] = []
    try:
        for _ in range(600):
            try:
                idle = strangers(port)
                break
            except ConnectionRefusedError:
                for s in idle:
                    s.close()
                time.sleep(0.05)
        assert len(idle) == STRANGERS
        procs += [start(r) for r in range(1, 8)]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        reap(procs)
        for s in idle:
            s.close()
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert sorted(json.loads(o.splitlines()[0])["rank"] for o, _ in outs) == list(range(8))


def test_a_burst_of_ranks_joining_at_once_from_one_host_all_get_in():
    """24 ranks of one host join rank 0's store at the same moment: more than 8
    unproven connections from one source, all young, none pushed out."""
    n = 25
    sock = store.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    got: dict = {}
    go = threading.Event()

    def rank(r):
        go.wait()
        try:
            got[r] = store.join("127.0.0.1", port, r, None, lambda ip: {"host": f"h{r}"},
                                n, 20)
        except BaseException as e:  # noqa: BLE001
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(1, n)]
    for t in threads:
        t.start()
    go.set()
    served = store.serve(sock, n, {"host": "h0"}, 20)
    for t in threads:
        t.join(30)
    errors = {r: v for r, v in got.items() if isinstance(v, BaseException)}
    assert not errors, errors
    assert sorted(served[0]) == list(range(n))
