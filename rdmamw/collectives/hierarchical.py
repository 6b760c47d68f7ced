"""Topology-aware allreduce: reduce inside each group to its leader (its lowest
rank) over the fast links, allreduce among the leaders over the slow ones, then
broadcast inside each group. Only N bytes per leader cross the slow links once each
way, instead of the ring's 2(n-1) steps that each wait on the slowest link."""

from __future__ import annotations

import numpy as np

from rdmamw.collectives import rhd, ring, tree
from rdmamw.collectives._kernels import Copier
from rdmamw.collectives.comm import Communicator, Steps


def layout(groups: list[int], rank: int) -> tuple[list[int], list[int]]:
    """(my group's ranks, the leaders' ranks), both ascending."""
    mine = [r for r, g in enumerate(groups) if g == groups[rank]]
    leaders = sorted({min(r for r, g in enumerate(groups) if g == gid) for gid in groups})
    return mine, leaders


def inner(n_leaders: int) -> str:
    """The leaders' algorithm: rhd for a power of two, else ring (no fix-up traffic
    over the slow links)."""
    return "rhd" if n_leaders & (n_leaders - 1) == 0 else "ring"


def peers(comm: Communicator, groups: list[int]) -> list[int]:
    mine, leaders = layout(groups, comm.rank)
    parent, children = tree.chain(mine, mine[0], comm.rank)   # reduce and broadcast
    out = ([parent] if parent is not None else []) + children
    if comm.rank == mine[0]:
        mod = rhd if inner(len(leaders)) == "rhd" else ring
        out += mod.peers(comm, leaders)
    return out


def allreduce(comm: Communicator, x: np.ndarray, res: np.ndarray, op: np.ufunc,
              groups: list[int]) -> Steps:
    mine, leaders = layout(groups, comm.rank)
    leader = mine[0]
    yield from tree.reduce(comm, x, res, op, leader, mine)
    if comm.rank == leader:
        mod = rhd if inner(len(leaders)) == "rhd" else ring
        yield from mod.allreduce(comm, res, res, op, leaders)
    parent, children = tree.chain(mine, leader, comm.rank)
    if len(mine) > 1:
        yield from comm.relay_steps(parent, children, res, len(res), Copier(res, 0),
                                    res.dtype)
