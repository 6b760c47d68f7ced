"""Pinned memory short: who can let some go. A provider whose budget of registered
(pinned) bytes has no room calls :func:`relieve` before it refuses; the layers above
that hold idle registrations (the channel's registration caches) are registered here
by the layer that knows both (rdmamw.channel), so a provider never imports them."""

from __future__ import annotations

from collections.abc import Callable

_relievers: list[Callable[[int], int]] = []


def add_reliever(fn: Callable[[int], int]) -> None:
    """``fn(need)`` frees up to ``need`` registered bytes it holds idle and returns how
    many it freed; it must not wait for another thread (it may run under a provider's
    or a cache's lock)."""
    if fn not in _relievers:
        _relievers.append(fn)


def relieve(need: int) -> int:
    """Ask every reliever, in the order added, until ``need`` bytes are freed; the
    bytes freed."""
    freed = 0
    for fn in list(_relievers):
        if freed >= need:
            break
        freed += fn(need - freed)
    return freed
