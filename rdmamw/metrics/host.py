"""One endpoint for every rank of a host (RDMAMW_METRICS_HOST_PORT, docs/metrics.md).

Every process of the host takes part the same way: it serves its own metrics on a
loopback port and writes where in the host's directory (rdmamw/metrics/members.py),
and it serves the host's port too, on one listening socket that every process shares.
The first to bind the port makes it; every other gets a copy of it (its file
descriptor, over a Unix socket in the directory that each holder answers on) and
accepts on it as well. Each scrape is accepted by one process, whichever of them is
running, which asks every process (rdmamw/metrics/gather.py). So a process stopped
(SIGSTOP, a debugger) or dead leaves the endpoint to the others at once: it calls no
accept(), and the kernel gives the next connection to one that does; only a scrape it
had already accepted is lost. The port stays bound while any holder lives; when the
last exits, a newcomer binds it again. A process that could neither bind nor borrow
(every holder stopped) tries again every :data:`TAKEOVER` s.

Why a shared socket: a stopped process keeps its listening socket open, and the
kernel keeps completing connections into its backlog, so no other process can bind
the port (EADDRINUSE) and a client's connection waits there unanswered; SO_REUSEPORT
does not help, the kernel spreads connections over every socket of the group, the
stopped one's included. One socket with several accepting processes has one queue,
drained by whichever accepts."""

from __future__ import annotations

import atexit
import errno
import logging
import os
import socket
import socketserver
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
        self.giver: Giver | None = None
        self.thread = threading.Thread(target=self._contend, name="rdmamw-metrics-host",
                                       daemon=True)
        self.thread.start()

    def routes(self) -> dict[str, Route]:
        """The host endpoint's paths but the metrics (every other path)."""
        return {"/health": json_route(self.health)}

    def _contend(self) -> None:
        while not self.stopping.is_set():
            try:
                sock = self._bind() or self._borrow()
            except OSError as e:
                log.warning("metrics: cannot serve the host's endpoint on %s:%d: %s",
                            self.addr, self.port, e)
                return
            if sock is None:
                self.stopping.wait(TAKEOVER)    # its holders are all stopped: later
                continue
            server = Server(self.addr, self.port, self.routes(), self.metrics, sock=sock)
            try:
                giver: Giver | None = Giver(self.file.removesuffix(".json") + ".sock", sock)
            except OSError as e:    # (served, but by no newcomer until this one exits)
                log.warning("metrics: cannot hand the host's endpoint to others: %s", e)
                giver = None
            with self.lock:
                if self.stopping.is_set():
                    server.server_close()
                    if giver is not None:
                        giver.server_close()
                    return
                self.server, self.giver = server, giver
            if giver is not None:
                threading.Thread(target=giver.serve_forever, name="rdmamw-metrics-give",
                                 daemon=True).start()
            log.info("metrics: serving the host's endpoint at http://%s:%d/metrics",
                     self.addr, self.port)
            server.serve_forever()
            return

    def _bind(self) -> socket.socket | None:
        """The host's port's listening socket, made now; None if a process has it."""
        try:
            return socket.create_server((self.addr, self.port), backlog=128)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            return None

    def _borrow(self) -> socket.socket | None:
        """A copy of the host's port's socket from a process that holds it, or None."""
        for m in members.members(self.port):
            if m.gone is not None or m.pid == self.pid or members.stopped(m.pid):
                continue
            path = os.path.join(members.directory(self.port), f"{m.pid}.sock")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.settimeout(TAKEOVER)
                    c.connect(path)
                    _, fds, _, _ = socket.recv_fds(c, 1, 1)
            except OSError:
                continue        # not a holder (yet), or gone, or stopped meanwhile
            if fds:
                return socket.socket(fileno=fds[0])
        return None

    @property
    def serving(self) -> bool:
        """Whether this process serves the host's endpoint now (it accepts its
        connections, with every other process that does)."""
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
            giver, self.giver = self.giver, None
        if server is not None:
            server.shutdown()
            server.server_close()       # our copy: the others serve on theirs
        if giver is not None:
            giver.shutdown()
            giver.server_close()
        self.thread.join(5)
        atexit.unregister(self._leave)
        self._leave()

    def _leave(self) -> None:
        if os.getpid() == self.pid:         # (not in a fork child: the file is ours)
            members.leave(self.file)

    def forget(self) -> None:
        """In a fork child: close the inherited copies of the sockets (the parent's
        threads serve them), so a child outliving its parent holds no port."""
        for held in (self.server, self.giver):
            if held is not None:
                held.socket.close()


class Giver(socketserver.UnixStreamServer):
    """Hands a copy of the host's port's socket to each process that connects at
    ``path`` (in the host's directory: this user's only)."""

    def __init__(self, path: str, sock: socket.socket) -> None:
        self.path, self.listening = path, sock
        try:
            os.unlink(path)         # a dead process's of the same pid
        except FileNotFoundError:
            pass
        super().__init__(path, _Give)

    def server_close(self) -> None:
        super().server_close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _Give(socketserver.BaseRequestHandler):
    server: Giver

    def handle(self) -> None:
        socket.send_fds(self.request, [b"L"], [self.server.listening.fileno()])
