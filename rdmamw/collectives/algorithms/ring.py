"""The ring allreduce (reduce-scatter then allgather around the ranks, rdmamw/collectives/
ring.py): 2(n-1) steps each moving N/n bytes, bandwidth-optimal."""

from __future__ import annotations

from rdmamw.collectives import ring
from rdmamw.collectives.algorithms import Algorithm
from rdmamw.collectives.policy import Model, step


def cost(nbytes: float, groups: list[int], model: Model) -> float:
    n = len(groups)
    if n == 1:
        return 0.0
    seg = nbytes / n
    sends = [(r, (r + 1) % n, seg) for r in range(n)]
    return (n - 1) * (step(model, groups, sends, seg) + step(model, groups, sends))


ALGORITHM = Algorithm(
    "ring", cost,
    peers=lambda comm, members, groups: ring.peers(comm, members),
    run=lambda comm, x, res, op, members, groups: ring.allreduce(comm, x, res, op, members),
    tie=1)
