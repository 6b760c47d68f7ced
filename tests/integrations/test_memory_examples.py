"""The large-message examples run end to end with small sizes."""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys

import pytest

import rdmamw

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_RNDV = "rendezvous" in inspect.signature(rdmamw.Channel.open).parameters
needs_rndv = pytest.mark.skipif(not HAS_RNDV,
                                reason="the rendezvous API (branch rdv) is not in this build")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)


@needs_rndv
@pytest.mark.parametrize("strategy", ["auto", "read", "write"])
def test_large_array_arrives_intact(strategy):
    p = run("large_array.py", "--mib", "8", "--rendezvous", strategy)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "content correct" in p.stdout and "rndv_sends 1" in p.stdout


@needs_rndv
@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed (optional: pip install torch)")
def test_torch_round_trip():
    p = run("torch_roundtrip.py", "--mib", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "equal to 2x" in p.stdout


def test_torch_example_without_torch_says_how_to_get_it(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "torch_roundtrip.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "pip install torch" in p.stderr and "Nothing was run" in p.stderr
