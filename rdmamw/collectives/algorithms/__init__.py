"""The allreduce algorithms: one registry of :class:`Algorithm` objects, one module
each (``ring``, ``rhd``, ``hierarchical`` here), which the vocabulary, the policy
(candidates and costs), ``rdmamw tune`` and the API (``allreduce(algorithm=NAME)``)
read, so they never name one.

An algorithm is its name, its cost model (seconds predicted for ``nbytes`` over a
grouping, from the tuned :class:`rdmamw.collectives.policy.Model`), the peers a rank
needs and its schedule (a generator of steps, rdmamw/collectives/comm.py). The built-in
ones are ``ALGORITHM`` in the modules of :data:`BUILTIN`, imported on first use; more
come from :func:`register` (docs/architecture.md, "Where a newcomer adds an allreduce
algorithm")."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rdmamw import vocabulary

#: the built-in algorithms, in the order they are listed (each a module here, named by
#: the vocabulary, rdmamw/vocabulary.py, so the settings below this layer know them)
BUILTIN = vocabulary.ALLREDUCE_BUILTIN
#: what a world of one rank runs (a copy): "auto" weighs nothing there
SINGLE = "ring"


def _always(groups: list[int]) -> bool:
    return True


@dataclass(frozen=True)
class Algorithm:
    """One allreduce algorithm.

    ``cost(nbytes, groups, model)``: predicted seconds (``groups``: group id per rank,
    policy.py); ``peers(comm, members, groups)``: the ranks this rank exchanges with;
    ``run(comm, x, res, op, members, groups)``: the schedule reducing ``x`` into ``res``
    (flat, ``res`` may be ``x``) with the ufunc ``op``; ``candidate(groups)``: whether
    "auto" weighs it for that grouping; ``tie``: the lower wins equal costs;
    ``groups``: it needs the job's topology (``groups`` is all zeros otherwise)."""

    name: str
    cost: Callable[[float, list[int], Any], float]            # (.., policy.Model)
    peers: Callable[[Any, list[int], list[int]], list[int]]   # (comm.Communicator, ..)
    run: Callable[..., Any]                                   # -> comm.Steps
    candidate: Callable[[list[int]], bool] = _always
    tie: int = 100
    groups: bool = False


_registered: dict[str, Algorithm] = {}
_lock = threading.Lock()
_changes = [0]          # register / unregister calls (policy.Choices keys on it)


def changes() -> int:
    """How many times the registry changed: a remembered choice of "auto" made before
    is stale."""
    return _changes[0]


def register(algo: Algorithm) -> Algorithm:
    """Add an algorithm (or replace the one of its name); returns it. It is then
    selectable by name and weighed by "auto" in this process (register it in every
    rank of a job: each chooses alike)."""
    if not isinstance(algo, Algorithm):
        raise TypeError(f"{algo!r} is not an rdmamw.collectives.algorithms.Algorithm")
    if not (isinstance(algo.name, str) and algo.name.isidentifier()) or algo.name == "auto":
        raise ValueError(f"allreduce algorithm name {algo.name!r} is not a plain name "
                         f"other than 'auto'")
    with _lock:
        _registered[algo.name] = algo
        vocabulary.name_allreduce_algorithm(algo.name)
        _changes[0] += 1
    return algo


def unregister(name: str) -> None:
    """Forget an algorithm added by :func:`register` (a built-in one comes back)."""
    with _lock:
        _registered.pop(name, None)
        if name not in BUILTIN:
            vocabulary.name_allreduce_algorithm(name, known=False)
        _changes[0] += 1


def names() -> tuple[str, ...]:
    """Every algorithm's name: the built-in ones, then the registered ones."""
    return vocabulary.allreduce_algorithms()


def get(name: str) -> Algorithm:
    """The algorithm called ``name``, or ValueError naming the known ones."""
    got = _registered.get(name)
    if got is not None:
        return got
    if name in BUILTIN:
        algo: Algorithm = importlib.import_module(f"{__name__}.{name}").ALGORITHM
        return algo
    raise ValueError(f"algorithm must be 'auto' or one of {names()}, not {name!r}")


def algorithms() -> Iterator[Algorithm]:
    return (get(n) for n in names())


def candidates(groups: list[int]) -> list[str]:
    """What "auto" weighs for ``groups``, the tie-breaking order first."""
    return [a.name for a in sorted(algorithms(), key=lambda a: a.tie)
            if a.candidate(groups)]


def needs_groups(name: str) -> bool:
    """Whether ``name`` ("auto": any candidate may) needs the job's topology."""
    return name == "auto" or get(name).groups


__all__ = ["BUILTIN", "SINGLE", "Algorithm", "algorithms", "candidates", "changes", "get",
           "names",
           "needs_groups", "register", "unregister"]
