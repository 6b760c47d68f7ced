"""What a provider is, to the layers above it: one declared object per provider.

As NCCL's transports answer ``canConnect`` / ``setup`` / ``connect`` / ``free``, each
provider module here exposes ``PROVIDER``, an object with the attributes and methods of
:class:`Provider`. The channel layer, the bootstrap, ``rdmamw info`` and ``rdmamw perf``
use only these and never name a provider; ``rdmamw.providers`` keeps the registry
(docs/architecture.md, "Where a newcomer adds a provider")."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rdmamw.errors import PeerLost, Timeout

#: how often a rank waiting to connect looks whether its peer's process ended
ALIVE_SLICE = 0.05


def _unknown() -> str | None:
    return None


@dataclass
class Connected:
    """A connected transport plus the ring parameters both sides agreed on."""

    transport: Any
    slots: int
    slot_size: int
    peer_slots: int
    peer_slot_size: int
    mode: str
    peer: str
    peer_rank: int | None = None    # the opener's rank, when it gave one (bootstrap)
    #: the opener's generation (a re-joined rank's process: rdmamw/bootstrap/rejoin.py)
    peer_gen: int = 0


@runtime_checkable
class Listener(Protocol):
    """What ``Provider.listen`` returns: connections arrive through ``accept``."""

    @property
    def address(self) -> str: ...

    def accept(self, timeout: float | None) -> Connected: ...

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Advert:
    """What a provider gets to make its part of a rank's bootstrap descriptor.

    ``ip``: the address this rank is reached at (the launcher's interface or
    ``RDMAMW_SOCKET_IFNAME``'s); ``slots``/``slot_size``: the ring of channels opened by
    rank; ``peers(rank)``: (my descriptor, that rank's descriptor) once the job's table
    is known, for a listener that must judge who connects (ProtocolError before, or for
    a rank that is not in the job)."""

    ip: str
    slots: int
    slot_size: int
    peers: Callable[[int | None], tuple[dict, dict]]


@dataclass(frozen=True)
class RankPair:
    """Two ranks of one job about to open a channel over a provider both chose.

    ``mine`` / ``theirs``: the two bootstrap descriptors (each provider's part is under
    its scheme); ``accept(timeout)``: the next connection of this provider from
    ``peer`` on the listener this rank advertised (the lower rank of a pair accepts)."""

    job: str
    me: int
    peer: int
    mine: dict
    theirs: dict
    accept: Callable[[float], Connected]
    #: why the peer's process has certainly ended, else None (rdmamw._host.ended: on
    #: one host only; elsewhere the deadline decides)
    gone: Callable[[], str | None] = field(default=_unknown)

    @property
    def lower(self) -> bool:
        """This rank accepts (the lower rank of a pair), the other connects."""
        return self.me < self.peer

    def check_alive(self) -> None:
        """PeerLost once the peer's process ended: a wait for it to connect or listen
        stops there, not at its deadline (a member that died after a shrink agreed on
        it is named at once by the next collective's channel)."""
        why = self.gone()
        if why:
            raise PeerLost(f"rank {self.peer} will not connect: {why}")

    def accept_within(self, accept: Callable[[float], Connected],
                      timeout: float) -> Connected:
        """``accept(timeout)`` in slices, looking between them whether the peer is
        gone."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                return accept(max(0.0, min(left, ALIVE_SLICE)))
            except Timeout:
                if left <= ALIVE_SLICE:
                    raise
            self.check_alive()


@runtime_checkable
class Provider(Protocol):
    """One provider, as the layers above see it.

    ``scheme`` names its addresses (``scheme://where``); ``preference`` ranks it when
    two ranks could use several (shm 300 > verbs 200 > tcp 100: the highest that
    ``can_connect`` wins); ``network`` says its addresses are ``HOST:PORT`` and it
    reaches other hosts (``rdmamw perf`` takes the best usable one by default);
    ``authenticates`` says its connections prove the job's token (rdmamw.auth), so
    ``listen`` and ``open`` check for a usable token first; ``rendezvous_default``:
    the strategy and threshold of large messages while nothing was tuned
    (``{"strategy": "read", "threshold": 65536}``; rdmamw/memory/thresholds.py)."""

    scheme: str
    preference: int
    network: bool
    authenticates: bool
    rendezvous_default: dict

    def status(self) -> tuple[bool, str]:
        """(usable in this process, what it runs on or why not): ``rdmamw info``."""
        ...

    def info(self) -> list[str]:
        """More lines for ``rdmamw info`` (libraries loaded, devices seen)."""
        ...

    def can_connect(self, me: dict, peer: dict) -> tuple[int, str]:
        """(preference, why) for a channel between the ranks of two bootstrap
        descriptors; 0: it cannot. A pure function of the two descriptors, so both
        ranks of a pair decide the same without a round trip."""
        ...

    def check_entry(self, entry: Any) -> None:
        """Raise ProtocolError if ``entry``, this provider's part of a descriptor read
        from the bootstrap store, is malformed (it came from another process)."""
        ...

    def advertise(self, advert: Advert) -> tuple[Any, Listener | None]:
        """This rank's descriptor part (None: none) and the listener it names, if any;
        ProviderUnavailable when the provider cannot take part here (the bootstrap then
        stores ``{"why": reason}`` as the part)."""
        ...

    def listen(self, where: str, *, slots: int, slot_size: int) -> Listener:
        """A listener on ``scheme://where``."""
        ...

    def connect(self, where: str, *, mode: str, timeout: float, slots: int,
                slot_size: int) -> Connected:
        """A connection to ``scheme://where``, retrying until ``timeout`` while nobody
        listens."""
        ...

    def connect_rank(self, pair: RankPair, *, mode: str, timeout: float, slots: int,
                     slot_size: int) -> Connected:
        """A connection between the two ranks of ``pair`` (both call it)."""
        ...


class Offers(Protocol):
    """Optional: a side channel offered beside a connection that began on another
    provider (the ``rdmamw://`` Dask comm starts every comm on its base provider and
    its listener *offers* this one: rdmamw/dask/offer.py, docs/dask.md). A provider
    without these methods is simply never offered. The offer is a map of
    ``offer_keys`` (plain msgpack values) that a peer's process checks with
    ``offer_parse``; the listener's and the connector's halves of the judgement are
    ``offer_address``/``offer_part`` and ``offer_route``."""

    offer_keys: frozenset[str]

    def offer_address(self, host: str) -> tuple[str | None, Any]:
        """(the address to listen on beside a listener at ``host``, a token for
        ``offer_part``) or (None, why this provider cannot be offered here)."""
        ...

    def offer_part(self, bound: str, token: Any) -> Any:
        """The offer of the side listener that bound ``bound`` (its address)."""
        ...

    def offer_fields(self, part: Any) -> dict:
        """``part`` as the offer's fields (exactly ``offer_keys``)."""
        ...

    def offer_parse(self, fields: dict) -> Any:
        """The part of the fields (exactly ``offer_keys``) a peer sent, checked:
        ProtocolError saying what is wrong."""
        ...

    def offer_route(self, host: str, part: Any) -> tuple[str | None, str]:
        """(the address this process opens for ``part``, offered by a listener dialed
        at ``host``, "") or (None, why it cannot: the ``can_connect`` judgement).
        Blocking: called in an executor."""
        ...


#: the attributes and methods every provider object has (tests/providers/test_provider_shape.py)
REQUIRED = ("scheme", "preference", "network", "authenticates", "rendezvous_default",
            "status", "info",
            "can_connect", "check_entry", "advertise", "listen", "connect", "connect_rank")


#: the optional methods of a provider that can be offered (:class:`Offers`): all or none
OFFERS = ("offer_keys", "offer_address", "offer_part", "offer_fields", "offer_parse",
          "offer_route")


def offers(obj: Any) -> bool:
    """Whether ``obj`` has the optional :class:`Offers` methods (all of them)."""
    return all(hasattr(obj, n) for n in OFFERS)


def missing(obj: Any) -> list[str]:
    """The names of :class:`Provider` that ``obj`` lacks (empty: it is one)."""
    gone = [n for n in REQUIRED if not hasattr(obj, n)]
    some = [n for n in OFFERS if hasattr(obj, n)]
    if some and len(some) < len(OFFERS):       # the optional ones come all together
        gone += [n for n in OFFERS if not hasattr(obj, n)]
    return gone
