"""``rdmamw trace plot``: a timeline file (one rank's or ``rdmamw trace merge``'s) drawn
into a PNG with matplotlib, for a page or an issue where Perfetto cannot be opened:
per rank one lane of its collectives' steps (each collective a band behind them) and
one of its channels' batches (the doorbells as ticks), on one time axis in ms.

A parameter server's rounds (its ``round`` spans) get one row per server and worker
below the lanes: each round a cell from the previous close to its own, the worker's
gradient merged, merged last (the one the round waited for) or left out (a straggler
of a bounded model), so the eye finds the worker a job waits for or leaves behind.

``--collective SEQ`` draws the time of that collective on every rank (from the first
rank's start to the last one's end), ``--rounds FIRST:LAST`` the time of those rounds
(by version); matplotlib is needed (``pip install matplotlib``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

#: the steps' colours (rdmamw.trace.recorder.STEP_NAMES)
STEP_COLOURS = {"send": "#1f77b4", "recv": "#2ca02c", "recv into": "#2ca02c",
                "wait sent": "#7f7f7f"}
BATCH_COLOUR = "#ff7f0e"
WAIT_COLOUR = "#d62728"
#: a worker's part in a parameter server's round
ROUND_COLOURS = {"merged": "#a1d99b", "last": "#238b45", "left out": "#e7298a"}


def window(events: list[dict[str, Any]], seq: int | None,
           rounds: tuple[int, int] | None = None) -> tuple[float, float]:
    """The µs the plot spans: collective ``seq`` on every rank, the parameter servers'
    rounds of versions ``rounds`` (first, last), or everything."""
    spans = [e for e in events if e.get("ph") == "X"]
    if seq is not None:
        spans = [e for e in spans if e.get("cat") == "collective"
                 and e["args"].get("seq") == seq]
        if not spans:
            raise ValueError(f"no collective #{seq} in the file")
    if rounds is not None:
        spans = [e for e in spans if e.get("cat") == "ps"
                 and rounds[0] <= (e["args"].get("version") or 0) <= rounds[1]]
        if not spans:
            raise ValueError(f"no round of versions {rounds[0]} to {rounds[1]} in the file")
    if not spans:
        raise ValueError("no spans in the file")
    return min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)


#: (version, start µs, duration µs, the worker's part)
Cell = tuple[int, float, float, str]


def ps_rows(events: list[dict[str, Any]]) -> list[tuple[int, int, list[Cell]]]:
    """The parameter servers' rounds as the plot draws them: per server (its pid) and
    worker (every one a round merged or left out), in that order, the worker's cells:
    (version, start µs, duration µs, "merged" | "last" | "left out"), one per round it
    was live in, in time order."""
    by_server: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "ps" and e["name"] == "round":
            by_server.setdefault(e["pid"], []).append(e)
    rows = []
    for pid, rounds in sorted(by_server.items()):
        rounds.sort(key=lambda e: e["ts"])
        workers = sorted({w for e in rounds for w in e["args"]["merged"] + e["args"]["left_out"]})
        for w in workers:
            cells = []
            for e in rounds:
                a = e["args"]
                state = "last" if a.get("last") == w else "merged" if w in a["merged"] \
                    else "left out" if w in a["left_out"] else None
                if state is not None:
                    cells.append((a["version"], e["ts"], e["dur"], state))
            rows.append((pid, w, cells))
    return rows


def draw(doc: dict[str, Any], out: str, seq: int | None = None, title: str = "",
         rounds: tuple[int, int] | None = None) -> int:
    """Write the PNG; the number of spans drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = doc["traceEvents"]
    t0, t1 = window(events, seq, rounds)
    pad = (t1 - t0) * 0.01
    lo, hi = t0 - pad, t1 + pad
    ranks = sorted({e["pid"] for e in events if e.get("ph") in ("X", "i")})
    rows = ps_rows(events)
    nrow = len(rows) * 0.5                          # the rounds' rows: half a lane each
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(ranks) + 0.4 * nrow), dpi=110)
    drawn = 0

    def ms(ts: float) -> float:
        return (ts - t0) / 1000

    def shown(e: dict[str, Any]) -> bool:
        return bool(e["ts"] <= hi and e["ts"] + e.get("dur", 0) >= lo)

    ticks, labels = [], []
    for j, (pid, w, cells) in enumerate(rows):      # under the ranks' lanes
        y = nrow - 0.5 * (j + 1)
        for version, ts, dur, state in cells:
            if ts <= hi and ts + dur >= lo:
                ax.broken_barh([(ms(ts), dur / 1000)], (y + 0.05, 0.4), edgecolor="white",
                               lw=0.8, facecolor=ROUND_COLOURS[state], zorder=2)
                drawn += 1
                if j == 0 and dur > (hi - lo) * 0.025 and lo <= ts and ts + dur <= hi:
                    ax.text(ms(ts + dur / 2), y + 0.25, f"v{version}", ha="center",
                            va="center", fontsize=6, zorder=3)
        ticks.append(y + 0.25)
        labels.append(f"server {pid}: worker {w}")
    for i, pid in enumerate(ranks):
        base = nrow + (len(ranks) - 1 - i) * 2.0    # rank 0 on top
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
    ax.set_ylim(-0.2, nrow + 2.0 * len(ranks))
    ax.set_xlabel("time [ms]" + (f" from collective #{seq}'s start" if seq else
                                 f" from round v{rounds[0]}'s start" if rounds else ""))
    ax.set_title(title or ("one collective on every rank" if seq else "timeline"))
    ax.grid(axis="x", color="#eeeeee", lw=0.6)
    legend = [Patch(color="#dddddd", label="collective"),
              *(Patch(color=c, label=n) for n, c in STEP_COLOURS.items() if n != "recv into"),
              Patch(color=BATCH_COLOUR, label="batch (post to completion)"),
              Patch(color=WAIT_COLOUR, label="wait (credit, arrival)")]
    if rows:
        legend += [Patch(color=ROUND_COLOURS["merged"], label="round: merged"),
                   Patch(color=ROUND_COLOURS["last"], label="merged last (waited for)"),
                   Patch(color=ROUND_COLOURS["left out"], label="left out")]
    ax.legend(handles=legend, loc="upper center", ncol=5 if rows else 6, fontsize=8,
              bbox_to_anchor=(0.5, -0.5 / (len(ranks) + 0.5 * nrow) - 0.12), frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return drawn


def main(args: Any, parser: Any) -> int:
    """``rdmamw trace plot FILE -o OUT.png [--collective SEQ | --rounds A:B] [--title T]``."""
    try:
        with open(args.file) as f:
            doc = json.load(f)
        rounds = None
        if args.rounds:
            first, _, last = args.rounds.partition(":")
            rounds = (int(first), int(last or first))
        drawn = draw(doc, args.output, args.collective, args.title or "", rounds)
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
    p.add_argument("--rounds", metavar="FIRST:LAST",
                   help="only the time of the parameter servers' rounds of these versions")
    p.add_argument("--title", help="the plot's title")


__all__: Sequence[str] = ("draw", "main", "ps_rows", "window")
