"""Which process owns a channel, listener or cache, checked without a system call.

After ``fork`` the child inherits every channel, but the connection, the shared
memory and the peer still belong to the parent (PyTorch's DataLoader forks workers
while the parent keeps training). So each object records the pid that set it up, and
compares it with :func:`pid`, a cached ``getpid()`` that ``os.register_at_fork``
refreshes in the child: one integer compare on the hot path, as pyzmq and redis-py do.
Modules with process-wide state register with :func:`at_child` to reset it there."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NoReturn

from rdmamw.errors import InheritedChannel

_pid = os.getpid()
_hooks: list[Callable[[], None]] = []


def pid() -> int:
    """This process's pid (cached; right in a fork child too)."""
    return _pid


def at_child(hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook()`` in every fork child, after the pid is refreshed (in
    registration order). Usable as a decorator."""
    _hooks.append(hook)
    return hook


def refuse(what: str, owner: int) -> NoReturn:
    """Raise the error a child gets when it uses what its parent set up."""
    raise InheritedChannel(
        f"this {what} belongs to process {owner}, the parent of this fork; a child "
        f"process cannot use it (it would break the parent's connection): open a new "
        f"channel in the child instead")


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()
    for hook in _hooks:
        hook()


os.register_at_fork(after_in_child=_after_fork_in_child)
