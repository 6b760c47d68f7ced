"""The HTTP side of the endpoints (a rank's, the host's): a threaded server, each
request answered on a thread of its own (a slow answer holds no other), routed by
path; what is not routed is the metrics, as prometheus_client's own server does.
The standard library's, so the host's endpoint can bind a port and fail cleanly
while another process holds it (rdmamw/metrics/host.py takes turns so)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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

    def __init__(self, addr: str, port: int, routes: dict[str, Route], default: Route) -> None:
        self.routes, self.default = routes, default
        super().__init__((addr, port), _Handler)
        self.port: int = self.server_address[1]
        self.thread: threading.Thread | None = None

    def start(self) -> Server:
        self.thread = threading.Thread(target=self.serve_forever, name="rdmamw-metrics-serve",
                                       daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        if self.thread is not None:
            self.shutdown()
            self.thread.join(5)
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
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
