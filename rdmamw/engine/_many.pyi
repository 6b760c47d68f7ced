"""Stub of rdmamw/engine/_many.pyx: many small messages per call with O(1) Python
objects (Channel.send_many / Channel.recv_many_into). Checked against the compiled
module by stubtest (`make lint`)."""

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy.typing as npt
from _typeshed import ReadableBuffer

from rdmamw.engine._engine import Engine
from rdmamw.engine._messages import SendHandle, _Destination, _Source

#: the lengths of the messages of a send_many: an integer array (any integer buffer)
#: or a sequence of ints
_Sizes: TypeAlias = ReadableBuffer | npt.NDArray[Any] | Sequence[int]

def send_many(
    ch: Engine,
    data: _Source,
    sizes: _Sizes | None = None,
    *,
    size: int | None = None,
    timeout: float | None = None,
) -> SendHandle:
    """Send ``data`` as consecutive messages of the lengths ``sizes`` gives (or all of
    ``size`` bytes): one batch, one handle, as send_batch of the slices."""

def recv_many_into(
    ch: Engine,
    buffer: _Destination,
    lengths: npt.NDArray[Any] | _Destination,
    timeout: float | None = None,
) -> int:
    """Copy the messages that have arrived into ``buffer``, back to back, and their
    lengths into ``lengths``; how many (at least one)."""
