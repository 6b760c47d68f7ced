"""The one accept loop of every listener (shm, tcp, verbs, the bootstrap store), so that no
client, however slow or hostile, stalls a listener.

A daemon thread, started by the first ``accept()``, takes connections off the listening
socket. An unauthenticated connection costs almost nothing and never delays an
authenticated one: for a listener whose handshake proves the shared token
(``proves_token``: tcp, verbs, the bootstrap store), the loop itself sends the challenge
(rdmamw.auth) and collects the opener's proof, without a thread, within
:func:`proof_timeout` (``RDMAMW_PROOF_TIMEOUT`` s, default 3, capped by the handshake's
deadline). A newcomer pushes out the strangers of its source address that are past
``RDMAMW_UNPROVEN_PER_SOURCE`` (default 8) and older than ``RDMAMW_UNPROVEN_GRACE`` s
(default 1: a burst of ranks joining at once is held whole), and past
``RDMAMW_UNPROVEN_MAX`` strangers in all (default 256) the oldest of the busiest source
goes. A listener reads these settings (docs/config.md) when it is made. Strangers hold
no thread and no slot, so however many there are, a token holder is served at once. Only
a connection whose proof arrived gets a thread: it runs the handshake (which checks the
proof first) with a deadline (``RDMAMW_HANDSHAKE_TIMEOUT`` s from accept, default 10;
the loop shuts down a socket whose handshake outlives it). A token holder that proves the
token and then says nothing cannot keep the slots from others: while proven newcomers
wait for a slot, a handshake whose peer has sent nothing since its proof for
``IDLE_AFTER_PROOF`` s after our answer is cut, oldest first, and its slot goes to
them. Finished handshakes wait in a
queue for ``accept()``; failed ones are logged with the peer and the reason (the first
``DROPS_LOGGED`` of every ``DROPS_WINDOW`` s one by one, the others counted in one
line), and dropped. While ``RDMAMW_LISTEN_BACKLOG`` connections (default 16) are in a
handshake or finished but not yet accepted, proven ones wait in the loop's queue, in
order, their deadline starting with their handshake, and once as many wait there, new
ones wait in the kernel's listen queue (``KERNEL_BACKLOG`` long): a storm of hundreds
of ranks opening channels at once costs at most that many threads, never one per peer.
``close()`` stops the loop, cuts the handshakes under way and closes what was never
accepted."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from rdmamw import auth, config, observe
from rdmamw.errors import ChannelClosed, ConfigError, ProtocolError, ProviderUnavailable, Timeout

T = TypeVar("T")

#: failures that are ours, not the peer's: accept() raises them instead of dropping
LOCAL_ERRORS = (ProviderUnavailable, ConfigError)

#: the kernel's queue of connections not yet taken by the loop (``listen()``'s backlog;
#: net.core.somaxconn caps it): as long as the system allows, so that a storm of ranks
#: connecting at once waits there instead of having SYNs dropped and retried seconds later
KERNEL_BACKLOG = socket.SOMAXCONN


#: dropped connections a listener logs one by one in each DROPS_WINDOW s; a flood of
#: hostile clients past that is one line that counts them (a log line per connection
#: would let any stranger fill the job's log)
DROPS_LOGGED = 20
DROPS_WINDOW = 10.0

#: seconds a handshake's peer may stay silent after its token proof (counted from our
#: last bytes to it: a peer waiting for us is not idle) before a proven newcomer waiting
#: for a slot takes its slot; an honest opener sends its hello one round trip after our
#: answer
IDLE_AFTER_PROOF = 0.5


def _tcp_counts(sock: socket.socket) -> tuple[int, int, int] | None:
    """(bytes received on a TCP socket, bytes it sent that the peer acknowledged, ms
    since it last sent data), or None where the kernel does not say (not TCP; before
    Linux 4.1)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
    except OSError:
        return None
    if len(info) < 136:
        return None
    return (int.from_bytes(info[128:136], "little"), int.from_bytes(info[120:128], "little"),
            int.from_bytes(info[44:48], "little"))


def handshake_timeout() -> float:
    """Seconds one connection may take to finish its handshake (RDMAMW_HANDSHAKE_TIMEOUT)."""
    return config.get("RDMAMW_HANDSHAKE_TIMEOUT")


def proof_timeout() -> float:
    """Seconds from accept to the opener's token proof (RDMAMW_PROOF_TIMEOUT, at most
    the handshake's deadline)."""
    return min(config.get("RDMAMW_PROOF_TIMEOUT"), handshake_timeout())


