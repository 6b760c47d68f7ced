"""The ``verbs`` provider's control path: a TCP side channel for the handshake.

``verbs://HOST:PORT[?opt=value&...]``: the listener accepts TCP connections there
(port 0 = ephemeral; ``address`` reports the bound one). Both sides first prove the
shared token (rdmamw.auth, as tcp does), then exchange msgpack hellos (ring sizes,
mode), open the RDMA device, create their QP and registered block, then exchange
endpoint descriptors (QPN, PSN, GID, block address, rkey, regions,
version) and move the QP to RTS. The socket then stays open only so each side sees
the other's death as EOF. The wire format is in docs/protocol.md ("verbs connection
set-up"). Options (also from ``RDMAMW_VERBS_*`` environment variables): ``device``,
``port``, ``gid_index``, ``sq_depth``, ``rq_depth``, ``inline``, ``event`` (0/1),
``poll_ms``, ``timeout`` (QP ack timeout exponent)."""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from rdmamw import auth
from rdmamw.errors import (
    PeerNotFound,
    PeerRefused,
    ProtocolError,
    ProviderUnavailable,
    RdmamwError,
    RegistrationError,
    Timeout,
)
from rdmamw.listener import KERNEL_BACKLOG, HandshakeListener
from rdmamw.providers import Connected
from rdmamw.providers.base import Advert, RankPair
from rdmamw.providers.verbs import offer as side
from rdmamw.providers.verbs import probe as dev
from rdmamw.providers.verbs import rank as verbs_rank
from rdmamw.providers.verbs.address import Where, parse_where
from rdmamw.transport import layout
from rdmamw.transport import wire as fr
from rdmamw.vocabulary import READ

log = logging.getLogger("rdmamw.verbs")
DESCRIPTOR_VERSION = 1
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1

@dataclass(frozen=True)
class Pin:
    """The port a connection by rank uses (both ends agree on it from the store's
    descriptors), and the GID the peer's descriptor in the store gave: the peer's
    handshake must show the same one."""

    device: str
    port: int
    gid_index: int
    peer_gid: bytes


def check_descriptor(d: dict, theirs: layout.Layout, stride: int) -> dict:
    """Validate a peer's endpoint descriptor against the layout we computed for it
    (``stride``: of its ring's slots); ProtocolError before anything is read or written."""
    if fr.field(d, "v", int) != DESCRIPTOR_VERSION:
        raise ProtocolError(f"peer descriptor version {d['v']}, we speak {DESCRIPTOR_VERSION}")
    qpn, psn = fr.field(d, "qpn", int), fr.field(d, "psn", int)
    if not (0 < qpn < 1 << 24 and 0 <= psn < 1 << 24):
        raise ProtocolError(f"descriptor qpn {qpn} / psn {psn} out of range (24 bits)")
    gid = fr.field(d, "gid", bytes)
    if len(gid) != 16:
        raise ProtocolError(f"descriptor gid is {len(gid)} bytes, not 16")
    lid, mtu = fr.field(d, "lid", int), fr.field(d, "mtu", int)
    if not (0 <= lid <= 0xFFFF and 1 <= mtu <= 5):
        raise ProtocolError(f"descriptor lid {lid} / mtu {mtu} out of range")
    addr, rkey, length = fr.field(d, "addr", int), fr.field(d, "rkey", int), fr.field(d, "len", int)
    if not (0 < addr <= _U64 and 0 <= rkey <= _U32):
        raise ProtocolError(f"descriptor address {addr:#x} / rkey {rkey:#x} out of range")
    if length != theirs.total or addr + length - 1 > _U64:
        raise ProtocolError(f"descriptor block of {length} bytes at {addr:#x}; the layout "
                            f"says {theirs.total}")
    regions = d.get("regions")
    if regions != [list(r) for r in theirs.regions()]:
        raise ProtocolError(f"descriptor regions {regions!r} differ from the layout "
                            f"{[list(r) for r in theirs.regions()]!r}")
    if not isinstance(d.get("event"), bool):
        raise ProtocolError("descriptor field 'event' missing or not a bool")
    # regions: the peer endpoint's identity (absent, 0: a peer without regions)
    rid = d.setdefault("rid", 0)
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= _U64:
        raise ProtocolError(f"descriptor rid {rid!r} is not a 64-bit identity")
    # a ring that grows: the slots the peer registered at connect (0 or absent: all)
    granted = d.setdefault("granted", 0)
    slots = theirs.ring_len // stride
    if not isinstance(granted, int) or isinstance(granted, bool) or not 0 <= granted <= slots:
        raise ProtocolError(f"descriptor grants {granted!r} ring slots; its ring has {slots}")
    return d


