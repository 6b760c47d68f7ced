"""Pipelined broadcast and reduce over a tree of ranks, chunk by chunk (a rank
forwards chunk i while chunk i+1 is still on its way). A binomial tree has log2(n)
depth (small messages); a chain moves each byte over each link once (large ones)."""

from __future__ import annotations

import numpy as np

from rdmamw.collectives._kernels import Copier, reducer
from rdmamw.collectives.comm import Communicator, Steps

#: below this many bytes a broadcast uses the binomial tree, above it the chain
TREE_BYTES = 256 * 1024


def binomial(members: list[int], root: int, rank: int) -> tuple[int | None, list[int]]:
    """(parent, children) of ``rank`` in the binomial tree rooted at ``root``."""
    n = len(members)
    v = (members.index(rank) - members.index(root)) % n
    parent, children, mask = None, [], 1
    while mask < n:
        if v & mask:
            parent = members[(v - mask + members.index(root)) % n]
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if v + mask < n:
            children.append(members[(v + mask + members.index(root)) % n])
        mask >>= 1
    return parent, children


def chain(members: list[int], root: int, rank: int) -> tuple[int | None, list[int]]:
    """(parent, children) in the chain root -> next -> ... (members order, rotated)."""
    n = len(members)
    v = (members.index(rank) - members.index(root)) % n
    parent = members[(v - 1 + members.index(root)) % n] if v else None
    child = [members[(v + 1 + members.index(root)) % n]] if v + 1 < n else []
    return parent, child


def shape(members: list[int], root: int, rank: int, nbytes: int):
    return (binomial if nbytes <= TREE_BYTES else chain)(members, root, rank)


def peers(members: list[int], root: int, rank: int, nbytes: int) -> list[int]:
    parent, children = shape(members, root, rank, nbytes)
    return ([parent] if parent is not None else []) + children


def broadcast(comm: Communicator, res: np.ndarray, root: int, members: list[int]) -> Steps:
    """``res`` of ``root`` into ``res`` of every member."""
    if len(members) == 1:
        return
    parent, children = shape(members, root, comm.rank, res.nbytes)
    yield from comm.relay_steps(parent, children, res, len(res), Copier(res, 0), res.dtype)


def reduce(comm: Communicator, x: np.ndarray, res: np.ndarray, op: np.ufunc, root: int,
           members: list[int]) -> Steps:
    """Chain reduce towards ``root``: each rank adds its ``x`` to the partial result
    coming from the rank after it and passes it on; ``res`` of ``root`` holds the sum
    (other ranks' ``res`` is scratch)."""
    n = len(members)
    if n == 1:
        if res is not x:
            np.copyto(res, x)
        return
    v = (members.index(comm.rank) - members.index(root)) % n
    prev = members[(v - 1 + members.index(root)) % n] if v else None   # towards root
    nxt = members[(v + 1 + members.index(root)) % n] if v + 1 < n else None
    if nxt is None:
        yield from comm.relay_steps(None, [prev], x, len(x), None, x.dtype)
    else:
        yield from comm.relay_steps(nxt, [prev] if prev is not None else [], res, len(x),
                                    reducer(op, x, res, 0), x.dtype)

