"""Going on without a lost rank in torch, and taking its replacement back.

After a rank dies or stops, every survivor's operation on the group raises, naming
that rank (``e.rank``: rdmamw.collectives.revoke). Each survivor then calls
:func:`shrink` and goes on with the group it returns: ranks renumbered in the old
order, the same timeout, collectives and p2p on it as on any rdmamw group (call its
methods, or pass it where torch takes a group object: ``DistributedDataParallel(model,
process_group=pg)``). The old group stays broken.

An elastic launcher may then start a new process for the lost rank, with that rank's
launcher environment: it calls :func:`join` (its torch default group, re-joined
through the job's store: rdmamw/bootstrap/kvstore.py) while the members call
:func:`grow` on their group; both get the group of the whole job again, ranks in world
order. The newcomer has no model yet: wrapping it in DDP on that group broadcasts
rank 0's parameters. docs/torch.md, "Errors"."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from rdmamw.torch.backend import ProcessGroupRdmamw, Rejoin


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
    group's). The ranks it drops may re-join (:func:`join`)."""
    old = backend_of(group)
    comm = old.comm.shrink(timeout)
    old.p2p.world.depart(set(old.comm.members) - set(comm.members))
    return ProcessGroupRdmamw.survivors(old, comm)


def grow(group: Any = None, ranks: Iterable[int] | None = None,
         timeout: float | None = None) -> ProcessGroupRdmamw:
    """The process group of ``group`` (a shrunk one) with re-joined ranks back
    (``ranks``: world ranks, default every one it lacks), ranks in world order; every
    member calls it while each new process calls :func:`join`. ``timeout`` (default
    the group's) bounds the wait for the new processes and the agreement."""
    old = backend_of(group)
    secs = old.timeout if timeout is None else timeout
    end = time.monotonic() + secs
    comm = old.comm.grow(ranks, secs)
    try:
        old.p2p.world.refresh(set(comm.members) - set(old.comm.members), end)
    except BaseException:
        comm.close()
        raise
    return ProcessGroupRdmamw.survivors(old, comm)


def join(timeout: datetime.timedelta | float | None = None) -> ProcessGroupRdmamw:
    """On a new process started for a lost rank (that rank's launcher environment):
    ``dist.init_process_group("rdmamw")`` re-joining the running job; returns torch's
    default group, which is the group the members' :func:`grow` makes (it waits for
    them). ``timeout``: the group's, as init_process_group's (seconds or a
    timedelta); it also bounds the wait for the members."""
    if isinstance(timeout, int | float):
        timeout = datetime.timedelta(seconds=timeout)
    dist.init_process_group("rdmamw", timeout=timeout, pg_options=Rejoin())
    return backend_of()