def ring_start_slots(start_bytes: int, slots: int, slot_size: int) -> int:
    """The slots of a ring of ``slots`` registered at connect for RDMAMW_VERBS_RING_START
    = ``start_bytes``: at least one; 0 (the whole ring) when that is all of them."""
    if start_bytes <= 0:
        return 0
    n = max(1, start_bytes // layout.slot_stride(slot_size))
    return 0 if n >= slots else n


#: the longest reason a refusing peer may give that we repeat (it wrote it, not us)
REFUSAL_CHARS = 400


def _refuse(conn: socket.socket, why: str) -> None:
    """Say why in place of our descriptor, before hanging up (the peer proved the token)."""
    try:
        fr.send_frame(conn, {"refused": why[:REFUSAL_CHARS]})
    except OSError:
        pass                        # it went already: nothing to tell


def _unless_refused(frame: dict, peer_name: str) -> dict:
    """The peer's descriptor frame, or PeerRefused with the reason it sent instead."""
    if "refused" in frame:
        why = frame["refused"]
        why = why[:REFUSAL_CHARS] if isinstance(why, str) and why else "no reason given"
        why = "".join(c if c.isprintable() else "?" for c in why)    # the peer wrote it
        raise PeerRefused(f"{peer_name} refused the channel: {why}")
    return frame


def _handshake(conn: socket.socket, w: Where, slots: int, slot_size: int,
               mode: str | None, peer_name: str, rank: int | None = None,
               pin: Pin | Callable[[int | None], Pin] | None = None,
               gen: int = 0) -> Connected:
    """Token check, hellos, then descriptors, then a ready barrier. ``mode`` is None on
    accept. Nothing about us (pid, QP, rkey) crosses before the token check. ``rank``:
    ours, sent in the opener's hello (connections by rank), with ``gen``, our process's
    generation (a re-joined rank's: rdmamw/bootstrap/rejoin.py); ``pin``: the port to
    use and the GID the peer must show, or (accepting) a function of the opener's rank
    giving them."""
    layout.check_ring(slots, slot_size)
    if mode is None:
        auth.accept_side(conn)
    else:
        auth.open_side(conn)
    # "grow": we take grants of the peer's ring (docs/protocol.md "Rings that grow")
    hello = {"v": fr.PROTOCOL_VERSION, "slots": slots, "slot_size": slot_size, "pid": os.getpid(),
             "grow": True}
    if mode is not None:
        hello["mode"] = mode
        if rank is not None:
            hello["rank"] = rank
            if gen:
                hello["gen"] = gen
    fr.send_frame(conn, hello)
    peer = fr.recv_frame(conn)
    peer_slots, peer_slot_size, mode = fr.check_hello(peer, fr.PROTOCOL_VERSION, mode)
    peer_rank, peer_gen = None, 0
    if "rank" in peer:
        peer_rank = fr.field(peer, "rank", int)
        if not 0 <= peer_rank < 1 << 31:
            raise ProtocolError(f"peer claims rank {peer_rank}")
    if "gen" in peer:
        peer_gen = fr.field(peer, "gen", int)
        if not 0 <= peer_gen < 1 << 31:
            raise ProtocolError(f"peer claims generation {peer_gen}")
    if callable(pin):
        pin = pin(peer_rank)
    mine = layout.endpoint_layout(slots, slot_size, peer_slots)
    theirs = layout.endpoint_layout(peer_slots, peer_slot_size, slots)
    o = w.opts
    if pin is not None:
        name, port, gid_index = dev.choose(pin.device, pin.port, pin.gid_index)
    else:
        name, port, gid_index = dev.choose(o["device"], o["port"], o["gid_index"])
    rq = o["rq_depth"] or 2 * (slots + peer_slots) + 64
    # a peer that takes no grants gets the whole ring at once
    granted = ring_start_slots(o["ring_start"], slots, slot_size) if peer.get("grow") is True else 0
    stride, peer_stride = layout.slot_stride(slot_size), layout.slot_stride(peer_slot_size)
    # what this channel registers: our block, the staging copy of the peer's ring and
    # its words (the engine's), for a ring that grows what it starts with; refused
    # before anything is, if the budget has no room
    start = mine.ring + granted * stride if granted else mine.total
    peer_start = min(peer_slots, granted) if granted else peer_slots
    try:
        dev.check_budget(start + peer_start * peer_stride
                         + 2 * layout.PAGE, f"a channel with {peer_name} ({slots} slots of "
                         f"{slot_size} B here, {peer_slots} of {peer_slot_size} B there)")
    except RegistrationError as e:
        _refuse(conn, str(e))       # the peer learns why, instead of waiting its timeout
        raise
    tp = dev.transport_class()()
    try:
        try:
            local = tp._open(name, port, gid_index, mine.total,
                             mine.regions(), o["sq_depth"], rq,
                             o["inline"], bool(o["event"]), o["poll_ms"], o["timeout"],
                             stride, granted, bool(o["windows"]), o["read_chunk"])
        except OSError as e:        # a device limit (max_qp, max_mr) or the driver
            why = f"verbs device {name} port {port}: {e}"
            _refuse(conn, why)      # the peer learns why, not just a reset connection
            raise ProviderUnavailable(why) from None
        psn = int.from_bytes(os.urandom(3), "little")
        # rid: this endpoint's identity in region references (docs/remote-memory.md)
        rid = int.from_bytes(os.urandom(8), "little") or 1
        local.update(v=DESCRIPTOR_VERSION, psn=psn, regions=[list(r) for r in mine.regions()],
                     event=bool(o["event"]), rid=rid)
        del local["inline"]
        fr.send_frame(conn, local)
        d = check_descriptor(_unless_refused(fr.recv_frame(conn), peer_name), theirs,
                             peer_stride)
        if pin is not None and d["gid"] != pin.peer_gid:
            raise ProtocolError(f"{peer_name} shows GID {d['gid'].hex()} in its handshake, "
                                f"but {pin.peer_gid.hex()} in its descriptor in the store")
        try:
            tp._connect(psn, d["qpn"], d["psn"], d["gid"], d["lid"], d["mtu"], d["addr"],
                        d["rkey"], tuple(tuple(r) for r in d["regions"]), d["event"],
                        peer_stride, d["granted"])
        except OSError as e:
            raise PeerNotFound(f"cannot connect the queue pair to {peer_name}: {e}") from None
        tp._set_region_ids(rid, d["rid"])
        # both QPs are in RTR before either side writes
        fr.send_frame(conn, {"ready": True})
        if fr.recv_frame(conn).get("ready") is not True:
            raise ProtocolError("peer did not confirm the queue pair")
    except BaseException:
        tp.close()
        tp = None       # the last reference: QP, CQs and registrations go now
        raise
    conn.settimeout(None)
    tp._attach_socket(conn.detach())
    return Connected(tp, slots, slot_size, peer_slots, peer_slot_size, mode, peer_name,
                     peer_rank, peer_gen)


def _tcp_options(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class VerbsListener(HandshakeListener[Connected]):
    """Accepts verbs connections; the TCP side channel listens on HOST:PORT. A peer
    without the token, or one that fails the handshake, is logged and dropped."""

    provider = "verbs"

    def __init__(self, where: str, slots: int, slot_size: int,
                 pin: Callable[[int | None], Pin] | None = None) -> None:
        layout.check_ring(slots, slot_size)
        self.w = parse_where(where)
        dev.require()
        self.slots, self.slot_size, self.pin = slots, slot_size, pin
        fam = socket.AF_INET6 if ":" in self.w.host else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.w.host, self.w.port))
            sock.listen(KERNEL_BACKLOG)
            self.port = sock.getsockname()[1]
            super().__init__(sock, log)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise RdmamwError(f"verbs://{self.w.host}:{self.w.port} is in use") from None
            raise
        except BaseException:
            sock.close()
            raise

    @property
    def address(self) -> str:
        host = f"[{self.w.host}]" if ":" in self.w.host else self.w.host
        return f"verbs://{host}:{self.port}"

    def _handshake(self, conn: socket.socket, addr) -> Connected:
        _tcp_options(conn)
        return _handshake(conn, self.w, self.slots, self.slot_size, None,
                          f"verbs://{self._peer(conn, addr)}", pin=self.pin)