def unproven_caps() -> tuple[int, float, int]:
    """(unproven connections held per source once they are older than the grace, the
    grace in seconds, unproven connections held in all): RDMAMW_UNPROVEN_PER_SOURCE,
    RDMAMW_UNPROVEN_GRACE, RDMAMW_UNPROVEN_MAX."""
    return (config.get("RDMAMW_UNPROVEN_PER_SOURCE"), config.get("RDMAMW_UNPROVEN_GRACE"),
            config.get("RDMAMW_UNPROVEN_MAX"))


def listen_backlog() -> int:
    """Connections a listener holds in a handshake or unaccepted (RDMAMW_LISTEN_BACKLOG)."""
    return config.get("RDMAMW_LISTEN_BACKLOG")


class _Pending:
    """One handshake under way; ``watch`` is a duplicate of its socket that the loop
    shuts down at the deadline (or on close), which wakes every read on it."""

    __slots__ = ("accepted", "deadline", "evicted", "expired", "received", "started",
                 "watch")

    def __init__(self, watch: socket.socket, accepted: float, timeout: float,
                 started: float) -> None:
        self.watch, self.expired, self.evicted = watch, False, False
        self.accepted, self.deadline, self.started = accepted, accepted + timeout, started
        self.received = _tcp_counts(watch)    # the proof, and our challenge, so far

    def idle(self, now: float) -> bool:
        """Its peer has sent nothing since the handshake began, though it has had our
        answer (acknowledged) for IDLE_AFTER_PROOF s (a TCP peer only)."""
        if self.received is None or self.expired or self.evicted or \
                now - self.started < IDLE_AFTER_PROOF:
            return False
        counts = _tcp_counts(self.watch)
        return counts is not None and counts[0] == self.received[0] and \
            counts[1] > self.received[1] and counts[2] >= IDLE_AFTER_PROOF * 1000

    def cut(self, expired: bool) -> None:
        self.expired = self.expired or expired
        try:
            self.watch.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _Stranger:
    """A connection that was sent the challenge and has not proved the token yet."""

    __slots__ = ("accepted", "addr", "buf", "conn", "deadline", "nonce", "source")

    def __init__(self, conn: socket.socket, addr: Any, nonce: bytes, now: float,
                 deadline: float) -> None:
        self.conn, self.addr, self.nonce = conn, addr, nonce
        self.source = addr[0] if isinstance(addr, tuple) and addr else "local"
        self.accepted, self.deadline, self.buf = now, deadline, b""


