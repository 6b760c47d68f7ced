"""The ``shm`` provider's control path: connection set-up on an abstract Unix socket.

``shm://NAME`` is the abstract socket ``\\0rdmamw-shm/NAME`` (nothing on disk). A
connection exchanges msgpack hellos (ring sizes, mode), then each side hands the other
an anonymous memfd holding its block and an eventfd for wake-ups (SCM_RIGHTS). No
segment has a name, so nothing is ever left in /dev/shm, even after SIGKILL: the
memory goes when the last mapping does. Only processes of the same user may connect
(SO_PEERCRED; ``RDMAMW_SHM_ALLOW_UIDS`` lets listed other users in, root included).
Every memfd is sealed against shrinking and growing before it is handed over, and a
peer's descriptors are checked (sealed memfds of the announced sizes, an eventfd)
before anything is mapped: a peer cannot truncate a block under us (SIGBUS).
The listener serves handshakes concurrently, each with a deadline
(rdmamw/listener.py): a refused or failed peer is logged and dropped.

For rendezvous the two sides test, with a probe word, whether each may read the other's
memory with ``process_vm_readv`` (CMA; ptrace rules decide). A side the peer cannot CMA
then hands over a staging memfd (sparse until used) for its copies; with CMA both ways
(the usual case) there is none, so a channel maps only the two blocks.
``RDMAMW_SHM_CMA=0`` forbids CMA, so the staged path is used; ``RDMAMW_SHM_STAGING``
sizes the staging area (bytes, default 1 GiB)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable

import msgpack

from rdmamw import _host, config
from rdmamw.errors import (
    PeerNotFound,
    PeerRefused,
    ProtocolError,
    RdmamwError,
    Timeout,
)
from rdmamw.listener import KERNEL_BACKLOG, HandshakeListener
from rdmamw.providers import Connected
from rdmamw.providers.base import Advert, RankPair
from rdmamw.providers.shm._endpoint import XTAB_BYTES, cma_probe
from rdmamw.providers.shm._transport import ShmTransport
from rdmamw.transport import layout
from rdmamw.transport import wire as fr
from rdmamw.vocabulary import READ

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
log = logging.getLogger("rdmamw.shm")
_PREFIX = b"\0rdmamw-shm/"
#: the exposure table follows the regions in each block (page-rounded)
XTAB_SPACE = (XTAB_BYTES + layout.PAGE - 1) // layout.PAGE * layout.PAGE


def staging_bytes() -> int:
    """Size of the staging area used when CMA is not permitted."""
    return config.get("RDMAMW_SHM_STAGING")


def cma_allowed() -> bool:
    """False when ``RDMAMW_SHM_CMA=0`` forbids process_vm_readv (tests, locked-down hosts)."""
    return config.get("RDMAMW_SHM_CMA")


def assist_settings() -> tuple[int, int, float]:
    """(smallest READ or WRITE the exposing side is asked to help with, smallest chunk,
    seconds a helper may hold an unfinished chunk) for the assisted copies of
    rdmamw/providers/shm/rm_assist.h: ``RDMAMW_SHM_ASSIST`` bytes (0: off, default 1 MiB),
    ``RDMAMW_SHM_ASSIST_CHUNK`` (default 256 KiB), ``RDMAMW_SHM_ASSIST_STALL`` (default
    10 s; a peer stopped mid-chunk then fails the channel rather than hang it)."""
    return (config.get("RDMAMW_SHM_ASSIST"), config.get("RDMAMW_SHM_ASSIST_CHUNK"),
            config.get("RDMAMW_SHM_ASSIST_STALL"))


def _address(name: str) -> bytes:
    if not name or "\0" in name or "/" in name[:1]:
        raise ValueError(f"bad shm name {name!r}")
    raw = _PREFIX + name.encode()
    if len(raw) > 107:
        raise ValueError(f"shm name {name!r} is too long (max {107 - len(_PREFIX)} bytes)")
    return raw


def allowed_uids() -> frozenset[int] | None:
    """Other users whose processes may connect (``RDMAMW_SHM_ALLOW_UIDS``: a comma list
    of uids, or ``any``); None for any. Our own uid always may; root is not special."""
    uids = config.get("RDMAMW_SHM_ALLOW_UIDS")
    return frozenset() if uids == "" else uids


def _check_peer_user(conn: socket.socket) -> int:
    """The peer's pid (from the kernel, not from the peer), if it is our user or one
    ``RDMAMW_SHM_ALLOW_UIDS`` lets in; else PeerRefused."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    allowed = allowed_uids()
    if uid != os.getuid() and allowed is not None and uid not in allowed:
        raise PeerRefused(f"refusing shm peer pid {pid} of uid {uid} (we are uid "
                          f"{os.getuid()}); set RDMAMW_SHM_ALLOW_UIDS={uid} on this side "
                          "to let that user in")
    return pid