def listen(where: str, *, slots: int, slot_size: int,
           pin: Callable[[int | None], Pin] | None = None) -> VerbsListener:
    """Listen on ``verbs://where``; ``pin`` (bootstrap) gives the port and the GID to
    expect for each opener's rank."""
    return VerbsListener(where, slots, slot_size, pin)


def connect(where: str, *, mode: str, timeout: float, slots: int, slot_size: int,
            rank: int | None = None, pin: Pin | None = None, gen: int = 0,
            alive: Callable[[], None] | None = None) -> Connected:
    """Connect to ``verbs://where``, retrying until ``timeout`` while nobody listens
    (and ``alive()`` raises nothing: a rank's peer that ended); ``rank``, ``pin`` and
    ``gen`` for a connection by rank (bootstrap)."""
    w = parse_where(where)
    dev.require()
    deadline = time.monotonic() + timeout
    name = f"verbs://{where.partition('?')[0]}"
    while True:
        try:
            conn = socket.create_connection((w.host, w.port),
                                            timeout=max(0.01, deadline - time.monotonic()))
            break
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                raise PeerNotFound(f"nobody listens on {name} (waited {timeout:g} s)") from None
            if alive is not None:
                alive()
            time.sleep(0.01)
        except TimeoutError:
            raise PeerNotFound(f"{name} did not answer within {timeout:g} s") from None
        except OSError as e:
            raise PeerNotFound(f"cannot reach {name}: {e}") from None
    try:
        _tcp_options(conn)
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        return _handshake(conn, w, slots, slot_size, mode, name, rank, pin, gen)
    except TimeoutError:
        raise Timeout(f"handshake with {name} timed out") from None
    finally:
        if conn.fileno() >= 0:
            conn.close()


