"""The DML communication-pattern examples, run small on one host: parameter
broadcast (collective and plain-channel variants) and the all-to-all data shuffle."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_bootstrap import json_objects
from test_ps import ROOT, clean_env

sys.path.insert(0, os.path.join(ROOT, "examples"))
import broadcast  # noqa: E402
import shuffle  # noqa: E402


def launch(n: int, script: str, *args: str) -> list[dict]:
    p = subprocess.run([sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", str(n), "--",
                        sys.executable, os.path.join(ROOT, "examples", script), *args],
                       cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json_objects(p.stdout)
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.parametrize("via, root", [("collective", 0), ("channel", 2)])
def test_broadcast_gives_every_rank_the_roots_parameters(via, root):
    rows = launch(3, "broadcast.py", "--mib", "1", "--via", via, "--root", str(root))
    want = broadcast.digest(broadcast.parameters(1, seed=1234))
    assert [r["rank"] for r in rows] == [0, 1, 2]
    assert {r["digest"] for r in rows} == {want}
    assert want != broadcast.digest(broadcast.parameters(1, seed=None))   # zeros differ


def test_shuffle_delivers_each_row_to_its_destination_once():
    rows = launch(3, "shuffle.py", "--rows", "30000", "--features", "8", "--epoch", "3")
    assert [r["rank"] for r in rows] == [0, 1, 2] and all(r["ok"] for r in rows)
    assert sum(r["rows_in"] for r in rows) == 3 * 30000
    dest = [shuffle.make_rows(src, 3, 30000, 0, 3)[:, 2] for src in range(3)]
    assert [r["rows_in"] for r in rows] == [sum(int((d == k).sum()) for d in dest)
                                            for k in range(3)]
