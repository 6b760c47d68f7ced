"""Which allreduce algorithm to run: an alpha-beta(-gamma) cost model evaluated on the
schedule each algorithm really runs over the job's topology. The algorithms, their
cost functions and whether "auto" weighs them come from their registry
(rdmamw/collectives/algorithms/); this module names none.

A step whose pairs all sit in one group costs ``alpha_intra + bytes * beta_intra``;
a step with any pair across groups waits for the slow link (``*_inter``); reducing
costs ``bytes * gamma``. The parameters come from ``rdmamw tune`` (a JSON file users
can read and edit), else from conservative built-in defaults.

Precedence: ``algorithm=`` argument > ``RDMAMW_ALLREDUCE_ALGORITHM`` > the config's
``"algorithm"`` > the model's cheapest."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rdmamw import config
from rdmamw.collectives import algorithms
from rdmamw.errors import ConfigError
from rdmamw.vocabulary import AUTO

CONFIG_ENV = "RDMAMW_COLL_CONFIG"
ALGO_ENV = "RDMAMW_ALLREDUCE_ALGORITHM"


def default_path() -> Path:
    return Path(config.get(CONFIG_ENV) or
                Path.home() / ".config" / "rdmamw" / "collectives.json")


@dataclass
class Link:
    alpha: float          # seconds per step (message latency plus call overhead)
    beta: float           # seconds per byte moved


@dataclass
class Model:
    intra: Link = field(default_factory=lambda: Link(20e-6, 1 / 4e9))
    inter: Link = field(default_factory=lambda: Link(100e-6, 1 / 1e9))
    gamma: float = 1 / 5e9      # seconds per byte reduced
    algorithm: str | None = None
    source: str = "built-in defaults"

    def to_json(self) -> dict:
        return {"intra": vars(self.intra), "inter": vars(self.inter), "gamma": self.gamma}

    @classmethod
    def from_json(cls, d: Any, source: str = "") -> Model:
        """The model of a config file's JSON, checked: ConfigError naming ``source``
        for anything but finite non-negative numbers and a known algorithm."""
        def num(v: Any, what: str) -> float:
            if type(v) not in (int, float) or not 0 <= v < math.inf:
                raise ConfigError(f"{source or 'cost model'}: {what} = {v!r:.40} is not a "
                                  f"finite number >= 0")
            return float(v)

        def link(v: Any, what: str) -> Link:
            if not isinstance(v, dict):
                raise ConfigError(f"{source or 'cost model'}: {what!r} is not a map")
            return Link(num(v.get("alpha"), f"{what}.alpha"), num(v.get("beta"), f"{what}.beta"))

        m = d.get("model", d) if isinstance(d, dict) else None
        if not isinstance(m, dict):
            raise ConfigError(f"{source or 'cost model'}: not a map of intra, inter, gamma")
        algorithm = d.get("algorithm")
        known = algorithms.names()
        if algorithm not in (None, AUTO, *known):
            raise ConfigError(f"{source or 'cost model'}: algorithm {algorithm!r:.40} is not "
                              f"'auto' or one of {known}")
        return cls(link(m.get("intra"), "intra"), link(m.get("inter"), "inter"),
                   num(m.get("gamma"), "gamma"), algorithm, source)


def load(path: str | os.PathLike | None = None) -> Model:
    """The tuned model from ``path`` (default ``$RDMAMW_COLL_CONFIG`` or
    ``~/.config/rdmamw/collectives.json``), or the built-in defaults if absent."""
    p = Path(path) if path else default_path()
    if not p.exists():
        return Model()
    logging.getLogger("rdmamw.collectives").info("collectives cost model from %s", p)
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{p} ({CONFIG_ENV} or the default) is not a cost model "
                          f"written by `rdmamw tune`: {e}") from None
    return Model.from_json(doc, f"{p} ({CONFIG_ENV} or the default)")


def step(model: Model, groups: list[int], sends: list[tuple[int, int, float]],
         reduce_bytes: float = 0.0) -> float:
    """Seconds of one step whose transfers ``(src, dst, bytes)`` run at once.

    Transfers inside a group run in parallel (each pair has its own cores); those
    between two groups share that pair of groups' link, so their bytes add up."""
    t, across = 0.0, {}
    for a, b, nbytes in sends:
        if groups[a] == groups[b]:
            t = max(t, model.intra.alpha + nbytes * model.intra.beta)
        else:
            key = (groups[a], groups[b])
            across[key] = across.get(key, 0.0) + nbytes
    for nbytes in across.values():
        t = max(t, model.inter.alpha + nbytes * model.inter.beta)
    return t + reduce_bytes * model.gamma


def cost(name: str, nbytes: float, groups: list[int], model: Model) -> float:
    """Predicted seconds of the algorithm ``name``."""
    return algorithms.get(name).cost(nbytes, groups, model)


def candidates(groups: list[int]) -> list[str]:
    """The algorithms "auto" weighs for ``groups`` (the registry's ``candidate``)."""
    return algorithms.candidates(groups)


def choose(nbytes: int, groups: list[int], model: Model,
           algorithm: str | None = None) -> str:
    """The algorithm to run (the same answer on every rank for the same inputs)."""
    forced = algorithm if algorithm not in (None, "auto") else (
        config.get(ALGO_ENV) or model.algorithm)
    if forced and forced != AUTO:
        return algorithms.get(forced).name      # ValueError naming the known ones
    if len(groups) == 1:
        return algorithms.SINGLE
    return min(candidates(groups), key=lambda a: cost(a, nbytes, groups, model))


class Choices:
    """:func:`choose` remembered per message size for one grouping and one model: the
    cost model walks every rank's transfers of every step (O(ranks) per call): about
    5 µs of a small allreduce's Python cost at 2 ranks, milliseconds at thousands.
    The model's numbers, RDMAMW_ALLREDUCE_ALGORITHM and the algorithms' registry's
    changes are part of the key, so a model edited in place, a changed variable or an
    algorithm registered since is seen at the next call."""

    LIMIT = 1024            # sizes remembered before starting over (bounded memory)

    def __init__(self) -> None:
        self._groups: list[int] | None = None
        self._seen: dict[tuple, str] = {}

    def choose(self, nbytes: int, groups: list[int], model: Model,
               algorithm: str | None = None) -> str:
        if algorithm not in (None, "auto"):
            return choose(nbytes, groups, model, algorithm)
        key = (nbytes, config.raw(ALGO_ENV), algorithms.changes(), model.algorithm,
               model.intra.alpha,
               model.intra.beta, model.inter.alpha, model.inter.beta, model.gamma)
        if groups is not self._groups:
            self._groups, self._seen = groups, {}
        alg = self._seen.get(key)
        if alg is None:
            alg = choose(nbytes, groups, model, algorithm)
            if len(self._seen) >= self.LIMIT:
                self._seen = {}
            self._seen[key] = alg
        return alg


def explain(nbytes: int, groups: list[int], model: Model) -> dict[str, Any]:
    """Predicted seconds of each candidate (what ``choose`` compared)."""
    return {a: cost(a, nbytes, groups, model) for a in candidates(groups)}
