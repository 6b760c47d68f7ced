"""The listener's offer: how an ``rdmamw://HOST:PORT`` comm moves to a faster network
provider without a second address (docs/dask.md, "Across hosts: the offer").

A Dask address names one port, of the comm's base provider; another network provider
needs its own side channel. So the listener also listens beside it on the first
provider, by preference, that can be offered here (the optional ``offer_*`` methods of
:class:`rdmamw.providers.base.Provider`; the built-in one is verbs, pinned to its first
usable RDMA port), and every comm it accepts on the base provider or the side channel
starts with one message of rdmamw's own, the *offer*::

    b"RDO1" + msgpack {"id": bin 16}                            (nothing offered)
    b"RDO1" + msgpack {"id": bin 16, **the provider's fields}    (e.g. verbs: "port",
                                                                  "ports")

``id`` is random per listener. Which provider an offer names is told by its fields
(each offerable provider's ``offer_keys``); the provider checks them
(``offer_parse``) and judges, in the connector, whether this process can reach the side
channel and at which address (``offer_route``: the bootstrap's ``can_connect`` rule,
on the host the connector already dialed, so a listener cannot send a connector
anywhere but another port of itself). The connector checks that the offer read on the
side channel carries the same ``id`` (the same listener, not whoever holds that port
now), and remembers the route (:class:`Routes`), so later comms to the same Dask
address go straight to the side channel.

This module is the codec, the listener's and the connector's halves (asking the
provider registry, naming no provider), and the route cache; the comm
(rdmamw/dask/comm.py) runs them."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack

from rdmamw import channel as _sync
from rdmamw import errors as _errors
from rdmamw import providers as _registry
from rdmamw.providers import base as _base
from rdmamw.transport import wire

log = logging.getLogger("rdmamw.dask")

MAGIC = b"RDO1"
#: the longest offer taken (magic included): one RDMA port's descriptor is ~120 bytes
MAX_OFFER = 1024
ID_BYTES = 16
#: how many Dask addresses the route cache holds, and how long a failed side-channel
#: attempt keeps a target on the base provider (seconds) before its offers are tried
#: again
ROUTES = 1024
BACKOFF_S = 60.0
#: test counters (the suite reads them): offers read on base comms, comms opened
#: straight on a remembered route
COUNTS = {"offers": 0, "direct": 0}


@dataclass(frozen=True)
class Offer:
    """What a listener offers: its id, and the provider of its side channel with that
    provider's part of the offer (``scheme`` None: nothing offered)."""

    id: bytes
    scheme: str | None = None
    part: Any = None


def new_id() -> bytes:
    return os.urandom(ID_BYTES)


def offerable(base: str | None = None) -> list[Any]:
    """The registered providers that can be offered beside a comm of ``base`` (network
    ones with the optional offer methods), highest preference first."""
    got = [p for p in _registry.providers()
           if p.network and p.scheme != base and _base.offers(p)]
    return sorted(got, key=lambda p: -p.preference)


def encode(offer: Offer) -> bytes:
    body: dict[str, Any] = {"id": offer.id}
    if offer.scheme is not None:
        p: Any = _registry.provider(offer.scheme)      # one that offers (_base.offers)
        body.update(p.offer_fields(offer.part))
    return MAGIC + msgpack.packb(body)


def decode(data: bytes) -> Offer:
    """The offer in ``data``, or ProtocolError: it comes from the peer, so every field
    is checked (by the provider whose fields they are)."""
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
    rest = set(body) - {"id"}
    by_keys = {frozenset(p.offer_keys): p for p in offerable()}
    if "id" not in body or (rest and frozenset(rest) not in by_keys):
        shapes = " or ".join(str(["id", *sorted(k)]) for k in by_keys)
        raise _errors.ProtocolError(f"offer keys {sorted(map(repr, body))} are not "
                                    f"['id']{' or ' + shapes if shapes else ''}")
    ident = body["id"]
    if not isinstance(ident, bytes) or len(ident) != ID_BYTES:
        raise _errors.ProtocolError(f"offer id is not {ID_BYTES} bytes")
    if not rest:
        return Offer(ident)
    p = by_keys[frozenset(rest)]
    return Offer(ident, p.scheme, p.offer_parse({k: body[k] for k in rest}))


# ---- the listener's half -------------------------------------------------------------
def listen(host: str, ring: dict, ident: bytes, base: str | None = None
           ) -> tuple[_sync.Listener | None, Offer]:
    """The side listener on ``host`` (port 0) of the first provider that can be offered
    here, and the offer naming it; (None, an offer of nothing) when none can (logged:
    the base provider alone still serves). Blocking: call it in an executor."""
    for p in offerable(base):
        where, token = p.offer_address(host)
        if where is None:
            log.debug("no %s for rdmamw:// here: %s", p.scheme, token)
            continue
        try:
            lst = _sync.listen(where, **ring)
        except (_errors.RdmamwError, OSError, ValueError) as e:
            log.info("no %s listener for rdmamw:// on %s (%s)", p.scheme, host, e)
            continue
        return lst, Offer(ident, p.scheme, p.offer_part(lst.address, token))
    return None, Offer(ident)


# ---- the connector's half ------------------------------------------------------------
def route(host: str, offer: Offer) -> tuple[str | None, str]:
    """(the address to open for ``offer`` from a listener dialed at ``host``, "") or
    (None, why not): the offer names nothing, or this process cannot reach it (the
    offered provider's judgement). Blocking (may probe devices): in an executor."""
    if offer.scheme is None:
        return None, "the listener offers no side channel"
    try:
        p: Any = _registry.provider(offer.scheme)
    except ValueError as e:
        return None, str(e)
    return p.offer_route(host, offer.part)


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
