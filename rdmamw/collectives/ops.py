"""Reduction operators and the dtypes collectives accept.

Each op is a numpy ufunc called with ``out=``: it writes into the destination slice
straight from the received message's view, without a temporary, and numpy drops the
GIL for large slices."""

from __future__ import annotations

import numpy as np

OPS = {
    "sum": np.add,
    "prod": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
BITWISE = ("band", "bor", "bxor")
DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))


def ufunc(op: str, dtype: np.dtype) -> np.ufunc:
    """The ufunc for ``op`` on ``dtype``, or a ValueError naming what is allowed."""
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, not {op!r}")
    if op in BITWISE and dtype.kind != "i":
        raise ValueError(f"op {op!r} needs an integer dtype, not {dtype}")
    return OPS[op]


def check_dtype(dtype: np.dtype) -> None:
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; use one of "
                        f"{', '.join(str(d) for d in DTYPES)}")