class HandshakeListener(Generic[T]):
    """Base of the listeners: serves ``_handshake(conn, addr) -> T`` concurrently on the
    bound, listening socket ``sock``. Subclasses supply ``_handshake`` and ``address``,
    and ``_discard`` when a T is not a :class:`~rdmamw.providers.Connected`.

    ``proves_token`` (default True): ``_handshake`` begins with
    ``rdmamw.auth.accept_side(conn)``, whose challenge and proof the loop handles (see
    the module doc); a handshake that does not check the proof is refused. A listener
    that authenticates otherwise (shm: the kernel's peer credentials) sets it False.
    ``key``, when set, gives the key the proof is checked with (default: the token)."""

    address: str
    proves_token = True
    key: Callable[[], bytes] | None = None
    #: the provider whose channels it accepts (their connects are counted in the
    #: metrics: rdmamw.observe.connect); None: not a channel's listener (the store)
    provider: str | None = None

    def __init__(self, sock: socket.socket, log: logging.Logger) -> None:
        self._timeout, self._limit = handshake_timeout(), listen_backlog()
        self._sock, self._log = sock, log
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._done: deque[T | Exception] = deque()
        self._pending: set[_Pending] = set()
        self._workers: set[threading.Thread] = set()
        self._held = 0                    # pending + done: bounded by _limit
        self._strangers: dict[int, _Stranger] = {}    # by fd, oldest first
        self._proven: deque[_Stranger] = deque()        # proved, waiting for a slot
        self._proof_timeout = proof_timeout()
        self._per_source, self._grace, self._unproven_max = unproven_caps()
        self._closed = False
        self._loop: threading.Thread | None = None
        self._wake = -1                   # eventfd that wakes the loop (from _start on)
        self._abandoned: weakref.finalize | None = None
        self._watchers: list[Callable[[], None]] = []
        self._drops_lock = threading.Lock()
        self._drops: list = [time.monotonic(), 0, ""]   # window start, drops, the last

    # ---- what a provider supplies ----------------------------------------------------
    def _handshake(self, conn: socket.socket, addr: Any) -> T:
        raise NotImplementedError

    def _discard(self, item: T) -> None:
        """Close a finished connection nobody accepted."""
        item.transport.close()            # type: ignore[attr-defined]

    def _peer(self, conn: socket.socket, addr: Any) -> str:
        """The peer as the log names it."""
        if isinstance(addr, tuple) and len(addr) >= 2:
            return f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"
        return repr(addr)

    # ---- public ------------------------------------------------------------------------
    def accept(self, timeout: float | None) -> T:
        """The next peer that finished its handshake, within ``timeout`` s (None: wait)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            self._start()
            while not self._done:
                if self._closed:
                    raise ChannelClosed(f"the listener on {self.address} was closed")
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise Timeout(f"no connection to {self.address} within {timeout} s")
                self._ready.wait(left)
            item = self._done.popleft()
            self._held -= 1
        self._poke()
        if isinstance(item, Exception):
            raise item
        return item

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (from any thread, without arguments) whenever a peer
        becomes ready to accept or the listener closes, until the returned function is
        called; an event loop then calls ``accept(0)``. Callbacks must not block."""
        with self._lock:
            self._start()
            self._watchers.append(callback)

        def unwatch() -> None:
            with self._lock:
                if callback in self._watchers:
                    self._watchers.remove(callback)
        return unwatch

    def _notify(self) -> None:
        with self._lock:
            watchers = list(self._watchers)
        for cb in watchers:
            cb()

    def close(self) -> None:
        """Stop accepting; cut handshakes under way; close what was never accepted."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
            self._ready.notify_all()
        self._notify()
        with self._ready:
            if self._abandoned is not None:
                self._abandoned.detach()
                os.eventfd_write(self._wake, 1)
        if self._loop is not None:
            self._loop.join()             # no new handshakes from here on
        for st in [*self._strangers.values(), *self._proven]:
            st.conn.close()
        self._strangers.clear()
        self._proven.clear()
        with self._lock:
            left, self._done = list(self._done), deque()
            for p in self._pending:
                p.cut(expired=False)
            workers = list(self._workers)
        end = time.monotonic() + self._timeout + 1
        for t in workers:                 # cut above: they end at their next read
            t.join(max(0.0, end - time.monotonic()))
        self._sock.close()
        if self._wake >= 0:
            os.close(self._wake)
        for item in left:
            if not isinstance(item, Exception):
                self._discard(item)
        with self._drops_lock:
            self._flush_drops(time.monotonic())

    # ---- the loop ------------------------------------------------------------------------
    def _start(self) -> None:
        """Start the loop. It holds the listener only weakly, so a listener dropped
        without close() is still collected (its socket closes), and the loop ends."""
        if self._loop is None and not self._closed:
            self._sock.setblocking(False)
            self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._abandoned = weakref.finalize(self, os.eventfd_write, self._wake, 1)
            self._loop = threading.Thread(
                target=_run, args=(weakref.ref(self), self._wake, self._sock.fileno()),
                daemon=True, name=f"rdmamw-listen {self.address}")
            self._loop.start()

    def _poke(self) -> None:
        """Wake the loop (a slot came free); after close() the eventfd is gone."""
        with self._lock:
            if not self._closed:
                os.eventfd_write(self._wake, 1)

    def _tick(self) -> tuple[bool, float | None, list[int]] | None:
        """(room for another handshake, seconds to the next deadline, the strangers'
        fds), after cutting the handshakes and strangers past theirs and giving free slots
        to the proven; None once closed."""
        now = time.monotonic()
        while self._proven and self._held < self._limit and not self._closed:
            st = self._proven.popleft()
            self._spawn(st.conn, st.addr, time.monotonic(), (st.nonce, st.buf))
        idle_check = None
        if self._proven:                  # no slot free: the silent ones give theirs up
            idle_check = self._evict_idle(now)
        for fd, st in list(self._strangers.items()):
            if st.deadline <= now:
                self._drop(fd, f"did not prove the token within {self._proof_timeout:g} s")
        with self._lock:
            if self._closed:
                return None
            for p in self._pending:
                if p.deadline <= now and not p.expired:
                    p.cut(expired=True)
            wait = min((p.deadline for p in self._pending if not p.expired), default=None)
        if idle_check is not None:
            wait = idle_check if wait is None else min(wait, idle_check)
        if self._strangers:
            first = min(st.deadline for st in self._strangers.values())
            wait = first if wait is None else min(wait, first)
        # a token listener takes newcomers as strangers (no slot) while fewer proven ones
        # wait than there are slots (they make the silent give theirs up); another one
        # hands each a slot at once
        room = len(self._proven) < self._limit if self.proves_token else \
            self._held < self._limit
        return room, None if wait is None else wait - now, list(self._strangers)

    def _evict_idle(self, now: float) -> float | None:
        """Proven peers wait for a slot: cut the handshakes whose peer has said nothing
        since its proof (oldest first, one per waiting peer); when to look again."""
        with self._lock:
            live = [p for p in self._pending if not p.expired and not p.evicted]
            want = len(self._proven) - (len(self._pending) - len(live))
            for p in sorted(live, key=lambda p: p.started):
                if want <= 0:
                    break
                if p.idle(now):
                    p.evicted = True
                    p.cut(expired=False)
                    want -= 1
            live = [p for p in live if not p.evicted and p.received is not None]
        if not live:
            return None
        return max(now + 0.05, min(p.started for p in live) + IDLE_AFTER_PROOF)

    def _drop(self, fd: int, reason: str) -> None:
        """Hang up on a stranger (the loop's thread)."""
        st = self._strangers.pop(fd)
        peer = self._peer(st.conn, st.addr)
        st.conn.close()
        self._dropped(peer, reason, time.monotonic() - st.accepted)

    def _connected(self, outcome: str, seconds: float) -> None:
        """Count a connect of a channel's listener in the metrics, when they record."""
        watch = observe.connect
        if watch is not None and self.provider is not None:
            watch(self.provider, outcome, seconds)

    def _dropped(self, peer: str, reason: str, seconds: float) -> None:
        """Log a dropped connection, ``seconds`` after it came: the first
        ``DROPS_LOGGED`` of each ``DROPS_WINDOW`` s one by one, the rest as one line
        that counts them (when the next drop comes after the window, or at close)."""
        self._connected("refused", seconds)
        now = time.monotonic()
        with self._drops_lock:
            if now - self._drops[0] >= DROPS_WINDOW:
                self._flush_drops(now)
            self._drops[1] += 1
            quiet = self._drops[1] > DROPS_LOGGED
            if quiet:
                self._drops[2] = f"{peer}: {reason}"
        if not quiet:
            self._log.warning("rdmamw: dropped connection from %s to %s: %s", peer,
                              self.address, reason)

    def _flush_drops(self, now: float) -> None:
        """Say how many drops went unlogged in the window that ends; start a new one
        (under ``_drops_lock``)."""
        start, n, last = self._drops
        if n > DROPS_LOGGED:
            self._log.warning("rdmamw: dropped %d more connections to %s in %.0f s, not "
                              "logged one by one (the last from %s)", n - DROPS_LOGGED,
                              self.address, now - start, last)
        self._drops = [now, 0, ""]

    def _welcome(self, conn: socket.socket, addr: Any) -> None:
        """Challenge a new connection and hold it as a stranger until its proof comes;
        the oldest strangers of its source (or of all) make room."""
        now = time.monotonic()
        try:
            conn.setblocking(False)
            nonce, hello = auth.challenge()
            conn.send(hello)              # a fresh socket's buffer takes it whole
        except OSError as e:
            conn.close()
            self._dropped(self._peer(conn, addr), str(e), 0.0)
            return
        st = _Stranger(conn, addr, nonce, now, now + self._proof_timeout)
        same = [fd for fd, o in self._strangers.items() if o.source == st.source]
        aged = [fd for fd in same if self._strangers[fd].accepted <= now - self._grace]
        for fd in aged[:max(0, len(same) + 1 - self._per_source)]:
            self._drop(fd, f"more than {self._per_source} connections from {st.source} "
                           f"without the token proof: the oldest go")
        if len(self._strangers) >= self._unproven_max:   # the busiest source's oldest goes
            count: dict[str, int] = {}
            for o in self._strangers.values():
                count[o.source] = count.get(o.source, 0) + 1
            busiest = max(count, key=count.__getitem__)
            self._drop(next(fd for fd, o in self._strangers.items() if o.source == busiest),
                       f"more than {self._unproven_max} connections without the token proof: "
                       f"the oldest of the busiest source goes")
        self._strangers[conn.fileno()] = st

    def _heard(self, fd: int) -> None:
        """A stranger sent something: the proof once it is whole (then its handshake
        waits for a slot: see _tick), or a hang-up."""
        st = self._strangers.get(fd)
        if st is None:
            return
        try:
            got = st.conn.recv(auth.PROOF_BYTES - len(st.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(fd, f"failed before the token proof: {e}")
            return
        if not got:
            self._drop(fd, "hung up before the token proof")
            return
        st.buf += got
        if len(st.buf) == auth.PROOF_BYTES:
            del self._strangers[fd]
            st.conn.setblocking(True)
            self._proven.append(st)

    def _take(self) -> None:
        try:
            conn, addr = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:              # out of fds, say: keep going, but do not spin
            self._log.warning("rdmamw: %s cannot accept: %s", self.address, e)
            time.sleep(0.1)
            return
        if self.proves_token:
            self._welcome(conn, addr)
        else:
            self._spawn(conn, addr, time.monotonic(), None)

    def _spawn(self, conn: socket.socket, addr: Any, accepted: float,
               proof: tuple[bytes, bytes] | None) -> None:
        """Run one connection's handshake in a thread of its own."""
        conn.settimeout(self._timeout)
        try:
            p = _Pending(conn.dup(), accepted, self._timeout, time.monotonic())
        except OSError as e:
            conn.close()
            self._log.warning("rdmamw: %s dropped a connection: %s", self.address, e)
            time.sleep(0.1)
            return
        t = threading.Thread(target=self._serve, args=(conn, addr, p, proof), daemon=True,
                             name=f"rdmamw-handshake {self.address}")
        with self._lock:
            self._held += 1
            self._pending.add(p)
            self._workers.add(t)
        try:
            t.start()
        except RuntimeError as e:         # no thread to be had: drop this one, go on
            with self._lock:
                self._held -= 1
                self._pending.discard(p)
                self._workers.discard(t)
                p.watch.close()
            conn.close()
            self._log.warning("rdmamw: %s dropped a connection: %s", self.address, e)
            time.sleep(0.1)

    def _serve(self, conn: socket.socket, addr: Any, p: _Pending,
               proof: tuple[bytes, bytes] | None) -> None:
        """One connection's handshake (its own thread): queue the result or drop it."""
        peer, item, reason = "?", None, None
        try:
            peer = self._peer(conn, addr)
            if proof is None:
                item = self._handshake(conn, addr)
            else:
                with auth.answered(conn, *proof, self.key) as answer:
                    item = self._handshake(conn, addr)
                if not answer.used:
                    self._discard(item)
                    item = None
                    raise ProtocolError(f"{type(self).__name__} never checked the token "
                                        f"proof")
        except LOCAL_ERRORS as e:
            item = e
            conn.close()
        except Exception as e:  # noqa: BLE001 - whatever the peer made us raise: drop it
            reason = str(e) or type(e).__name__
            p.expired = p.expired or isinstance(e, TimeoutError)
            conn.close()
        with self._ready:
            self._pending.discard(p)
            self._workers.discard(threading.current_thread())
            p.watch.close()
            closed = self._closed
            if p.expired:
                reason = f"did not finish the handshake within {self._timeout:g} s"
            elif p.evicted and reason is not None:
                reason = (f"said nothing for {IDLE_AFTER_PROOF:g} s after its token proof "
                          f"while proven peers waited for a set-up slot: it gave up its slot")
            keep = reason is None and not closed
            if keep:        # counted before accept() can return it
                self._connected("failed" if isinstance(item, Exception) else "accepted",
                                time.monotonic() - p.accepted)
                self._done.append(item)
                self._ready.notify()
            else:
                self._held -= 1
        if keep:
            self._notify()
        if not keep and item is not None and not isinstance(item, Exception):
            self._discard(item)
        if closed:                        # cut by close(): not the peer's doing
            self._log.debug("rdmamw: %s closed during a handshake with %s", self.address,
                            peer)
        elif reason is not None:
            self._dropped(peer, reason, time.monotonic() - p.accepted)
        self._poke()


def _run(ref: weakref.ref, wake: int, sock: int) -> None:
    """The accept loop of one listener: wait for a connection (while there is room), a
    deadline or a wake-up; hold the listener only while acting on it."""
    poll = select.poll()
    poll.register(wake, select.POLLIN)
    listening = False
    watched: set[int] = set()             # the strangers' sockets
    while True:
        me = ref()
        tick = None if me is None else me._tick()
        if tick is None:
            if me is None:                # dropped without close(): nobody else will
                os.close(wake)
            return
        room, wait, strangers = tick
        del me
        if room != listening:             # full: new peers wait in the kernel's queue
            if room:
                poll.register(sock, select.POLLIN)
            else:
                poll.unregister(sock)
            listening = room
        now = set(strangers)
        for fd in watched - now:
            poll.unregister(fd)
        for fd in now - watched:
            poll.register(fd, select.POLLIN)
        watched = now
        for fd, ev in poll.poll(None if wait is None else max(0, int(wait * 1000) + 1)):
            if fd == wake:
                try:
                    os.eventfd_read(wake)
                except BlockingIOError:
                    pass
            elif ev & select.POLLNVAL:
                continue                  # a stranger dropped meanwhile
            elif (me := ref()) is not None:
                if fd == sock:
                    if listening:
                        me._take()
                else:
                    me._heard(fd)
                del me
