"""distributed's tests' echo handler, for the rdmamw.dask tests and bench/dask_bench.py
(distributed is imported when a comm arrives, so this module needs it only then)."""

from __future__ import annotations

from typing import Any


async def echo(comm: Any) -> None:
    """Answer every message until the comm ends."""
    from distributed.comm import CommClosedError
    try:
        while True:
            await comm.write(await comm.read())
    except CommClosedError:
        pass
