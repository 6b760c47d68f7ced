"""Collectives over the ranks of ``rdmamw.init()``, built on the Channel API only.

>>> import numpy as np, rdmamw.collectives as coll
>>> grad = np.ones(1 << 20, np.float32)
>>> coll.allreduce(grad, out=grad)                 # doctest: +SKIP

Algorithms: ring, rhd (recursive halving-doubling), hierarchical (topology-aware)
and auto (cost model, see policy.py and ``rdmamw tune``). docs/collectives.md."""

from rdmamw.collectives.api import (
    allgather,
    allreduce,
    barrier,
    broadcast,
    default_comm,
    groups,
    reduce_scatter,
)
from rdmamw.collectives.comm import CollectiveMismatch, Communicator
from rdmamw.collectives.policy import ALGORITHMS

__all__ = ["ALGORITHMS", "CollectiveMismatch", "Communicator", "allgather", "allreduce",
           "barrier", "broadcast", "default_comm", "groups", "reduce_scatter"]
