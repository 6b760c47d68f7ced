"""Stub of rdmamw/ps/_seqlock.pyx: the writer's half of the seqlock over a shard read
one-sided. Checked by stubtest."""

import numpy as np
import numpy.typing as npt

def begin(header: npt.NDArray[np.uint64]) -> None:
    """The shard is about to change: word 0 turns odd (ValueError if it is already)."""

def end(header: npt.NDArray[np.uint64], version: int, merged: int) -> None:
    """The shard has changed: the model ``version`` and ``merged`` count in words 1
    and 2, then word 0 turns even (ValueError if :func:`begin` did not come first)."""