#: what every block and staging memfd must carry: no shrinking (SIGBUS in whoever maps
#: it), no growing, and no further seals (F_SEAL_FUTURE_WRITE would fail our mapping)
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes, mode 0600 (it has no name anyone could open it by
    anyway), sealed with SEALS."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_memfd(fd: int, size: int, what: str) -> None:
    """The peer's ``what`` must be a sealed memfd of at least ``size`` bytes (checked
    before it is mapped); else ProtocolError."""
    st = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not stat.S_ISREG(st.st_mode) or seals & SEALS != SEALS \
            or seals & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
        raise ProtocolError(f"peer's {what} is not a memfd sealed against resizing "
                            f"(seals {seals:#x}); refusing to map it")
    if st.st_size < size:
        raise ProtocolError(f"peer's {what} is {st.st_size} bytes, expected {size}")


def _check_eventfd(fd: int) -> None:
    try:
        kind = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        kind = "?"
    if kind != "anon_inode:[eventfd]":
        raise ProtocolError(f"peer's wake-up descriptor is {kind!r}, not an eventfd")
    os.set_blocking(fd, False)      # a wake-up must never block us


def _probe_cma(conn: socket.socket, tp: ShmTransport, peer_pid: int, name: str) -> None:
    """Can each side read the other with CMA? Each reads the other's random probe word
    both ways (CMA and its mapping of the same memory) and says whether they agree.
    Where one side cannot, the staging areas that path needs are exchanged."""
    tp._set_probe(secrets.randbits(64))
    fr.send_frame(conn, {"probe": tp._probe_address()})
    addr = fr.field(fr.recv_frame(conn), "probe", int)
    mine = (cma_allowed() and 0 < addr < 1 << 64
            and cma_probe(peer_pid, addr) == tp._peer_probe_word())
    fr.send_frame(conn, {"cma": mine})
    peers = fr.recv_frame(conn).get("cma")
    if not isinstance(peers, bool):
        raise ProtocolError("handshake field 'cma' missing or not bool")
    _exchange_staging(conn, tp, name, need_mine=not peers, need_peers=not mine)
    tp._set_cma(mine, peers)
    tp._set_assist(*assist_settings())


def _exchange_staging(conn: socket.socket, tp: ShmTransport, name: str, need_mine: bool,
                      need_peers: bool) -> None:
    """Only a side the peer cannot CMA stages copies for it (a sparse memfd of
    RDMAMW_SHM_STAGING bytes that the peer maps read-only): send ours if the peer
    cannot CMA us, receive the peer's if we cannot CMA it. Both sides know both probe
    results, so each knows what to expect."""
    stagefd = -1
    peer_fds: list[int] = []
    try:
        if need_mine:
            stage = staging_bytes()
            stagefd = _sealed_memfd(f"rdmamw-stage-{name}", stage)
            socket.send_fds(conn, [msgpack.packb({"stage": stage})], [stagefd])
        peer_stage = 0
        if need_peers:
            data, peer_fds, _flags, _addr = socket.recv_fds(conn, fr.MAX_HELLO, 1)
            if len(peer_fds) != 1:
                raise ProtocolError(f"peer sent {len(peer_fds)} descriptors for its "
                                    "staging area, expected 1")
            peer_stage = fr.decode(data).get("stage")
            if not isinstance(peer_stage, int) or isinstance(peer_stage, bool) \
                    or not 0 < peer_stage <= 1 << 40:
                raise ProtocolError(f"peer staging area of {peer_stage!r} bytes")
            _check_memfd(peer_fds[0], peer_stage, "staging area")
        tp._attach_staging(stagefd, staging_bytes() if need_mine else 0,
                           peer_fds[0] if peer_fds else -1, peer_stage)
    finally:
        for fd in (stagefd, *peer_fds):
            if fd >= 0:
                os.close(fd)


