"""The bootstrap store: rank 0 collects every rank's endpoint descriptor and hands
the whole table back, once (then the same listener serves re-joins and lookups:
rdmamw/bootstrap/rejoin.py). Connections prove the shared token (rdmamw.auth) before
a byte of msgpack is read; joins are served concurrently with a deadline each, and
garbage or silence is logged and dropped, never fatal. A rank that never shows up makes
init() fail with a Timeout that names it, on every rank.

A job has an identity: a join names the launcher's job id (rdmamw.bootstrap.env's
``launcher_job``) and the world size, and rank 0 refuses a rank whose either differs
from its own (:class:`OtherJob` on that rank) and goes on waiting for its own. The
table comes with a fresh job id rank 0 makes for every job; the job's channels by rank
prove it with the token (rdmamw.auth.job_key)."""

from __future__ import annotations

import errno
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from rdmamw import auth
from rdmamw.bootstrap import ranklist
from rdmamw.errors import PeerLost, PeerNotFound, PeerRefused, ProtocolError, RdmamwError, Timeout
from rdmamw.listener import KERNEL_BACKLOG, HandshakeListener
from rdmamw.providers import providers
from rdmamw.transport.wire import field, recv_frame, send_frame

log = logging.getLogger("rdmamw.bootstrap")
JOIN_LIMIT = 16384
#: a request for the current table (rank 0's store after init: rdmamw/bootstrap/rejoin.py)
LOOKUP = "lookup"
#: characters of rank 0's list of missing ranks a joining rank repeats
MISSING_SHOWN = 400
#: seconds between a re-joining rank's asks while its earlier process is still a member
REJOIN_RETRY = 0.2


class OtherJob(PeerRefused):
    """Rank 0 at our MASTER_ADDR:MASTER_PORT belongs to another job (another launcher
    job id or world size): two jobs share a port, or an old job's rank 0 still runs."""


def new_job() -> str:
    """A fresh id for one job (the shm names and the channel proofs of its ranks)."""
    return secrets.token_hex(6)


