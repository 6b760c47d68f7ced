"""`rdmamw demo`, the training cluster: a small local run (several models in one job,
table, plot, JSON), the same module under mpirun, bad options, and the pieces
(report figures, the trainer's batch hook) on their own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from test_ps import ROOT, clean_env  # noqa: E402

from rdmamw.apps.demo import mlp, report  # noqa: E402
from rdmamw.apps.demo.demo import configs, parser  # noqa: E402
from rdmamw.apps.demo.train import Point, RunConfig, RunResult, Trainer  # noqa: E402
from rdmamw.bootstrap.launch import free_port  # noqa: E402

SMALL = ["--workers", "2", "--servers", "1", "--epochs", "2", "--compute-ms", "1",
         "--quiet"]


def demo(*args: str, cwd, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = (launcher or []) + [sys.executable, "-m", "rdmamw.cli", "demo", *args]
    return subprocess.run(cmd, cwd=cwd, env={**clean_env(), "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=150)


def check_runs(path, names: list[str], epochs: int) -> dict:
    r = json.loads(path.read_text())
    assert [run["name"] for run in r["runs"]] == names
    for run in r["runs"]:
        assert run["final_accuracy"] > 0.75                        # chance is 0.1
        ep = run["epochs"]
        assert len(ep) == epochs
        pairs = zip(ep, ep[1:], strict=False)
        assert all(a["t"] < b["t"] and a["merged"] < b["merged"] for a, b in pairs)
        assert run["wall_s"] == pytest.approx(run["curve"][-1]["t"])
    assert [row["name"] for row in r["summary"]] == names
    return r


def test_demo_runs_each_model_and_writes_table_plot_json(tmp_path):
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    p = demo(*SMALL, "--consistency", "bsp,lsp,ssp:1", "--json", str(out), "--plot",
             str(png), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "test acc" in p.stdout and "lsp:1:2" in p.stdout    # LSP k = workers - 1
    r = check_runs(out, ["bsp", "lsp", "ssp"], 2)
    assert r["job"]["workers"] == 2 and r["job"]["straggler"] == 2.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (MPICH) installed")
def test_demo_under_mpirun(tmp_path):
    out = tmp_path / "m.json"
    p = demo(*SMALL, "--consistency", "asp", "--json", str(out), "--plot", "", cwd=tmp_path,
             launcher=["mpirun", "-n", "3", "-genv", "MASTER_PORT", str(free_port("127.0.0.1"))])
    assert p.returncode == 0, p.stderr[-3000:]
    r = check_runs(out, ["asp"], 2)
    assert r["job"]["launcher"] == "mpich"
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("args, text", [
    (["--consistency", "bsp,nope"], "consistency must be one of"),
    (["--servers", "0"], "at least one worker and one server"),
    (["--straggler", "0.5"], "--straggler >= 1"),
])
def test_demo_rejects_bad_options(tmp_path, args, text):
    p = demo(*args, cwd=tmp_path)
    assert p.returncode == 2 and text in p.stderr


def test_world_size_must_match_the_options(tmp_path):
    p = demo(*SMALL, "--servers", "2", cwd=tmp_path,
             launcher=[sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", "3", "--"])
    assert p.returncode != 0 and "world size 3" in p.stderr


def test_configs_fill_in_parameters():
    a = parser().parse_args(["--workers", "5", "--bound", "3", "--staleness", "4",
                             "--dc", "0.5", "--consistency", "bsp, ssp,lsp,alsp,lsp:2,hybrid"])
    assert [c.consistency for c in configs(a)] == ["bsp", "ssp:4", "lsp:4:3", "alsp:3",
                                                   "lsp:2", "hybrid:4:dc0.5"]


def _run(name: str, points: list[tuple[float, float]]) -> RunResult:
    curve = [Point(t, i, i, acc) for i, (t, acc) in enumerate(points)]
    return RunResult(name, name, curve[-1].accuracy, curve[-1].t, curve[-1:], curve, 1, {})


def test_summary_times_each_run_to_the_references_final_accuracy():
    rows = report.summary([_run("bsp", [(0, .1), (5, .90), (10, .95)]),
                           _run("lsp", [(0, .1), (3, .93), (4, .96), (6, .95)]),
                           _run("asp", [(0, .1), (7, .93)])])
    assert [r["time_to_target_s"] for r in rows] == [10, 4, None]   # target 0.94
    assert rows[1]["time_to_target_vs_reference"] == pytest.approx(0.4)
    assert rows[1]["wall_vs_reference"] == pytest.approx(0.6)
    text = report.table(rows)
    assert "never" in text and "0.40" in text


def test_trainer_reads_batch_size_each_iteration_and_covers_its_shard():
    data = mlp.Data(np.zeros((20, 64), np.float32), np.arange(20), np.zeros((1, 64)),
                    np.zeros(1, np.int64))
    tr = Trainer(None, 1, 2, RunConfig("bsp", "bsp", batch=4), data)  # type: ignore[arg-type]
    assert tr.slowdown == 1.0 and tr.steps_per_epoch == 5
    first = [tr.next_batch() for _ in range(2)]
    tr.batch_size = 2                                  # what a scheduler would do
    rest = [tr.next_batch() for _ in range(1)]
    assert [len(b) for b in first + rest] == [4, 4, 2]
    assert sorted(np.concatenate(first + rest)) == list(range(10))   # shard 1 of 2: 10 samples
    assert Trainer(None, 1, 2, RunConfig("bsp", "bsp", straggler=2.0), data).slowdown == 2.0  # type: ignore[arg-type]
