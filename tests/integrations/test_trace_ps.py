"""A parameter-server job with a straggler in the timeline (docs/trace.md): one server
and three workers on shm under LSP (a round closes on two fresh gradients), worker 0
slower than the others, recorded with RDMAMW_TRACE and merged; ``rdmamw trace plot``'s
rows of rounds (rdmamw.trace.plot.ps_rows: per worker, each round merged, merged last
or left out) are, round by round, what the server's model decided (the job's
``--rounds`` log, tests/support/ps_job.py), and the PNG shows them."""

from __future__ import annotations

import json
import os

import pytest

from rdmamw import cli
from rdmamw.trace import plot
from tests.integrations.test_ps import run_job

WORKERS = 3
#: worker 0 sleeps this long before each of its gradients; the others do not
SLOW = "0.02"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(the merged file, its document, the server's rounds as it reported them)."""
    d = tmp_path_factory.mktemp("ps-trace")
    servers, workers, _ = run_job(1 + WORKERS, "--servers", "1", "--consistency", "lsp:2:8",
                                  "--iters", "30", "--big", "1000", "--slow", SLOW,
                                  "--rounds", RDMAMW_TRACE=str(d / "trace-%r.json"))
    assert len(workers) == WORKERS and all(w["pushes"] == 30 for w in workers)
    files = [str(d / f"trace-{r}.json") for r in range(1 + WORKERS)]
    assert cli.main(["trace", "merge", *files, "-o", str(d / "all.json")]) == 0
    with open(d / "all.json") as f:
        return str(d / "all.json"), json.load(f), servers[0]["rounds"]


def want_rows(rounds: list[list]) -> list[tuple[int, int, list[tuple[int, str]]]]:
    """The rows of the server's own log: each worker's part in each round it was live in."""
    rows = []
    for w in range(WORKERS):
        cells = []
        for version, merged, last, left_out in rounds:
            if w == last:
                cells.append((version, "last"))
            elif w in merged:
                cells.append((version, "merged"))
            elif w in left_out:
                cells.append((version, "left out"))
        rows.append((0, w, cells))
    return rows


def test_the_rows_of_rounds_are_what_the_server_decided(job):
    _, doc, rounds = job
    got = plot.ps_rows(doc["traceEvents"])
    assert [(pid, w, [(v, state) for v, _, _, state in cells]) for pid, w, cells in got] \
        == want_rows(rounds)
    spans = sorted((e for e in doc["traceEvents"] if e.get("cat") == "ps"),
                   key=lambda e: e["ts"])
    assert [[e["args"][k] for k in ("version", "merged", "last", "left_out")]
            for e in spans] == rounds
    # each worker's cells follow each other: a round starts where the last one ended
    for _, _, cells in got:
        assert all(a[1] + a[2] <= b[1] + 0.01 for a, b in zip(cells, cells[1:], strict=False))
    # the straggler is the one left out (the fast ones close the rounds without it)
    left_out = [sum(w in r[3] for r in rounds) for w in range(WORKERS)]
    assert left_out[0] > max(left_out[1:]), (left_out, rounds)


def test_the_plot_shows_the_rounds(job, tmp_path):
    mpimg = pytest.importorskip("matplotlib.image")
    from matplotlib.colors import to_rgb
    path, _, rounds = job
    out = str(tmp_path / "ps.png")
    assert cli.main(["trace", "plot", path, "-o", out, "--rounds", "2:12"]) == 0
    img = mpimg.imread(out)[:, :, :3]
    img = img[: int(img.shape[0] * 0.75)]          # the lanes and rows (the legend is below)

    def pixels(colour: str) -> int:
        return int((abs(img - to_rgb(colour)).max(axis=2) < 0.02).sum())

    for state, colour in plot.ROUND_COLOURS.items():
        assert pixels(colour) > 50, state
    with pytest.raises(SystemExit) as e:
        cli.main(["trace", "plot", path, "-o", str(tmp_path / "no.png"), "--rounds",
                  f"{len(rounds) + 5}:{len(rounds) + 9}"])
    assert e.value.code == 2 and not os.path.exists(tmp_path / "no.png")
