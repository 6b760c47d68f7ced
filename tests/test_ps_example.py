"""examples/ps_train.py end to end: a short run per consistency model learns digits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")

from test_ps import ROOT, clean_env  # noqa: E402


@pytest.mark.parametrize("mode", ["lsp"])            # the demo tests run the others
def test_ps_train_learns(mode, tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ps_train.py"),
                        "--consistency", mode, "--workers", "2", "--servers", "2",
                        "--epochs", "3", "--straggler", "2", "--compute-ms", "1",
                        "--quiet", "--json", str(out)],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                       timeout=110)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "test acc" in p.stdout
    r = json.loads(out.read_text())
    assert [run["name"] for run in r["runs"]] == [mode]
    # chance is 0.1; quiet runs give 0.91-0.95, but LSP's rounds depend on timing and
    # under a load of 5-7 on 2 cores one run gave 0.77: the bar is "it learns"
    assert r["runs"][0]["final_accuracy"] > 0.6
    assert r["runs"][0]["metrics"]["push_s"]["n"] > 0
    assert not list(tmp_path.glob("*.png"))                # no --plot: no plot
