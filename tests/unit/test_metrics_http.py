"""No client holds a metrics endpoint (rdmamw/metrics/http.py), over real sockets: 200
clients that connect and say nothing leave a scrape answered within 1 s and the
endpoint within its thread bound; half a request line is closed by
RDMAMW_METRICS_TIMEOUT; a client that never reads a large answer is let go within it
and holds no scrape meanwhile."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from rdmamw.metrics.http import Answer, Server

BIG = 64 << 20          # more than the two sockets' buffers hold


def small(_accept: str) -> Answer:
    return 200, "text/plain", b"fine\n"


def big(_accept: str) -> Answer:
    return 200, "application/octet-stream", bytes(BIG)


def serving(monkeypatch, timeout: float, limit: int) -> Server:
    monkeypatch.setenv("RDMAMW_METRICS_TIMEOUT", str(timeout))
    monkeypatch.setenv("RDMAMW_METRICS_MAX_CONNECTIONS", str(limit))
    return Server("127.0.0.1", 0, {"/big": big}, small).start()


@pytest.fixture
def server(monkeypatch) -> Iterator[Server]:
    s = serving(monkeypatch, 0.5, 16)
    yield s
    s.close()


@pytest.fixture
def patient(monkeypatch) -> Iterator[Server]:
    """Its timeout longer than the test: what holds is the bound."""
    s = serving(monkeypatch, 30, 16)
    yield s
    s.close()


def get(s: Server, path: str = "/metrics") -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{s.port}{path}", timeout=5) as r:
        return r.read()


def until(check, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_200_silent_clients_neither_hold_a_scrape_nor_the_threads(patient):
    server = patient
    threads = threading.active_count()
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
    try:
        assert until(lambda: server.dropped >= 200 - server.limit, 5), server.dropped
        assert until(lambda: threading.active_count() - threads <= server.limit, 2)
        t0 = time.monotonic()
        assert get(server) == b"fine\n"
        assert time.monotonic() - t0 < 1.0
        assert len(server.open) <= server.limit
        # the ones closed to make room were the silent ones: they read the end
        for c in silent[:100]:
            c.settimeout(5)
        assert sum(c.recv(1) == b"" for c in silent[:100]) == 100
    finally:
        for c in silent:
            c.close()


def test_half_a_request_line_is_closed_by_the_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as c:
        c.sendall(b"GET /metr")
        c.settimeout(5)
        t0 = time.monotonic()
        assert c.recv(1) == b""                 # closed, nothing answered
        took = time.monotonic() - t0
    assert 0.3 < took < 2.0, took
    assert until(lambda: not server.open, 1)


def test_a_client_that_never_reads_a_large_answer_is_let_go(server):
    with socket.create_connection(("127.0.0.1", server.port)) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.sendall(b"GET /big HTTP/1.0\r\n\r\n")
        assert until(lambda: list(server.open.values()) == [False], 2)   # being answered
        t0 = time.monotonic()
        assert get(server) == b"fine\n"
        assert time.monotonic() - t0 < 1.0
        assert until(lambda: not server.open, 0.5 + 1.5), "the writer still holds it"
        # and the endpoint is whole: the next scrape is answered (not /big: 64 MiB in
        # the 0.5 s this endpoint gives a whole write is too little on a loaded machine)
        assert get(server) == b"fine\n" and until(lambda: not server.open, 2.0)


def test_at_the_bound_with_every_connection_answered_a_newcomer_is_closed(monkeypatch):
    s = serving(monkeypatch, 30, 1)
    try:
        with socket.create_connection(("127.0.0.1", s.port)) as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.sendall(b"GET /big HTTP/1.0\r\n\r\n")
            assert until(lambda: list(s.open.values()) == [False], 2)
            with socket.create_connection(("127.0.0.1", s.port)) as late:
                late.settimeout(2)
                assert late.recv(1) == b""
            assert s.dropped == 1
    finally:
        s.close()


def test_a_rank_endpoint_counts_what_it_dropped(monkeypatch):
    """The connections closed to keep to the bound are a series of the rank's
    endpoint: a silent one closed for the scrape that shows it."""
    pytest.importorskip("prometheus_client")
    from rdmamw.metrics.exporter import Endpoint
    monkeypatch.setenv("RDMAMW_METRICS_MAX_CONNECTIONS", "1")
    e = Endpoint(0, "127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", e.port)):
            assert until(lambda: len(e.server.open) == 1, 2)
            text = get(e.server).decode()
        assert "rdmamw_metrics_connections_dropped_total{rank=\"\"} 1.0" in text, text[-400:]
    finally:
        e.close()
