"""Ray on rdmamw: the ``ray.util.collective`` backend "rdmamw" (docs/ray.md).

>>> import rdmamw.ray, ray.util.collective as col
>>> rdmamw.ray.register()                       # driver and every actor   # doctest: +SKIP
>>> col.init_collective_group(2, rank, backend="rdmamw")                  # doctest: +SKIP
>>> col.allreduce(grad)                                                  # doctest: +SKIP

Ray keeps its backend registry per process, so :func:`register` must run in the
driver (``create_collective_group`` checks it there) and in each actor before its
group is made; it is idempotent. Ray Train's ``TorchConfig(backend="rdmamw")`` uses
``rdmamw.torch.register`` instead (a ``torch.distributed`` backend, docs/ray.md)."""

from __future__ import annotations

from typing import Any

from rdmamw.ray.store import RayKV, group_root

BACKEND = "rdmamw"


def __getattr__(name: str) -> Any:
    """``RdmamwGroup``, imported (with Ray) when first asked for: the store
    (rdmamw.ray.store) needs no Ray to import."""
    if name == "RdmamwGroup":
        from rdmamw.ray.group import RdmamwGroup
        return RdmamwGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> str:
    """Register :class:`RdmamwGroup` with ``ray.util.collective`` under "rdmamw"
    (Ray upper-cases it: ``Backend.RDMAMW``) and return the name; a second call
    does nothing (Ray's own ``register_collective_backend`` refuses a name twice)."""
    from ray.util.collective.backend_registry import (
        _global_registry,
        register_collective_backend,
    )

    from rdmamw.ray.group import RdmamwGroup

    if not _global_registry.is_registered(BACKEND):
        register_collective_backend(BACKEND, RdmamwGroup)
    return BACKEND


__all__ = ["BACKEND", "RayKV", "RdmamwGroup", "group_root", "register"]
