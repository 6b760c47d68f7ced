"""Gradients weighted by the samples behind them.

Each worker's gradient is the mean over its own share, so the mean over the whole
batch is ``sum_w n_w * g_w / sum_w n_w``: with unequal shares a plain average of
the workers' gradients would over-weight the straggler's few samples. The server
accumulates ``n_w * g_w`` and divides by ``sum n_w`` when the round closes; this is
the same rule for a list in memory (and the reference the tests compare with)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def weighted_mean(parts: Iterable[tuple[int, np.ndarray]]) -> np.ndarray:
    """``sum n * g / sum n`` over ``(n, g)`` pairs; every ``n`` must be >= 0 and their
    sum > 0."""
    acc: np.ndarray | None = None
    total = 0
    for n, g in parts:
        if n < 0:
            raise ValueError(f"negative sample count {n}")
        acc = n * np.asarray(g, dtype=np.float64) if acc is None else acc + n * g
        total += n
    if acc is None or total <= 0:
        raise ValueError("no samples to average over")
    return acc / total
