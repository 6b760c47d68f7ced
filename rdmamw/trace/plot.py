"""``rdmamw trace plot``: a timeline file (one rank's or ``rdmamw trace merge``'s) drawn
into a PNG with matplotlib, for a page or an issue where Perfetto cannot be opened:
per rank one lane of its collectives' steps (each collective a band behind them) and
one of its channels' batches (the doorbells as ticks), on one time axis in ms.

``--collective SEQ`` draws the time of that collective on every rank (from the first
rank's start to the last one's end); matplotlib is needed (``pip install
matplotlib``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

#: the steps' colours (rdmamw.trace.recorder.STEP_NAMES)
STEP_COLOURS = {"send": "#1f77b4", "recv": "#2ca02c", "recv into": "#2ca02c",
                "wait sent": "#7f7f7f"}
BATCH_COLOUR = "#ff7f0e"
WAIT_COLOUR = "#d62728"


def window(events: list[dict[str, Any]], seq: int | None) -> tuple[float, float]:
    """The µs the plot spans: collective ``seq`` on every rank, or everything."""
    spans = [e for e in events if e.get("ph") == "X"]
    if seq is not None:
        spans = [e for e in spans if e.get("cat") == "collective"
                 and e["args"].get("seq") == seq]
        if not spans:
            raise ValueError(f"no collective #{seq} in the file")
    if not spans:
        raise ValueError("no spans in the file")
    return min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)


def draw(doc: dict[str, Any], out: str, seq: int | None = None, title: str = "") -> int:
    """Write the PNG; the number of spans drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = doc["traceEvents"]
    t0, t1 = window(events, seq)
    pad = (t1 - t0) * 0.01
    lo, hi = t0 - pad, t1 + pad
    ranks = sorted({e["pid"] for e in events if e.get("ph") in ("X", "i")})
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(ranks)), dpi=110)
    drawn = 0

    def ms(ts: float) -> float:
        return (ts - t0) / 1000

    def shown(e: dict[str, Any]) -> bool:
        return bool(e["ts"] <= hi and e["ts"] + e.get("dur", 0) >= lo)

    ticks, labels = [], []
    for i, pid in enumerate(ranks):
        base = (len(ranks) - 1 - i) * 2.0           # rank 0 on top
        mine = [e for e in events if e["pid"] == pid and e.get("ph") in ("X", "i")
                and shown(e)]
        for e in mine:
            cat, x, w = e.get("cat"), ms(e["ts"]), e.get("dur", 0) / 1000
            if cat == "collective":
                ax.broken_barh([(x, w)], (base + 0.95, 0.9), color="#dddddd", zorder=0)
            elif cat == "step":
                ax.broken_barh([(x, w)], (base + 1.05, 0.7), zorder=2,
                               color=STEP_COLOURS.get(e["name"], "#9467bd"))
            elif cat == "wait":
                ax.broken_barh([(x, w)], (base + 1.0, 0.12), color=WAIT_COLOUR, zorder=3)
            elif cat == "batch" and e["ph"] == "X":
                ax.broken_barh([(x, w)], (base + 0.1, 0.7), color=BATCH_COLOUR, zorder=2)
            elif cat == "batch":
                ax.vlines(x, base + 0.05, base + 0.85, color="black", lw=0.6, zorder=4)
            else:
                continue
            drawn += 1
        ticks += [base + 0.45, base + 1.4]
        labels += [f"rank {pid} batches", f"rank {pid} steps"]
    ax.set_yticks(ticks, labels)
    ax.set_xlim(ms(lo), ms(hi))
    ax.set_ylim(-0.2, 2.0 * len(ranks))
    ax.set_xlabel("time [ms]" + (f" from collective #{seq}'s start" if seq else ""))
    ax.set_title(title or ("one collective on every rank" if seq else "timeline"))
    ax.grid(axis="x", color="#eeeeee", lw=0.6)
    ax.legend(handles=[Patch(color="#dddddd", label="collective"),
                       *(Patch(color=c, label=n) for n, c in STEP_COLOURS.items()
                         if n != "recv into"),
                       Patch(color=BATCH_COLOUR, label="batch (post to completion)"),
                       Patch(color=WAIT_COLOUR, label="wait (credit, arrival)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.5 / len(ranks) - 0.12),
              ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return drawn


def main(args: Any, parser: Any) -> int:
    """``rdmamw trace plot FILE -o OUT.png [--collective SEQ] [--title T]``."""
    try:
        with open(args.file) as f:
            doc = json.load(f)
        drawn = draw(doc, args.output, args.collective, args.title or "")
    except (OSError, ValueError, KeyError) as e:
        parser.exit(2, f"rdmamw trace plot: {e}\n")
    except ImportError:
        parser.exit(2, "rdmamw trace plot: needs matplotlib (pip install matplotlib)\n")
    print(f"{args.output}: {drawn} spans of {args.file}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="draw a timeline file into a PNG (matplotlib)")
    p.add_argument("file", help="a timeline (RDMAMW_TRACE's or rdmamw trace merge's)")
    p.add_argument("-o", "--output", required=True, help="the PNG")
    p.add_argument("--collective", type=int, help="only the time of collective SEQ")
    p.add_argument("--title", help="the plot's title")


__all__: Sequence[str] = ("draw", "main", "window")
