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
#: every fixed-size numeric numpy dtype (bool too: sum/max is "or", prod/min is "and").
#: float16 reduces in float16 here; rdmamw.torch widens float16 and bfloat16 to float32.
DTYPES = tuple(np.dtype(t) for t in (
    "float16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool"))


def ufunc(op: str, dtype: np.dtype) -> np.ufunc:
    """The ufunc for ``op`` on ``dtype``, or a ValueError naming what is allowed."""
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, not {op!r}")
    if op in BITWISE and dtype.kind not in "iub":
        raise ValueError(f"op {op!r} needs an integer dtype, not {dtype}")
    return OPS[op]


#: accepted dtype -> its name (a dict lookup: ``str(dtype)`` costs ~2 µs, a tenth of a
#: small collective's whole Python cost)
NAMES = {d: d.name for d in DTYPES}


def check_dtype(dtype: np.dtype) -> None:
    if dtype not in NAMES:
        raise TypeError(f"dtype {dtype} is not supported; use one of "
                        f"{', '.join(str(d) for d in DTYPES)}")


def dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)``, looked up for the accepted dtypes (the headers carry it)."""
    name = NAMES.get(dtype)
    return name if name is not None else str(dtype)