def _handshake(conn: socket.socket, name: str, slots: int, slot_size: int,
               mode: str | None, peer_pid: int) -> Connected:
    """Exchange hellos and blocks. ``mode`` is given by the opener, None on accept."""
    layout.check_ring(slots, slot_size)
    hello = {"v": fr.PROTOCOL_VERSION, "slots": slots, "slot_size": slot_size, "pid": os.getpid()}
    if mode is not None:
        hello["mode"] = mode
    fr.send_frame(conn, hello)
    peer = fr.recv_frame(conn)
    peer_slots, peer_slot_size, mode = fr.check_hello(peer, fr.PROTOCOL_VERSION, mode)

    mine = layout.endpoint_layout(slots, slot_size, peer_slots)
    theirs = layout.endpoint_layout(peer_slots, peer_slot_size, slots)
    my_total, peer_total = mine.total + XTAB_SPACE, theirs.total + XTAB_SPACE
    staging_bytes()             # a bad RDMAMW_SHM_STAGING fails before the peer waits
    memfd = evfd = pidfd = -1
    peer_fds: list[int] = []
    try:
        memfd = _sealed_memfd(f"rdmamw-shm-{name}", my_total)
        evfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        socket.send_fds(conn, [msgpack.packb({"size": my_total})], [memfd, evfd])
        data, peer_fds, _flags, _addr = socket.recv_fds(conn, fr.MAX_HELLO, 2)
        if len(peer_fds) != 2:
            raise ProtocolError(f"peer sent {len(peer_fds)} descriptors, expected 2")
        info = fr.decode(data)
        if info.get("size") != peer_total:
            raise ProtocolError(f"peer block of {info.get('size')!r} bytes, expected "
                                f"{peer_total}")
        _check_memfd(peer_fds[0], peer_total, "block")
        _check_eventfd(peer_fds[1])
        tp = ShmTransport()
        tp._attach(conn.fileno(), memfd, my_total, peer_fds[0], peer_total, evfd,
                   peer_fds[1], mine.regions(), theirs.regions())
        conn.detach()           # the transport owns the socket now
        evfd = peer_fds[1] = -1  # ... and both eventfds
        try:
            pidfd = os.pidfd_open(peer_pid)
        except (OSError, AttributeError):
            pidfd = -1          # no pidfd here: the socket still tells us of its death
        tp._attach_rendezvous(mine.total, theirs.total, peer_pid, pidfd)
        pidfd = -1
        tp._set_region_id(secrets.randbits(64) | 1)     # never 0: "no regions"
        with socket.socket(fileno=os.dup(tp.fileno())) as side:
            side.settimeout(conn.gettimeout())
            _probe_cma(side, tp, peer_pid, name)
    finally:
        for fd in (memfd, evfd, pidfd, *peer_fds[:1], *peer_fds[1:]):
            if fd >= 0:
                os.close(fd)
    return Connected(tp, slots, slot_size, peer_slots, peer_slot_size, mode, f"shm://{name}")


class ShmListener(HandshakeListener[Connected]):
    """Accepts shm connections on ``shm://NAME``; a peer of another user, or one that
    fails the handshake, is logged and dropped."""

    proves_token = False            # the kernel vouches for the peer (SO_PEERCRED)
    provider = "shm"

    def __init__(self, name: str, slots: int, slot_size: int) -> None:
        layout.check_ring(slots, slot_size)
        self.name, self.slots, self.slot_size = name, slots, slot_size
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(_address(name))
            sock.listen(KERNEL_BACKLOG)
            super().__init__(sock, log)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise RdmamwError(f"shm://{name} is already being listened on") from None
            raise
        except BaseException:
            sock.close()
            raise

    @property
    def address(self) -> str:
        return f"shm://{self.name}"

    def _peer(self, conn: socket.socket, addr) -> str:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return f"pid {pid} (uid {uid})"

    def _handshake(self, conn: socket.socket, addr) -> Connected:
        pid = _check_peer_user(conn)
        return _handshake(conn, self.name, self.slots, self.slot_size, None, pid)


