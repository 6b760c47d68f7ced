"""The training demo's summary: a table, a PNG plot of test accuracy vs wall time
per consistency model, and the JSON record. Times to reach the reference accuracy
(the first run's final accuracy, minus ``slack``) compare the models."""

from __future__ import annotations

import json
from collections.abc import Sequence

from rdmamw.apps.demo.train import RunResult


def time_to(res: RunResult, accuracy: float) -> float | None:
    """The first time worker 0 saw a model at least this accurate (None: never)."""
    for p in res.curve:
        if p.accuracy >= accuracy:
            return p.t
    return None


def summary(results: Sequence[RunResult], slack: float = 0.01) -> list[dict]:
    """Per run: final accuracy, wall time, and time to the first run's final
    accuracy minus ``slack``, also as a fraction of the first run's wall time."""
    if not results:
        return []
    ref = results[0]
    target = ref.final_accuracy - slack
    rows = []
    for r in results:
        t = time_to(r, target)
        rows.append({"name": r.name, "consistency": r.consistency,
                     "final_accuracy": r.final_accuracy, "wall_s": r.wall_s,
                     "reference": ref.name, "target_accuracy": target,
                     "time_to_target_s": t,
                     "time_to_target_vs_reference": None if t is None else t / ref.wall_s,
                     "wall_vs_reference": r.wall_s / ref.wall_s,
                     "iterations_worker0": r.iterations})
    return rows


def table(rows: Sequence[dict]) -> str:
    if not rows:
        return "(no runs)"
    ref = rows[0]
    w = max(11, *(len(r["consistency"]) for r in rows))
    nw = max(8, *(len(r["name"]) for r in rows))      # "bsp+dsana"
    head = (f"{'model':>{nw}} {'consistency':>{w}} {'test acc':>8} {'wall s':>7} "
            f"{'x ' + ref['name']:>7} {'to ' + format(ref['target_accuracy'], '.3f'):>9} "
            f"{'x ' + ref['name']:>7} {'iters w0':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r["time_to_target_s"]
        lines.append(
            f"{r['name']:>{nw}} {r['consistency']:>{w}} {r['final_accuracy']:>8.3f} "
            f"{r['wall_s']:>7.2f} {r['wall_vs_reference']:>7.2f} "
            f"{'never' if t is None else format(t, '.2f') + ' s':>9} "
            f"{'-' if t is None else format(r['time_to_target_vs_reference'], '.2f'):>7} "
            f"{r['iterations_worker0']:>8}")
    return "\n".join(lines)


def plot(results: Sequence[RunResult], path: str, title: str = "") -> None:
    """Test accuracy vs wall time, one line per run, a marker at each epoch's end."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for r in results:
        line, = ax.plot([p.t for p in r.curve], [p.accuracy for p in r.curve],
                        label=f"{r.name} ({r.consistency})", lw=1.6)
        ax.plot([p.t for p in r.epochs], [p.accuracy for p in r.epochs], "o",
                color=line.get_color(), ms=3.5)
    if results:
        ax.axhline(results[0].final_accuracy - 0.01, color="grey", ls=":", lw=1,
                   label=f"{results[0].name} final - 1 pt")
    ax.set_xlabel("wall time [s]")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(max(0.0, min((p.accuracy for r in results for p in r.curve[1:]),
                             default=0.0) - 0.05), 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_json(path: str, results: Sequence[RunResult], rows: Sequence[dict],
               job: dict) -> None:
    with open(path, "w") as f:
        json.dump({"job": job, "summary": list(rows),
                   "runs": [r.as_dict() for r in results]}, f, indent=1)
