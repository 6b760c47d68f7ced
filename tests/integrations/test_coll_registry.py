"""Allreduce algorithms are registered objects (rdmamw/collectives/algorithms/): one
made in tests/support/naive_allreduce.py ("gather to the lowest rank, then send back"),
registered there, is selectable by name, weighed by "auto", by the policy's
``explain`` and by ``rdmamw tune``, and accepted by the vocabulary and the settings,
with no change in rdmamw/; and the layers that read the registry spell no built-in
algorithm's name."""

from __future__ import annotations

import ast
import json
import os
import pathlib

import numpy as np
import pytest

import rdmamw.collectives as coll
from rdmamw import config, vocabulary
from rdmamw.bootstrap import World
from rdmamw.collectives import Communicator, algorithms, policy
from rdmamw.errors import ConfigError
from tests.integrations.test_collectives import job

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAIVE = str(ROOT / "tests" / "support" / "naive_allreduce.py")
#: the modules that read the registry (and once spelled each algorithm; the vocabulary
#: names the built-in modules, for the layers below the collectives)
READERS = ["rdmamw/config.py", "rdmamw/collectives/policy.py",
           "rdmamw/collectives/api.py", "rdmamw/apps/tune_coll.py",
           "rdmamw/aio/collectives.py"]


@pytest.fixture
def naive(monkeypatch):
    from tests.support import naive_allreduce as mod
    algorithms.register(mod.ALGORITHM)
    try:
        yield mod
    finally:
        algorithms.unregister(mod.NAME)
    assert mod.NAME not in algorithms.names()


def test_a_registered_algorithm_is_known_everywhere_that_lists_them(naive, monkeypatch):
    name = naive.NAME
    assert name in algorithms.names() and name in coll.ALGORITHMS
    assert name in vocabulary.ALLREDUCE_ALGORITHMS
    monkeypatch.setenv("RDMAMW_ALLREDUCE_ALGORITHM", name)
    assert config.get("RDMAMW_ALLREDUCE_ALGORITHM") == name
    assert policy.choose(1 << 20, [0, 0, 0], policy.Model()) == name    # forced
    monkeypatch.delenv("RDMAMW_ALLREDUCE_ALGORITHM")
    assert policy.Model.from_json({"model": policy.Model().to_json(),
                                   "algorithm": name}).algorithm == name
    for groups in ([0, 0], [0, 0, 0, 0], [0, 1, 0, 1]):
        assert name in policy.candidates(groups)
        assert set(policy.explain(4096, groups, policy.Model())) == \
            set(policy.candidates(groups))
        assert policy.choose(4096, groups, policy.Model()) != name     # it costs more
    memo, groups, model = policy.Choices(), [0, 1, 0, 1], policy.Model()
    algorithms.unregister(name)
    assert memo.choose(4096, groups, model) != name
    algorithms.register(naive.ALGORITHM)                # seen by a remembered choice
    monkeypatch.setattr(naive, "SCALE", 0.0)
    assert policy.choose(4096, [0, 0, 0], model) == name         # now the cheapest
    assert memo.choose(4096, groups, model) == name


def test_an_unknown_algorithm_is_refused_naming_the_registered_ones(naive, monkeypatch):
    with pytest.raises(ValueError, match=f"one of .*'{naive.NAME}'.*not 'butterfly'"):
        policy.choose(4096, [0, 0], policy.Model(), "butterfly")
    monkeypatch.setenv("RDMAMW_ALLREDUCE_ALGORITHM", "butterfly")
    with pytest.raises(ConfigError, match="RDMAMW_ALLREDUCE_ALGORITHM"):
        config.get("RDMAMW_ALLREDUCE_ALGORITHM")
    with pytest.raises(ValueError, match="not a plain name"):
        algorithms.register(algorithms.Algorithm("auto", naive.cost, naive.peers, naive.run))
    with pytest.raises(TypeError, match="is not an"):
        algorithms.register(object())


def test_a_registered_algorithm_runs_on_one_rank(naive):
    solo = Communicator(World(0, 1, "test", "solo", {0: {"host": "h", "hostname": "h"}}))
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(coll.allreduce(x, algorithm=naive.NAME, comm=solo), x)


@pytest.mark.parametrize("n", [2, 3])
def test_a_registered_algorithm_runs_by_name_and_auto_and_the_tuner_weigh_it(n):
    """A real job whose ranks import the test algorithm (that registers it): by name it
    matches numpy; made cheapest (its cost scaled to 0), "auto" runs it and ``rdmamw
    tune``'s calibration predicts and measures it and names it the choice."""
    res = job(n, "naive", {"lengths": [1, 1000, 70_000]}, timeout=120, worker=NAIVE,
              env={"NAIVE_TEST_SCALE": "0"})
    assert len(res) == n
    for r in res:
        assert "naive_test" in r["names"] and "naive_test" in r["candidates"]
        assert r["auto"] == "naive_test"
        assert r["tuned"]["auto"] == "naive_test"
        assert "naive_test" in r["tuned"]["measured"]
        assert r["tuned"]["measured"] == r["tuned"]["predicted"]


def test_the_readers_of_the_registry_spell_no_builtin_algorithm():
    """What the registry replaced: the policy's COSTS and candidates, the API's
    if/elif chains, the vocabulary's tuple. Only docstrings and comments name them."""
    found = []
    for rel in READERS:
        tree = ast.parse((ROOT / rel).read_text())
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in algorithms.BUILTIN and \
                    not isinstance(parents.get(node), ast.Expr):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert found == []


def test_builtin_algorithms_are_modules_of_the_registry():
    for name in algorithms.BUILTIN:
        a = algorithms.get(name)
        assert a.name == name and callable(a.cost) and callable(a.run)
        assert os.path.exists(ROOT / "rdmamw" / "collectives" / "algorithms" / f"{name}.py")
    assert json.dumps(list(algorithms.names()[:3])) == '["ring", "rhd", "hierarchical"]'
