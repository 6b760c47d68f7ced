"""Going on without a lost rank in torch: the survivors' process group.

After a rank dies or stops, every survivor's operation on the group raises, naming
that rank (``e.rank``: rdmamw.collectives.revoke). Each survivor then calls
:func:`shrink` and goes on with the group it returns: ranks renumbered in the old
order, the same timeout, collectives and p2p on it as on any rdmamw group (call its
methods, or pass it where torch takes a group object: ``DistributedDataParallel(model,
process_group=pg)``). The old group stays broken. docs/torch.md, "Errors"."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rdmamw.torch.backend import ProcessGroupRdmamw


def backend_of(group: Any = None) -> ProcessGroupRdmamw:
    """``group`` (default: the default group) as the rdmamw group it is, or
    TypeError for a group on another backend."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupRdmamw):
        raise TypeError(f"{pg!r} is not an rdmamw group")
    return pg


def shrink(group: Any = None, timeout: float | None = None) -> ProcessGroupRdmamw:
    """The process group of ``group``'s survivors (default: the default group's), agreed
    by all of them (each calls it); ``timeout`` bounds the agreement (default the
    group's)."""
    old = backend_of(group)
    return ProcessGroupRdmamw.survivors(old, old.comm.shrink(timeout))
