"""Collectives over the ranks of ``rdmamw.init()``, built on the Channel API only.

>>> import numpy as np, rdmamw.collectives as coll
>>> grad = np.ones(1 << 20, np.float32)
>>> coll.allreduce(grad, out=grad)                 # doctest: +SKIP
>>> h = coll.allreduce(grad, async_op=True)         # doctest: +SKIP
>>> total = h.wait()                                # doctest: +SKIP

Algorithms: ring, rhd (recursive halving-doubling), hierarchical (topology-aware),
any registered (rdmamw/collectives/algorithms/) and auto (cost model, see policy.py
and ``rdmamw tune``). docs/collectives.md. Their settings (settings.py) are declared
first, before any module of the package reads them."""

from rdmamw.collectives import settings  # noqa: F401
from rdmamw.collectives.alltoall import alltoall
from rdmamw.collectives.api import (
    allgather,
    allreduce,
    barrier,
    broadcast,
    default_comm,
    groups,
    grow,
    join,
    reduce_scatter,
    shrink,
)
from rdmamw.collectives.comm import CollectiveMismatch, Communicator
from rdmamw.collectives.progress import Handle
from rdmamw.collectives.rooted import gather, reduce, scatter


def __getattr__(name: str) -> object:
    if name == "ALGORITHMS":      # the registry's names (rdmamw.collectives.algorithms)
        from rdmamw.collectives import algorithms
        return algorithms.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["ALGORITHMS", "CollectiveMismatch", "Communicator", "Handle", "allgather",
           "allreduce", "alltoall", "barrier", "broadcast", "default_comm", "gather",
           "groups", "grow", "join", "reduce", "reduce_scatter", "scatter", "shrink"]