def _table_limit(world_size: int) -> int:
    return 65536 + 1024 * world_size


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listen(host: str, port: int) -> socket.socket:
    """Rank 0's store socket, or a clear error when the port is taken."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise RdmamwError(f"bootstrap port {host}:{port} is already in use (another "
                              f"job, or a rank 0 that is still running?); choose another "
                              f"MASTER_PORT") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise RdmamwError(f"rank 0 cannot listen on MASTER_ADDR={host}: not an address "
                              f"of this host") from None
        raise
    sock.listen(KERNEL_BACKLOG)
    return sock


class _Ranks:
    """Which ranks joined; ps-lite roles without an id get the next free one."""

    def __init__(self, world_size: int, ranges: dict[str, range]) -> None:
        self.world_size, self.ranges = world_size, ranges
        self.table: dict[int, dict] = {}

    def assign(self, rank: int | None, role: str | None) -> int:
        if rank is None:
            free = [r for r in self.ranges.get(role or "", ()) if r not in self.table]
            if not free:
                raise ProtocolError(f"no free rank left for role {role!r}")
            return free[0]
        if not 0 <= rank < self.world_size:
            raise ProtocolError(f"rank {rank} is outside the world of {self.world_size}")
        if rank in self.table:
            raise ProtocolError(f"rank {rank} joined twice")
        return rank

    def complete(self) -> bool:
        return len(self.table) >= self.world_size    # assign() keeps them in the world

    def missing(self) -> tuple[int, str]:
        """(how many ranks have not joined, which: compact and bounded)."""
        return (self.world_size - len(self.table),
                ranklist.compact_runs(ranklist.gaps(self.table, self.world_size)))


def parse_join(join: dict) -> tuple[int | None, str | None, dict]:
    """(rank or None, ps-lite role or None, descriptor) of a join, or ProtocolError."""
    rank = None if join.get("rank") is None else field(join, "rank", int)
    role = join.get("role")
    if role is not None and not isinstance(role, str):
        raise ProtocolError("join field 'role' is not a string")
    desc = field(join, "desc", dict)
    if not all(isinstance(k, str) for k in desc):
        raise ProtocolError("descriptor keys must be strings")
    for p in providers():           # each provider checks its own part
        if p.scheme in desc:
            p.check_entry(desc[p.scheme])
    return rank, role, desc


def parse_identity(join: dict) -> tuple[str | None, int | None]:
    """(launcher job id, world size) a join claims (None: not said), or ProtocolError."""
    job = join.get("launcher_job")
    if job is not None and not (isinstance(job, str) and len(job) <= 1024):
        raise ProtocolError("join field 'launcher_job' is not a job id")
    size = None if join.get("world_size") is None else field(join, "world_size", int)
    return job, size


def other_job(theirs: tuple[str | None, int | None], ours: tuple[str | None, int],
              where: str) -> str | None:
    """Why a join of identity ``theirs`` is of another job than ``ours``, or None."""
    (job, size), (my_job, my_size) = theirs, ours
    if job != my_job or (size is not None and size != my_size):
        return (f"{where} belongs to another job (job {my_job or 'without an id'}, "
                f"{my_size} ranks) than this rank (job {job or 'without an id'}, "
                f"{'?' if size is None else size} ranks): another job uses the same "
                f"MASTER_PORT, or a rank 0 of an earlier run still runs; give each job "
                f"its own MASTER_PORT")
    return None


@dataclass
class _Join:
    """A joiner that proved the token and sent its descriptor; it waits on ``conn``
    for the table."""

    conn: socket.socket
    peer: str
    rank: int | None
    role: str | None
    desc: dict
    job: str | None = None
    size: int | None = None
    #: "join", or "lookup": the current table (rdmamw/bootstrap/rejoin.py)
    kind: str = "join"


class Joins(HandshakeListener[_Join]):
    """Rank 0's store socket: joins are read concurrently, a deadline each, so silent
    or hostile sockets delay no rank (rdmamw/listener.py)."""

    def __init__(self, sock: socket.socket) -> None:
        host, port = sock.getsockname()[:2]
        self.host = host
        self.address = f"the bootstrap store on {host}:{port}"
        super().__init__(sock, log)

    def _handshake(self, conn: socket.socket, addr) -> _Join:
        auth.accept_side(conn, tell=True)   # a joining rank learns it was the token
        join = recv_frame(conn, JOIN_LIMIT)
        if join.get("kind") == LOOKUP:
            return _Join(conn, self._peer(conn, addr), None, None, {},
                         *parse_identity(join), kind=LOOKUP)
        return _Join(conn, self._peer(conn, addr), *parse_join(join), *parse_identity(join))

    def _discard(self, item: _Join) -> None:
        item.conn.close()


def serve(sock: socket.socket, world_size: int, me: dict, timeout: float,
          ranges: dict[str, range] | None = None, launcher_job: str | None = None,
          job: str | None = None) -> tuple[dict[int, dict], str]:
    """Rank 0: collect all descriptors (rank 0's is ``me``) of the ranks of our job
    (``launcher_job``, ``world_size``), reply the table and the job id (``job``, or a
    fresh one) to every rank, return both. Timeout names the ranks that never came.
    ``sock`` is closed on return."""
    joins = Joins(sock)
    try:
        return collect(joins, world_size, me, timeout, ranges, launcher_job, job)
    finally:
        joins.close()


def collect(joins: Joins, world_size: int, me: dict, timeout: float,
            ranges: dict[str, range] | None = None, launcher_job: str | None = None,
            job: str | None = None) -> tuple[dict[int, dict], str]:
    """:func:`serve` on ``joins``, which stays open (rank 0 goes on serving re-joins
    and lookups on it: rdmamw/bootstrap/rejoin.py)."""
    job = job or new_job()
    ranks = _Ranks(world_size, ranges or {})
    ranks.table[0] = me
    conns: list[tuple[socket.socket, int]] = []
    deadline = time.monotonic() + timeout
    try:
        while not ranks.complete():
            left = deadline - time.monotonic()
            if left <= 0:
                count, missing = ranks.missing()
                for c, _ in conns:
                    try_send(c, {"ok": False, "missing": missing, "missing_count": count})
                raise Timeout(f"rdmamw.init(): {count} of {world_size} ranks never joined "
                              f"the bootstrap store within {timeout:g} s: ranks {missing}")
            try:
                j = joins.accept(left)
            except Timeout:
                continue
            why = other_job((j.job, j.size), (launcher_job, world_size), "rank 0")
            try:
                if why is not None:
                    raise ProtocolError(why)
                if j.kind == LOOKUP:
                    raise ProtocolError("a lookup before every rank joined")
                rank = ranks.assign(j.rank, j.role)
            except ProtocolError as e:
                refuse(j, joins.address, str(e), why is not None)
                continue
            j.desc["rank"] = rank
            ranks.table[rank] = j.desc
            conns.append((j.conn, rank))
        table = [ranks.table[r] for r in range(world_size)]
        for c, r in conns:
            try_send(c, {"ok": True, "job": job, "rank": r, "table": table})
        return ranks.table, job
    finally:
        for c, _ in conns:
            c.close()


def refuse(j: _Join, where: str, why: str, other: bool, **more: object) -> None:
    """Log a refused request, tell its sender why, hang up."""
    log.warning("rdmamw: dropped connection from %s to %s: %s", j.peer, where, why)
    try_send(j.conn, {"ok": False, "error": why, "other_job": other, **more})
    j.conn.close()


def try_send(conn: socket.socket, obj: dict) -> None:
    try:
        send_frame(conn, obj)
    except OSError:
        pass


def _dial(host: str, port: int, deadline: float, timeout: float,
          source: str | None) -> socket.socket:
    """A connection to rank 0's store, retried while nobody listens until ``deadline``."""
    while True:
        conn = socket.socket(_family(host), socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        conn.settimeout(max(0.05, min(2.0, deadline - time.monotonic())))
        try:
            if source:
                conn.bind((source, 0))
            conn.connect((host, port))
            return conn
        except (ConnectionRefusedError, TimeoutError, OSError) as e:
            conn.close()
            if time.monotonic() >= deadline:
                raise Timeout(f"rdmamw.init(): rank 0 (bootstrap store {host}:{port}) did not "
                              f"answer within {timeout:g} s ({e}); missing ranks: [0]") from None
            time.sleep(0.05)


def _route_ip(host: str, port: int, source: str | None) -> str:
    """The local address a connection to ``host`` leaves from: ``source``, or the
    kernel's route to it (a datagram socket's connect sends nothing)."""
    if source:
        return source
    with socket.socket(_family(host), socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.connect((host, port))
        except OSError:
            return ""           # no route yet: the connection's own address decides
        return s.getsockname()[0]


def _ask(host: str, port: int, deadline: float, timeout: float, source: str | None,
         request: Callable[[str], dict], limit: int) -> dict:
    """One request to rank 0's store (``request(our local IP)``) and its reply."""
    conn = _dial(host, port, deadline, timeout, source)
    try:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        auth.open_side(conn)
        send_frame(conn, request(conn.getsockname()[0]))
        conn.settimeout(max(1.0, deadline - time.monotonic()) + 5.0)
        return recv_frame(conn, limit)
    except TimeoutError:
        raise Timeout(f"rdmamw.init(): no table from rank 0 within {timeout:g} s") from None
    except auth.TokenRefused:
        raise auth.TokenRefused(
            f"rdmamw.init(): rank 0 (bootstrap store {host}:{port}) refused our token: it "
            f"holds another one. Set the same RDMAMW_TOKEN in every rank (or share the "
            f"per-user token file)") from None
    except ProtocolError as e:
        raise PeerNotFound(f"rdmamw.init(): joining the bootstrap store at {host}:{port} "
                           f"failed: {e}") from None
    except OSError as e:
        raise PeerLost(f"rdmamw.init(): lost the connection to rank 0 (bootstrap store "
                       f"{host}:{port}): {e}; is rank 0 still running?") from None
    finally:
        conn.close()


def join(host: str, port: int, rank: int | None, role: str | None,
         make_desc: Callable[[str], dict],
         world_size: int, timeout: float,
         source: str | None = None,
         launcher_job: str | None = None) -> tuple[dict[int, dict], str, int]:
    """Ranks > 0: send our descriptor, made from the local IP the store is reached
    from (so our listener binds the interface the others can reach; ``source``, the
    interface RDMAMW_SOCKET_IFNAME selects, when given), and our job's identity
    (``launcher_job``, ``world_size``), wait for the table. Returns (table, job id,
    our rank); :class:`OtherJob` if rank 0 is of another job, ``AuthError`` if it
    holds another token. A re-join (our rank is in a running job's table) that rank 0
    answers with ``wait`` (the rank's earlier process is still a member) is asked
    again until ``timeout``."""
    deadline = time.monotonic() + timeout
    # the descriptor (our listeners: seconds on a slow or loaded host) is made before
    # we connect: the store gives a connection RDMAMW_HANDSHAKE_TIMEOUT to finish, not
    # our whole deadline
    ip = _route_ip(host, port, source)
    desc = make_desc(ip) if ip else None

    def request(conn_ip: str) -> dict:
        nonlocal ip, desc
        if conn_ip != ip or desc is None:   # the connection left from another address
            ip, desc = conn_ip, make_desc(conn_ip)
        return {"rank": rank, "role": role, "desc": desc,
                "launcher_job": launcher_job, "world_size": world_size}

    while True:
        reply = _ask(host, port, deadline, timeout, source, request, _table_limit(world_size))
        if reply.get("wait") is not True or time.monotonic() >= deadline:
            break
        time.sleep(REJOIN_RETRY)
    table, job = _table(reply, host, port, world_size)
    return table, job, field(reply, "rank", int)


def lookup(host: str, port: int, world_size: int, timeout: float,
           launcher_job: str | None = None) -> tuple[dict[int, dict], str]:
    """The running job's current table (re-joined ranks' new descriptors, each with
    its ``gen``eration) and id, from rank 0's store."""
    reply = _ask(host, port, time.monotonic() + timeout, timeout, None,
                 lambda ip: {"kind": LOOKUP, "launcher_job": launcher_job,
                             "world_size": world_size}, _table_limit(world_size))
    return _table(reply, host, port, world_size)


def _table(reply: dict, host: str, port: int, world_size: int) -> tuple[dict[int, dict], str]:
    """(table, job id) of a store's reply, or the error it says."""
    if reply.get("ok") is not True:
        if reply.get("other_job") is True:
            raise OtherJob(f"rdmamw.init(): rank 0 (bootstrap store {host}:{port}) refused "
                           f"us: {reply.get('error')}")
        if "missing" in reply:
            count = reply.get("missing_count")
            raise Timeout(f"rdmamw.init(): {count if isinstance(count, int) else 'some'} of "
                          f"{world_size} ranks never joined the bootstrap store: ranks "
                          f"{str(reply['missing'])[:MISSING_SHOWN]}")
        raise RdmamwError(f"rdmamw.init(): rank 0 refused us: {reply.get('error')}")
    raw = field(reply, "table", list)
    if len(raw) != world_size or not all(isinstance(d, dict) for d in raw):
        raise ProtocolError(f"bootstrap table of {len(raw)} entries for {world_size} ranks")
    return dict(enumerate(raw)), field(reply, "job", str)
