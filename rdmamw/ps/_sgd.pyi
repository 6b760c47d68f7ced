"""Stub of rdmamw/ps/_sgd.pyx: the servers' fused SGD loops over float32 or float64
contiguous arrays (one dtype per call). Checked by stubtest (`make lint`)."""

from typing import Any

import numpy as np
import numpy.typing as npt

_Real = npt.NDArray[np.floating[Any]]

def step(
    w: _Real,
    v: _Real,
    g: _Real,
    scale: float,
    lr: float,
    momentum: float,
    dc: float,
    bak: _Real | None = None,
) -> None:
    """v = momentum v + scale (g + dc g g (w - bak)); w -= lr v (dc term only with bak)."""

def accumulate(acc: _Real, g: _Real, w: _Real, dc: float, bak: _Real | None = None) -> None:
    """acc += g + dc g g (w - bak) (the dc term only with bak)."""
