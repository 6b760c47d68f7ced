"""The HTTP side of the endpoints (a rank's, the host's): a threaded server, each
request answered on a thread of its own (a slow answer holds no other), routed by
path; what is not routed is the metrics, as prometheus_client's own server does.
The standard library's, so the host's endpoint can bind a port and fail cleanly
while another process holds it, or serve a socket it was handed
(rdmamw/metrics/host.py shares one so).

A client costs a thread while its connection is open, so no client may keep one:
each read of a request and the whole write of an answer are bounded by
RDMAMW_METRICS_TIMEOUT (a client that says nothing, half a request line, or reads
no answer is closed then), and at most RDMAMW_METRICS_MAX_CONNECTIONS are open at
once: a newcomer beyond them closes the oldest connection still waiting for its
request (a scrape sends its request at once, so it is the silent ones that go), or,
when every one is being answered, is closed itself; both are counted
(:attr:`Server.dropped`)."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rdmamw import config

log = logging.getLogger("rdmamw.metrics")
#: an answer: (HTTP status, content type, body)
Answer = tuple[int, str, bytes]
#: what a route is called with: the request's Accept header
Route = Callable[[str], Answer]


def json_route(make: Callable[[], Any]) -> Route:
    """A route answering ``make()`` as JSON."""
    def answer(_accept: str) -> Answer:
        return 200, "application/json", json.dumps(make()).encode()
    return answer


class Server(ThreadingHTTPServer):
    """``routes`` by path (``"/health"``) and ``default`` for every other path; bound
    at once (OSError if it cannot be), serving from :meth:`start` on."""

    daemon_threads = True
    request_queue_size = 128        # a burst of connects waits in the kernel, not refused

    def __init__(self, addr: str, port: int, routes: dict[str, Route], default: Route,
                 sock: socket.socket | None = None) -> None:
        """``sock``: a listening socket to serve (another process's too: each that
        serves it accepts what it can; rdmamw/metrics/host.py) instead of binding."""
        self.routes, self.default = routes, default
        self.wait: float = config.get("RDMAMW_METRICS_TIMEOUT")
        self.limit: int = config.get("RDMAMW_METRICS_MAX_CONNECTIONS")
        #: the open connections, oldest first: True while waiting for their request
        self.open: dict[socket.socket, bool] = {}
        #: connections closed to keep to the limit (a silent one, or a newcomer)
        self.dropped = 0
        self.opening = threading.Lock()
        super().__init__((addr, port), _Handler, bind_and_activate=sock is None)
        if sock is not None:
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()
            self.server_name, self.server_port = str(addr), self.server_address[1]
        # accept() only when one is there: a process sharing the socket that polled
        # it ready with the others must not then wait in accept() for the next one
        self.socket.setblocking(False)
        self.port: int = self.server_address[1]
        self.thread: threading.Thread | None = None

    def start(self) -> Server:
        self.thread = threading.Thread(target=self.serve_forever, name="rdmamw-metrics-serve",
                                       daemon=True)
        self.thread.start()
        return self

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.opening:
            if len(self.open) >= self.limit:
                self.dropped += 1
                idle = next((c for c, waiting in self.open.items() if waiting), None)
                if idle is None:                # every one is being answered
                    self.shutdown_request(request)
                    return
                del self.open[idle]
                _hang_up(idle)                  # its thread's read ends, the thread too
            self.open[request] = True
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.opening:
                self.open.pop(request, None)

    def answering(self, request: Any) -> None:
        """``request`` has said what it wants: no newcomer may close it now."""
        with self.opening:
            if request in self.open:
                self.open[request] = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: a connection from %s failed", client_address, exc_info=True)

    def close(self) -> None:
        if self.thread is not None:
            self.shutdown()
            self.thread.join(5)
        self.server_close()


def _hang_up(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass                # closed by its thread meanwhile


class _Handler(BaseHTTPRequestHandler):
    server: Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.wait)   # each read, the whole write

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        self.server.answering(self.connection)
        path = self.path.partition("?")[0].rstrip("/") or "/"
        route = self.server.routes.get(path, self.server.default)
        try:
            status, ctype, body = route(self.headers.get("Accept", ""))
        except Exception as e:     # an answer's failure is this request's, not the server's
            log.warning("metrics: answering %s failed: %r", self.path, e)
            status, ctype, body = 500, "text/plain; charset=utf-8", repr(e).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass        # a scrape each few seconds is not worth a line on stderr