def host_key() -> str:
    """Equal for two processes exactly when shm works between them: same kernel boot
    and same network namespace (shm:// names are abstract sockets, per namespace)."""
    return _host.host_key()


def listen(where: str, *, slots: int, slot_size: int) -> ShmListener:
    return ShmListener(where, slots, slot_size)


def connect(where: str, *, mode: str, timeout: float, slots: int, slot_size: int,
            alive: Callable[[], None] | None = None) -> Connected:
    """Connect to ``shm://where``, retrying until ``timeout`` while nobody listens (and
    ``alive()`` raises nothing: a rank's peer that ended)."""
    addr = _address(where)
    deadline = time.monotonic() + timeout
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            conn.connect(addr)
            break
        except (ConnectionRefusedError, FileNotFoundError):
            conn.close()
            if time.monotonic() >= deadline:
                raise PeerNotFound(f"nobody listens on shm://{where} "
                                   f"(waited {timeout:g} s)") from None
            if alive is not None:
                alive()
            time.sleep(0.01)
        except TimeoutError:
            conn.close()
            raise PeerNotFound(f"shm://{where} did not answer within {timeout:g} s") from None
    try:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        pid = _check_peer_user(conn)
        return _handshake(conn, where, slots, slot_size, mode, pid)
    except TimeoutError:
        conn.close()
        raise Timeout(f"handshake with shm://{where} timed out") from None
    except BaseException:
        if conn.fileno() >= 0:
            conn.close()
        raise


class ShmProvider:
    """shm between processes of one host: inside a host it beats every network
    provider. It advertises nothing: two ranks can use it when their descriptors'
    ``host`` (rdmamw/_host.py) is equal, and a pair meets on a name made from the job
    and the two ranks."""

    scheme = "shm"
    preference = 300
    network = False
    authenticates = False
    #: untuned: a CMA READ is one copy instead of two once a message outgrows the eager slot
    rendezvous_default = {"strategy": READ, "threshold": 64 << 10}
    listen = staticmethod(listen)
    connect = staticmethod(connect)

    def status(self) -> tuple[bool, str]:
        return True, "this host (memfd + eventfd; CMA " + (
            "allowed)" if cma_allowed() else "off: rendezvous through a staging area)")

    def info(self) -> list[str]:
        return []

    def can_connect(self, me: dict, peer: dict) -> tuple[int, str]:
        """shm when both run on one kernel in one network namespace."""
        if me.get("host") == peer.get("host") and isinstance(me.get("host"), str):
            return self.preference, "same host (kernel boot id and network namespace)"
        a, b = sorted((me, peer), key=lambda d: d.get("rank", 0))
        return 0, (f"different hosts ({a.get('hostname')} / {b.get('hostname')}) or "
                   f"network namespaces")

    def check_entry(self, entry: object) -> None:
        return None             # shm has no part in a descriptor

    def advertise(self, advert: Advert) -> tuple[None, None]:
        return None, None

    def connect_rank(self, pair: RankPair, *, mode: str, timeout: float, slots: int,
                     slot_size: int) -> Connected:
        """The lower rank listens on a name of the job and the pair (with the two ranks'
        generations: a re-joined rank's process never meets its predecessor's
        channels), the other connects."""
        (lo, glo), (hi, ghi) = sorted(((pair.me, pair.mine.get("gen", 0)),
                                       (pair.peer, pair.theirs.get("gen", 0))))
        name = f"rdmamw-{pair.job}-{lo}-{hi}" + (f"-g{glo}.{ghi}" if glo or ghi else "")
        if pair.lower:
            lst = listen(name, slots=slots, slot_size=slot_size)
            try:
                return pair.accept_within(lst.accept, timeout)
            finally:
                lst.close()
        return connect(name, mode=mode, timeout=timeout, slots=slots, slot_size=slot_size,
                       alive=pair.check_alive)


PROVIDER = ShmProvider()
