"""One endpoint for every rank of a host (RDMAMW_METRICS_HOST_PORT, docs/metrics.md).

Every process of the host takes part the same way: it serves its own metrics on a
loopback port, writes where in the host's directory (rdmamw/metrics/members.py), and
runs a thread that tries to bind the host's port every :data:`TAKEOVER` s until it
can. The port is the lock: one process at a time holds it and serves the endpoint,
asking every process at each scrape (rdmamw/metrics/gather.py); when that process
exits, or dies, the kernel frees the port and another takes over within TAKEOVER s.
No process is special, so no rank's death takes the endpoint down."""

from __future__ import annotations

import atexit
import errno
import logging
import os
import threading
from typing import Any

from prometheus_client.exposition import choose_encoder

from rdmamw.metrics import members
from rdmamw.metrics.gather import Merged, ask, health
from rdmamw.metrics.http import Answer, Route, Server, json_route

log = logging.getLogger("rdmamw.metrics")
#: seconds between a process's tries to bind the host's port while another holds it
TAKEOVER = 0.5


class Host:
    """This process's part in the host's endpoint at ``addr:port``: its file, saying
    that its own endpoint answers at ``url``, and the thread that serves the host's
    endpoint whenever no other process does."""

    def __init__(self, port: int, addr: str, url: str, rank: str) -> None:
        self.port, self.addr = port, addr
        self.file = members.join(port, url, rank)
        self.pid = os.getpid()
        atexit.register(self._leave)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.server: Server | None = None
        self.thread = threading.Thread(target=self._contend, name="rdmamw-metrics-host",
                                       daemon=True)
        self.thread.start()

    def routes(self) -> dict[str, Route]:
        """The host endpoint's paths but the metrics (every other path)."""
        return {"/health": json_route(self.health)}

    def _contend(self) -> None:
        while not self.stopping.is_set():
            try:
                server = Server(self.addr, self.port, self.routes(), self.metrics)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    log.warning("metrics: cannot serve the host's endpoint on %s:%d: %s",
                                self.addr, self.port, e)
                    return
                self.stopping.wait(TAKEOVER)    # another process serves it
                continue
            with self.lock:
                if self.stopping.is_set():
                    server.server_close()
                    return
                self.server = server
            log.info("metrics: serving the host's endpoint at http://%s:%d/metrics",
                     self.addr, self.port)
            server.serve_forever()
            return

    @property
    def serving(self) -> bool:
        """Whether this process serves the host's endpoint now."""
        return self.server is not None

    def metrics(self, accept: str) -> Answer:
        live = [m for m in members.members(self.port) if m.gone is None]
        encode, ctype = choose_encoder(accept)
        server = self.server
        dropped = server.dropped if server is not None else 0
        return 200, ctype, encode(Merged(live, ask(live, "/metrics"), dropped))

    def health(self) -> dict[str, Any]:
        """Every process's health answer, or what is known of one that gave none."""
        known = members.members(self.port)
        live = [m for m in known if m.gone is None]
        answers = iter(ask(live, "/health", accept="application/json"))
        return health(known, [next(answers) if m.gone is None else "" for m in known])

    def close(self) -> None:
        """Leave: stop serving (another process takes over) and remove our file."""
        self.stopping.set()
        with self.lock:
            server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        self.thread.join(5)
        atexit.unregister(self._leave)
        self._leave()

    def _leave(self) -> None:
        if os.getpid() == self.pid:         # (not in a fork child: the file is ours)
            members.leave(self.file)
