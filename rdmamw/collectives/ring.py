"""Ring allreduce: reduce-scatter then allgather around the ring, 2(n-1) steps of
N/n bytes each. Bandwidth-optimal for any n; latency grows with n, so it wins for
large arrays. Every segment is reduced by one chain of ranks and then copied, so all
ranks end with bit-identical results."""

from __future__ import annotations

import numpy as np

from rdmamw.collectives._kernels import Copier, bounds, reducer
from rdmamw.collectives.comm import Communicator, Steps


def peers(comm: Communicator, members: list[int]) -> list[int]:
    i, n = members.index(comm.rank), len(members)
    return [members[(i + 1) % n], members[(i - 1) % n]] if n > 1 else []


def reduce_scatter(comm: Communicator, x: np.ndarray, res: np.ndarray, op: np.ufunc,
                   members: list[int], shift: int = 0) -> Steps:
    """Ring reduce-scatter of ``x`` into ``res``; returns the segment this rank owns
    fully reduced, ``(i + 1 + shift) mod n`` (``shift=-1``: segment ``i``)."""
    n, i = len(members), members.index(comm.rank)
    b = bounds(len(x), n)
    right, left = members[(i + 1) % n], members[(i - 1) % n]
    for s in range(n - 1):
        k_send, k_recv = (i - s + shift) % n, (i - s - 1 + shift) % n
        src = x if s == 0 else res
        yield from comm.exchange_steps(right, src[b[k_send]:b[k_send + 1]], left,
                      b[k_recv + 1] - b[k_recv], reducer(op, x, res, b[k_recv]), x.dtype)
    return (i + 1 + shift) % n


def allgather(comm: Communicator, res: np.ndarray, members: list[int], owned: int,
              b: list[int]) -> Steps:
    """Ring allgather of blocks ``b``: this rank holds block ``owned`` of ``res``."""
    n, i = len(members), members.index(comm.rank)
    right, left = members[(i + 1) % n], members[(i - 1) % n]
    for s in range(n - 1):
        k_send, k_recv = (owned - s) % n, (owned - s - 1) % n
        yield from comm.exchange_steps(right, res[b[k_send]:b[k_send + 1]], left,
                      b[k_recv + 1] - b[k_recv], Copier(res, b[k_recv]), res.dtype)


def allreduce(comm: Communicator, x: np.ndarray, res: np.ndarray, op: np.ufunc,
              members: list[int]) -> Steps:
    if len(members) == 1:
        if res is not x:
            np.copyto(res, x)
        return
    owned = yield from reduce_scatter(comm, x, res, op, members)
    yield from allgather(comm, res, members, owned, bounds(len(x), len(members)))
