"""An allreduce algorithm made outside the package, from docs/architecture.md ("Where a
newcomer adds an allreduce algorithm") alone: "naive_test" gathers every rank's array
to the lowest rank, which reduces them in rank order and sends the result back.

Importing this module registers it (rdmamw.collectives.algorithms.register); then
``allreduce(x, algorithm="naive_test")`` runs it, and "auto", the policy's
``explain`` and ``rdmamw tune`` weigh it, with no change in rdmamw/
(tests/integrations/test_coll_registry.py). Run as a script it is one rank of a test
job: ``python naive_allreduce.py JSON`` prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from rdmamw.collectives.algorithms import Algorithm, register
from rdmamw.collectives.comm import Communicator, Steps
from rdmamw.collectives.policy import Model, step

NAME = "naive_test"
#: the cost model's factor (a test sets 0 to make "auto" choose it)
SCALE = float(os.environ.get("NAIVE_TEST_SCALE", "1"))


def cost(nbytes: float, groups: list[int], model: Model) -> float:
    """n-1 receives into the root, each reduced there, then n-1 sends out of it: the
    root's link carries 2(n-1) N bytes one after the other."""
    t = 0.0
    for r in range(1, len(groups)):
        t += step(model, groups, [(r, 0, nbytes)], nbytes)
        t += step(model, groups, [(0, r, nbytes)])
    return SCALE * t


def peers(comm: Communicator, members: list[int], groups: list[int]) -> list[int]:
    root = members[0]
    return [m for m in members if m != root] if comm.rank == root else [root]


def run(comm: Communicator, x: np.ndarray, res: np.ndarray, op: np.ufunc,
        members: list[int], groups: list[int]) -> Steps:
    root, n = members[0], len(x)
    if comm.rank == root:
        if res is not x:
            np.copyto(res, x)

        def fold(start: int, stop: int, a: np.ndarray) -> None:
            op(res[start:stop], a, out=res[start:stop])

        for r in members[1:]:
            yield from comm.exchange_steps(None, None, r, n, fold, x.dtype)
        for r in members[1:]:
            yield from comm.exchange_steps(r, res, None, 0, None, x.dtype)
        return

    mine = x.copy() if res is x else x      # res is overwritten by the result

    def take(start: int, stop: int, a: np.ndarray) -> None:
        np.copyto(res[start:stop], a)

    yield from comm.exchange_steps(root, mine, None, 0, None, x.dtype)
    yield from comm.exchange_steps(None, None, root, n, take, x.dtype)


ALGORITHM = register(Algorithm(NAME, cost, peers, run))


def main(cfg: dict) -> dict:
    """One rank: the algorithm by name against numpy, "auto"'s choice and what
    ``rdmamw tune``'s calibration measured and predicted."""
    import rdmamw
    import rdmamw.collectives as coll
    from rdmamw.apps import tune_coll

    w = rdmamw.init()
    comm = coll.Communicator()
    me, size = w.rank, w.world_size
    out: dict = {"rank": me}
    for length in cfg.get("lengths", [1, 1000, 70_000]):
        x = np.arange(length, dtype=np.float64) * (me + 1)
        got = coll.allreduce(x, algorithm=NAME, comm=comm)
        np.testing.assert_array_equal(got, np.arange(length) * (size * (size + 1) / 2))
        inplace = coll.allreduce(x, op="max", algorithm=NAME, out=x, comm=comm)
        assert inplace is x
        np.testing.assert_array_equal(x, np.arange(length) * size)
    groups = coll.groups(comm)
    out["names"] = list(coll.ALGORITHMS)
    out["candidates"] = coll.policy.candidates(groups)
    out["auto"] = coll.policy.choose(4096, groups, comm.model)
    got = coll.allreduce(np.ones(1024, np.float32), comm=comm)      # "auto"
    assert (got == size).all()
    cal = tune_coll.calibrate(comm, sizes=[4096], ping_sizes=[8, 65536, 131072])
    out["tuned"] = {"auto": cal["checks"][0]["auto"],
                    "predicted": sorted(cal["checks"][0]["predicted_s"]),
                    "measured": sorted(cal["checks"][0]["measured_s"])}
    comm.close()
    return out


if __name__ == "__main__":
    res = main(json.loads(sys.argv[-1]) if len(sys.argv) > 1 else {})
    print(json.dumps(res), flush=True)
    import rdmamw
    rdmamw.finalize()
