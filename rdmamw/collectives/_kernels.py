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


def copier(out: np.ndarray, base: int) -> Callable:
    """``out[base+i] = chunk[i]``."""

    def on_chunk(start: int, stop: int, a: np.ndarray) -> None:
        np.copyto(out[base + start:base + stop], a)

    return on_chunk


def bounds(n: int, parts: int) -> list[int]:
    """Split ``n`` elements into ``parts`` near-equal contiguous blocks (same on every rank)."""
    return [k * n // parts for k in range(parts + 1)]
