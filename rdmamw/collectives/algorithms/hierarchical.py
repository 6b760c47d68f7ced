"""The topology-aware allreduce (rdmamw/collectives/hierarchical.py): reduce inside each
group to its leader, allreduce among the leaders, broadcast inside each group. "auto"
weighs it when there are several groups, one of them of several ranks."""

from __future__ import annotations

from rdmamw.collectives import hierarchical
from rdmamw.collectives.algorithms import Algorithm
from rdmamw.collectives.algorithms import rhd as _rhd
from rdmamw.collectives.algorithms import ring as _ring
from rdmamw.collectives.policy import Model


def cost(nbytes: float, groups: list[int], model: Model) -> float:
    g = max(groups.count(x) for x in set(groups))
    k = len(set(groups))
    intra = model.intra
    t = 0.0
    if g > 1:     # pipelined chains: reduce (with the reduction) and broadcast
        t += 2 * (g - 1) * intra.alpha + nbytes * (2 * intra.beta + model.gamma)
    leaders = list(range(k))
    inner = _rhd.cost if k & (k - 1) == 0 else _ring.cost
    return t + inner(nbytes, leaders, model)


def candidate(groups: list[int]) -> bool:
    return 1 < len(set(groups)) < len(groups)


ALGORITHM = Algorithm(
    "hierarchical", cost,
    peers=lambda comm, members, groups: hierarchical.peers(comm, groups),
    run=lambda comm, x, res, op, members, groups: hierarchical.allreduce(comm, x, res, op,
                                                                          groups),
    candidate=candidate, tie=2, groups=True)
