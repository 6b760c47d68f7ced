"""verbs' half of a side-channel offer (the optional ``offer_*`` methods of
:class:`rdmamw.providers.base.Provider`): how a connection that began on another
provider (the ``rdmamw://`` Dask comm's base, rdmamw/dask/offer.py) moves to verbs.

The listener listens on ``verbs://HOST:0`` pinned to this host's first usable RDMA
port and offers ``{"port": int, "ports": [that port]}``: the side channel's TCP port
on the host the connector already dialed, and the RDMA port in the form of a bootstrap
descriptor's (rank.py). The connector judges it as the bootstrap judges two ranks
(``rank.pair``: a common fabric) and opens the side channel with its own port on that
fabric (docs/dask.md, "Across hosts: the offer")."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from rdmamw import errors as _errors
from rdmamw.providers.verbs import rank as verbs_rank

log = logging.getLogger("rdmamw.dask")

SCHEME = "verbs"
#: the fields of an offer of verbs
KEYS = frozenset({"port", "ports"})


@dataclass(frozen=True)
class SideOffer:
    """What a verbs offer names: the side channel's TCP port and the RDMA port it is
    pinned to."""

    port: int
    rdma: verbs_rank.Port


def _options(p: verbs_rank.Port) -> str:
    return urlencode({"device": p.dev, "port": p.port, "gid_index": p.gid_index})


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def address(host: str) -> tuple[str | None, object]:
    """(the address to listen on beside a comm listening at ``host``, the RDMA port it
    pins) or (None, why verbs is not usable here)."""
    ports, why = verbs_rank.local_ports()
    if not ports:
        return None, why
    p = ports[0]
    return f"{SCHEME}://{_host(host)}:0?{_options(p)}", p


def part(bound: str, token: object) -> SideOffer:
    """The offer of the side listener bound at ``bound`` (from :func:`address`)."""
    assert isinstance(token, verbs_rank.Port)
    return SideOffer(int(bound.rpartition(":")[2]), token)


def fields(offer: SideOffer) -> dict[str, Any]:
    return {"port": offer.port, "ports": [offer.rdma.as_dict()]}


def parse(body: dict[str, Any]) -> SideOffer:
    """The offer's verbs fields checked (they come from the peer), else ProtocolError."""
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
    return SideOffer(port, got[1][0])


def route(host: str, offer: SideOffer) -> tuple[str | None, str]:
    """(the verbs address to open for ``offer`` from a listener dialed at ``host``,
    "") or (None, why not): this process has no RDMA port on the offered port's fabric
    (the bootstrap's rule, ``rank.pair``). The address is the dialed host, the offered
    port and *our* port's options: the offer chooses nothing else. Blocking (probes the
    devices): in an executor."""
    mine, why = verbs_rank.local_ports()
    if not mine:
        return None, why
    where = _host(host)
    theirs = {"rank": 0, "verbs": {"addr": f"{SCHEME}://{where}:{offer.port}",
                                   "ports": [offer.rdma.as_dict()]}}
    me = {"rank": 1, "verbs": {"addr": f"{SCHEME}://0.0.0.0:0",    # we listen nowhere
                               "ports": [p.as_dict() for p in mine]}}
    got = verbs_rank.pair(theirs, me)
    if isinstance(got, str):
        return None, got
    return f"{SCHEME}://{where}:{offer.port}?{_options(got[1])}", ""
