"""Transports below the mini-verbs interface (rdmamw/transport/_base.pxd).

Each provider module offers ``listen(where, **ring) -> listener`` with
``listener.accept(timeout) -> Connected`` and ``connect(where, mode, timeout, **ring)
-> Connected``; the channel layer turns a :class:`Connected` into a Channel."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from rdmamw.errors import ProviderUnavailable

#: scheme -> module providing it; the ones not built yet say so instead of importing.
PROVIDERS = {
    "shm": "rdmamw.providers.shm",
    "tcp": "rdmamw.providers.tcp",
    "verbs": "rdmamw.providers.verbs",
}
PLANNED: dict[str, str] = {}


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


def provider(scheme: str):
    """The provider module for ``scheme``, or a clear error."""
    if scheme in PROVIDERS:
        return importlib.import_module(PROVIDERS[scheme])
    if scheme in PLANNED:
        raise ProviderUnavailable(f"{PLANNED[scheme]} ({scheme}://) is not in this build yet")
    known = ", ".join(f"{s}://" for s in (*PROVIDERS, *PLANNED))
    raise ValueError(f"unknown transport {scheme!r}; known: {known}")
