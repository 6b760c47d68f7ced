"""Bringing a communicator back to size: a lost rank's replacement process re-joins
the job (``rdmamw.init()`` with the same launcher environment: rank 0's store takes
it, rdmamw/bootstrap/rejoin.py) and the members take it back, without restarting.

The members call :func:`grow` on their communicator (a shrunk one, say), the new
process calls :func:`join`. The members first learn the new process's descriptor from
rank 0's store (waiting, by the deadline, until the rank's generation moved), then
all of them run the shrink's agreement (rdmamw.collectives.survivors) over the grown
membership: it opens a channel between every pair (the newcomer's new channels meet
only its new process: the generations are part of each channel's meeting) and every
member comes out with the same members. A newcomer that never comes is counted out
by the agreement as a failed member would be (the others go on without it)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from rdmamw.collectives import survivors


def grow(comm: Any, ranks: Iterable[int] | None = None,
         timeout: float | None = None) -> list[int]:
    """The world ranks of ``comm`` grown by ``ranks`` (default: every world rank not
    in it), agreed with every member and newcomer."""
    end = time.monotonic() + (comm.timeout if timeout is None else timeout)
    world = comm.world
    new = set(range(world.world_size)) - set(comm.members) if ranks is None else set(ranks)
    if new & set(comm.members):
        raise ValueError(f"ranks {sorted(new & set(comm.members))} are members already")
    world.refresh(new, end)
    return survivors.agree(world, sorted(set(comm.members) | new), set(), end)


def join(world: Any, members: Iterable[int] | None, end: float) -> list[int]:
    """A re-joined process's side of :func:`grow`: the members it is taken into (every
    world rank by default), as agreed with them."""
    ranks = list(range(world.world_size)) if members is None else sorted(members)
    return survivors.agree(world, ranks, set(), end)
