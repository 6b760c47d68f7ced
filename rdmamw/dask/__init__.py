"""Dask distributed over rdmamw: the comm backend ``rdmamw://HOST:PORT``
(docs/dask.md). Installed with ``pip install rdmamw[dask]``, distributed finds it
through the ``distributed.comm.backends`` entry point, so
``LocalCluster(protocol="rdmamw")``, ``dask scheduler --protocol rdmamw`` and
``DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME=rdmamw`` work without importing anything;
:func:`register` does the same by hand (e.g. from a source tree without the
entry point)."""

from __future__ import annotations

from rdmamw.dask.comm import (
    SCHEME,
    RdmamwBackend,
    RdmamwComm,
    RdmamwConnector,
    RdmamwListener,
    TokenRequired,
)


def register() -> str:
    """Put the backend in distributed's registry under "rdmamw" and return the
    scheme; idempotent."""
    from distributed.comm import registry

    if not isinstance(registry.backends.get(SCHEME), RdmamwBackend):
        registry.backends[SCHEME] = RdmamwBackend()
    return SCHEME


__all__ = ["SCHEME", "RdmamwBackend", "RdmamwComm", "RdmamwConnector", "RdmamwListener",
           "TokenRequired", "register"]
