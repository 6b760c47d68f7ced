"""Transports below the mini-verbs interface (rdmamw/transport/_base.pxd), and the
registry of the providers that make them.

A provider is one object (:class:`rdmamw.providers.base.Provider`): its scheme,
preference, ``can_connect``, descriptor part, listen / connect / connect by rank,
status and info. The built-in ones are ``PROVIDER`` in the modules of ``BUILTIN``;
more come from :func:`register` or from ``RDMAMW_PROVIDER_PLUGINS`` (``module`` or
``module:attr``, comma-separated, imported on first use in every process of a job).
Everything above asks this registry and never names a provider."""

from __future__ import annotations

import importlib
import threading

from rdmamw import config
from rdmamw.errors import ConfigError, ProviderUnavailable
from rdmamw.providers.base import Connected, Provider, missing

#: scheme -> the module whose ``PROVIDER`` it is (imported when first asked for)
BUILTIN = {
    "shm": "rdmamw.providers.shm.provider",
    "tcp": "rdmamw.providers.tcp.provider",
    "verbs": "rdmamw.providers.verbs.provider",
}

_registered: dict[str, Provider] = {}
_plugins_loaded: str | None = None
_lock = threading.RLock()


def register(p: Provider) -> Provider:
    """Add a provider (or replace the one of its scheme); returns it. A provider made
    outside the package registers itself this way, or through
    ``RDMAMW_PROVIDER_PLUGINS`` so that every rank of a job has it."""
    gone = missing(p)
    if gone:
        raise TypeError(f"{p!r} is not a provider: it has no {', '.join(gone)}")
    if not (isinstance(p.scheme, str) and p.scheme.isidentifier()):
        raise ValueError(f"provider scheme {p.scheme!r} is not a plain name")
    if not (isinstance(p.preference, int) and p.preference > 0):
        raise ValueError(f"provider {p.scheme}: preference {p.preference!r} is not a "
                         f"positive int")
    with _lock:
        _registered[p.scheme] = p
    return p


def unregister(scheme: str) -> None:
    """Forget a provider added by :func:`register` (the built-in ones come back)."""
    with _lock:
        _registered.pop(scheme, None)


def _load_plugins() -> None:
    """Import the modules RDMAMW_PROVIDER_PLUGINS names (again when it changed)."""
    global _plugins_loaded
    spec = config.get("RDMAMW_PROVIDER_PLUGINS")
    if spec == _plugins_loaded:
        return
    with _lock:
        for item in filter(None, (s.strip() for s in spec.split(","))):
            mod_name, _, attr = item.partition(":")
            try:
                mod = importlib.import_module(mod_name)
            except ImportError as e:
                raise ConfigError(f"RDMAMW_PROVIDER_PLUGINS: cannot import {mod_name!r}: "
                                  f"{e}") from e
            obj = getattr(mod, attr or "PROVIDER", None)
            if obj is None:
                raise ConfigError(f"RDMAMW_PROVIDER_PLUGINS: {mod_name} has no "
                                  f"{attr or 'PROVIDER'}")
            try:
                register(obj)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"RDMAMW_PROVIDER_PLUGINS: {item}: {e}") from e
        _plugins_loaded = spec


def schemes() -> list[str]:
    """Every provider's scheme: the built-in ones, then the registered ones."""
    _load_plugins()
    return list(dict.fromkeys([*BUILTIN, *_registered]))


def provider(scheme: str) -> Provider:
    """The provider of ``scheme``, or ValueError naming the known ones."""
    _load_plugins()
    got = _registered.get(scheme)
    if got is not None:
        return got
    if scheme in BUILTIN:
        return importlib.import_module(BUILTIN[scheme]).PROVIDER
    known = ", ".join(f"{s}://" for s in schemes())
    raise ValueError(f"unknown transport {scheme!r}; known: {known}")


def providers() -> list[Provider]:
    """Every provider object, in the order of :func:`schemes`."""
    return [provider(s) for s in schemes()]


def best(network: bool = False) -> Provider:
    """The usable provider of the highest preference (``network``: only those that
    reach other hosts): what a tool picks when the user names none."""
    usable = [p for p in providers() if (p.network or not network) and p.status()[0]]
    if not usable:
        raise ProviderUnavailable("no provider is usable here: " + "; ".join(
            f"{p.scheme}: {p.status()[1]}" for p in providers()))
    return max(usable, key=lambda p: p.preference)


def local_address(scheme: str, name: str) -> str:
    """An address to listen on for a peer on this host: ``scheme://name`` for a
    provider whose addresses are names, loopback with an ephemeral port for a network
    one (its listener reports the port it bound)."""
    return f"{scheme}://127.0.0.1:0" if provider(scheme).network else f"{scheme}://{name}"


__all__ = ["BUILTIN", "Connected", "Provider", "best", "local_address", "provider",
           "providers", "register", "schemes", "unregister"]