def pin(me: int, mine: dict, peer: int, theirs: dict) -> Pin:
    """The port a verbs channel between rank ``me`` and rank ``peer`` uses on my side,
    and the GID the peer's handshake must show (from the two descriptors, so both
    sides agree); ProtocolError if they share no fabric."""
    lower, higher = (mine, theirs) if me < peer else (theirs, mine)
    got = verbs_rank.pair(lower, higher)
    if isinstance(got, str):
        raise ProtocolError(f"no verbs channel between rank {me} and rank {peer}: {got}")
    my_port, their_port = got if me < peer else got[::-1]
    return Pin(my_port.dev, my_port.port, my_port.gid_index, their_port.gid)


class VerbsProvider:
    """verbs (RC queue pairs) between ranks on a common RDMA fabric: across hosts it
    beats tcp, inside a host shm beats it. Its descriptor part lists the usable ports
    and the side-channel listener's address (rdmamw/providers/verbs/rank.py)."""

    scheme = "verbs"
    preference = verbs_rank.PREFERENCE
    network = True
    authenticates = True
    #: untuned: READ avoids the receiver's advertisement round trip (docs/design.md)
    rendezvous_default = {"strategy": READ, "threshold": 64 << 10}
    connect = staticmethod(connect)

    def listen(self, where: str, *, slots: int, slot_size: int) -> VerbsListener:
        return listen(where, slots=slots, slot_size=slot_size)

    def pinned_budget(self) -> int:
        """The process's budget of registered bytes (RDMAMW_VERBS_PINNED_BYTES or half
        the memory, within ``ulimit -l``): the channel layer keeps its registration
        caches well inside it."""
        return dev.pinned_budget()

    def status(self) -> tuple[bool, str]:
        return dev.status()

    def info(self) -> list[str]:
        from rdmamw.providers.verbs import info as verbs_info
        loaded, lib = dev.library()
        return [f"libibverbs: {'loaded from ' if loaded else 'not loaded: '}{lib}",
                "RDMA devices (pyverbs):", *(f"  {line}" for line in verbs_info.describe())]

    def can_connect(self, me: dict, peer: dict) -> tuple[int, str]:
        """verbs when the two ranks share a fabric (rdmamw/providers/verbs/rank.py)."""
        return verbs_rank.can_connect(me, peer)

    def check_entry(self, entry: object) -> None:
        if not isinstance(entry, dict):
            raise ProtocolError(f"descriptor has a bad verbs entry {entry!r}")

    def advertise(self, advert: Advert) -> tuple[dict, VerbsListener | None]:
        def pin_rank(rank: int | None) -> Pin:
            mine, theirs = advert.peers(rank)
            return pin(mine["rank"], mine, theirs["rank"], theirs)

        return verbs_rank.advertise(advert.ip, advert.slots, advert.slot_size, pin_rank,
                                    listen)

    # the optional side-channel offer (base.py; rdmamw/providers/verbs/offer.py)
    offer_keys = side.KEYS
    offer_address = staticmethod(side.address)
    offer_part = staticmethod(side.part)
    offer_fields = staticmethod(side.fields)
    offer_parse = staticmethod(side.parse)
    offer_route = staticmethod(side.route)

    def connect_rank(self, pair: RankPair, *, mode: str, timeout: float, slots: int,
                     slot_size: int) -> Connected:
        """The lower rank accepts on its listener (the pin checks who comes); the other
        connects to the address in its descriptor with the port both chose."""
        if pair.lower:
            return pair.accept_within(pair.accept, timeout)
        addr, _ports = verbs_rank.parse(pair.theirs)      # type: ignore[misc]
        return connect(addr.partition("://")[2], mode=mode, timeout=timeout, slots=slots,
                       slot_size=slot_size, rank=pair.me,
                       pin=pin(pair.me, pair.mine, pair.peer, pair.theirs),
                       gen=pair.mine.get("gen", 0), alive=pair.check_alive)


PROVIDER = VerbsProvider()
