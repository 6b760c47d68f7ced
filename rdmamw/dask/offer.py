"""The listener's offer: how an ``rdmamw://HOST:PORT`` comm moves to the verbs provider
without a second address (docs/dask.md, "Across hosts: the offer").

A Dask address names one port; the verbs provider needs its own side channel. So the
listener also listens on ``verbs://HOST:0`` (pinned to its first usable RDMA port)
when verbs is usable in its process, and every comm it accepts on tcp or verbs starts
with one message of rdmamw's own, the *offer*::

    b"RDO1" + msgpack {"id": bin 16}                              (no verbs here)
    b"RDO1" + msgpack {"id": bin 16, "port": int, "ports": [port]}   (verbs)

``id`` is random per listener; ``port`` is the verbs side channel's TCP port, on the
host the connector already dialed (the offer names no host, so a listener cannot send
a connector anywhere but another port of itself); ``ports`` holds the one RDMA port
it uses, in the form of a bootstrap descriptor's (rdmamw/providers/verbs/rank.py: device, port,
GID index, GID, link layer, fabric). The connector judges it as the bootstrap judges
two ranks (``verbs_rank.pair``: a common fabric), opens the verbs channel with its own
port on that fabric, checks that the offer read there carries the same ``id`` (the
same listener, not whoever holds that port now), and remembers the route
(:class:`Routes`), so later comms to the same Dask address go straight to verbs.

This module is the codec, the listener's and the connector's halves of the judgement,
and the route cache; the comm (rdmamw/dask/comm.py) runs them."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import msgpack

from rdmamw import channel as _sync
from rdmamw import errors as _errors
from rdmamw.providers.verbs import rank as verbs_rank
from rdmamw.transport import wire

log = logging.getLogger("rdmamw.dask")

MAGIC = b"RDO1"
#: the longest offer taken (magic included): one port's descriptor is ~120 bytes
MAX_OFFER = 1024
ID_BYTES = 16
#: what the verbs scheme is called in addresses (the provider registry's name)
SCHEME = "verbs"
#: how many Dask addresses the route cache holds, and how long a failed verbs attempt
#: keeps a target on tcp (seconds) before its offers are tried again
ROUTES = 1024
BACKOFF_S = 60.0
#: test counters (the suite reads them): offers read on tcp comms, comms opened
#: straight on a remembered route
COUNTS = {"offers": 0, "direct": 0}


@dataclass(frozen=True)
class Offer:
    """What a listener offers: its id, and its verbs side channel's port and RDMA port
    (``port`` 0 / ``rdma`` None: no verbs there)."""

    id: bytes
    port: int = 0
    rdma: verbs_rank.Port | None = None


def new_id() -> bytes:
    return os.urandom(ID_BYTES)


def encode(offer: Offer) -> bytes:
    body: dict[str, Any] = {"id": offer.id}
    if offer.rdma is not None:
        body.update(port=offer.port, ports=[offer.rdma.as_dict()])
    return MAGIC + msgpack.packb(body)


def decode(data: bytes) -> Offer:
    """The offer in ``data``, or ProtocolError: it comes from the peer, so every field
    is checked (the RDMA port as the bootstrap checks a descriptor's)."""
    if len(data) > MAX_OFFER:
        raise _errors.ProtocolError(f"an rdmamw:// offer of {len(data)} bytes "
                                    f"(limit {MAX_OFFER})")
    if data[:len(MAGIC)] != MAGIC:
        raise _errors.ProtocolError("not an rdmamw:// offer (bad magic): is the listener "
                                    "an older rdmamw?")
    try:
        body = wire.decode(data[len(MAGIC):])
    except _errors.ProtocolError as e:
        raise _errors.ProtocolError(f"malformed rdmamw:// offer: {e}") from None
    if set(body) not in ({"id"}, {"id", "port", "ports"}):
        raise _errors.ProtocolError(f"offer keys {sorted(map(repr, body))} are not "
                                    f"['id'] or ['id', 'port', 'ports']")
    ident = body["id"]
    if not isinstance(ident, bytes) or len(ident) != ID_BYTES:
        raise _errors.ProtocolError(f"offer id is not {ID_BYTES} bytes")
    if "port" not in body:
        return Offer(ident)
    port, ports = body["port"], body["ports"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise _errors.ProtocolError(f"offer port {port!r} is not 1 .. 65535")
    if not isinstance(ports, list) or len(ports) != 1:
        raise _errors.ProtocolError("offer 'ports' is not a list of one RDMA port")
    try:
        got = verbs_rank.parse({"rank": "(the offer)",
                                "verbs": {"addr": f"{SCHEME}://0.0.0.0:{port}",
                                          "ports": ports}})
    except _errors.ProtocolError as e:
        raise _errors.ProtocolError(f"offer's RDMA port: {e}") from None
    assert not isinstance(got, str)     # an entry with "ports" is never a reason
    return Offer(ident, port, got[1][0])


# ---- the listener's half -------------------------------------------------------------
def listen(host: str, ring: dict, ident: bytes) -> tuple[_sync.Listener | None, Offer]:
    """The verbs listener on ``host`` (port 0) pinned to this host's first usable RDMA
    port, and the offer naming it; (None, an offer without verbs) when verbs is not
    usable here (logged: tcp alone still serves). Blocking: call it in an executor."""
    ports, why = verbs_rank.local_ports()
    if not ports:
        log.debug("no verbs for rdmamw:// here: %s", why)
        return None, Offer(ident)
    p = ports[0]
    where = f"[{host}]" if ":" in host else host
    try:
        lst = _sync.listen(f"{SCHEME}://{where}:0?{_options(p)}", **ring)
    except (_errors.RdmamwError, OSError, ValueError) as e:
        log.info("no verbs listener for rdmamw:// on %s (%s): tcp only", host, e)
        return None, Offer(ident)
    return lst, Offer(ident, int(lst.address.rpartition(":")[2]), p)


def _options(p: verbs_rank.Port) -> str:
    return urlencode({"device": p.dev, "port": p.port, "gid_index": p.gid_index})


# ---- the connector's half ------------------------------------------------------------
def route(host: str, offer: Offer) -> tuple[str | None, str]:
    """(the verbs address to open for ``offer`` from a listener dialed at ``host``,
    "") or (None, why not): the offer names no verbs, or this process has no RDMA
    port on the offered port's fabric (the bootstrap's rule, ``verbs_rank.pair``).
    The address is the dialed host, the offered port and *our* port's options: the
    offer chooses nothing else. Blocking (probes the devices): in an executor."""
    if offer.rdma is None:
        return None, "the listener offers no verbs"
    mine, why = verbs_rank.local_ports()
    if not mine:
        return None, why
    where = f"[{host}]" if ":" in host else host
    theirs = {"rank": 0, "verbs": {"addr": f"{SCHEME}://{where}:{offer.port}",
                                   "ports": [offer.rdma.as_dict()]}}
    me = {"rank": 1, "verbs": {"addr": f"{SCHEME}://0.0.0.0:0",    # we listen nowhere
                               "ports": [p.as_dict() for p in mine]}}
    got = verbs_rank.pair(theirs, me)
    if isinstance(got, str):
        return None, got
    return f"{SCHEME}://{where}:{offer.port}?{_options(got[1])}", ""


class Routes:
    """Dask address -> (verbs address, listener id) used there last, or the time until
    which verbs is not tried there (it failed); least recently used first out."""

    def __init__(self, size: int = ROUTES, backoff: float = BACKOFF_S) -> None:
        self.size, self.backoff = size, backoff
        self._d: OrderedDict[str, tuple[str, bytes] | float] = OrderedDict()

    def direct(self, target: str) -> tuple[str, bytes] | None:
        got = self._d.get(target)
        if isinstance(got, tuple):
            self._d.move_to_end(target)
            return got
        return None

    def blocked(self, target: str) -> bool:
        got = self._d.get(target)
        if isinstance(got, float):
            if time.monotonic() < got:
                return True
            del self._d[target]
        return False

    def remember(self, target: str, address: str, ident: bytes) -> None:
        self._put(target, (address, ident))

    def failed(self, target: str) -> None:
        self._put(target, time.monotonic() + self.backoff)

    def forget(self, target: str) -> None:
        self._d.pop(target, None)

    def _put(self, target: str, value: tuple[str, bytes] | float) -> None:
        self._d[target] = value
        self._d.move_to_end(target)
        while len(self._d) > self.size:
            self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)
