"""examples/ps_train.py end to end: a short run per consistency model learns digits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")

from test_ps import ROOT, clean_env  # noqa: E402


def train(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ps_train.py"),
                        "--workers", "2", "--servers", "2", "--epochs", "3",
                        "--quiet", "--json", str(out), *args],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                       timeout=110)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "test acc" in p.stdout
    return json.loads(out.read_text())


def test_ps_train_learns_the_same_model_however_slow_a_worker_is(tmp_path):
    """BSP with two workers merges both gradients every round (a + b == b + a): the
    model, and so every epoch's accuracy, cannot depend on timing; a straggler that
    is 2x slower changes the wall time only. (LSP's rounds do depend on timing: the
    demo tests run it; no accuracy bar here moves with the machine's load.)"""
    even = train(tmp_path, "even", "--consistency", "bsp", "--straggler", "1",
                 "--compute-ms", "0")
    slow = train(tmp_path, "slow", "--consistency", "bsp", "--straggler", "2",
                 "--compute-ms", "2")
    runs = [even["runs"], slow["runs"]]
    assert [[run["name"] for run in r] for r in runs] == [["bsp"], ["bsp"]]
    (a,), (b,) = runs
    assert [e["accuracy"] for e in a["epochs"]] == [e["accuracy"] for e in b["epochs"]]
    assert [e["merged"] for e in a["epochs"]] == [e["merged"] for e in b["epochs"]]
    assert a["final_accuracy"] == b["final_accuracy"] > 0.9        # chance is 0.1
    assert a["metrics"]["push_s"]["n"] > 0
    assert not list(tmp_path.glob("*.png"))                # no --plot: no plot
