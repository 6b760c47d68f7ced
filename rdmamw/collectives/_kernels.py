"""Chunk consumers handed to Communicator.exchange / relay: reduce or copy a received
chunk straight from the message view into its place (no temporary)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def reducer(op: np.ufunc, left: np.ndarray, out: np.ndarray, base: int) -> Callable:
    """``out[base+i] = op(left[base+i], chunk[i])``; ``left`` may be ``out`` (in place)."""

    def on_chunk(start: int, stop: int, a: np.ndarray) -> None:
        op(left[base + start:base + stop], a, out=out[base + start:base + stop])

    return on_chunk


class Copier:
    """``out[base+i] = chunk[i]``; :meth:`into` names the destination itself, so the
    Communicator can receive a chunk straight into it (a rendezvous chunk is then read
    from the sender's memory into ``out``: one copy instead of two)."""

    __slots__ = ("out", "base")

    def __init__(self, out: np.ndarray, base: int) -> None:
        self.out, self.base = out, base

    def __call__(self, start: int, stop: int, a: np.ndarray) -> None:
        np.copyto(self.out[self.base + start:self.base + stop], a)

    def into(self, start: int, stop: int) -> np.ndarray | None:
        """The destination of elements ``start:stop``, or None if it cannot take a
        receive directly (not contiguous or not writeable)."""
        d = self.out[self.base + start:self.base + stop]
        return d if d.flags.c_contiguous and d.flags.writeable else None


def bounds(n: int, parts: int) -> list[int]:
    """Split ``n`` elements into ``parts`` near-equal contiguous blocks (same on every rank)."""
    return [k * n // parts for k in range(parts + 1)]
