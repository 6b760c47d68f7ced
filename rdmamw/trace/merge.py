"""``rdmamw trace merge``: the ranks' timelines (rdmamw/trace/recorder.py) on one
clock. Each file's times are its process's monotonic clock, which means nothing to
another host (nor, across a reboot, to this one); each file also says that clock's
offset to the wall clock, so its times become wall-clock times, and the merged file
counts from the earliest span of any rank. Ranks stay apart as processes (pid = rank).

The alignment is as good as the hosts' wall clocks agree (NTP: typically well under
a millisecond in one data centre); on one host it is exact."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rdmamw.trace.recorder import VERSION


def load(path: str) -> dict[str, Any]:
    """A timeline written by rdmamw.trace (ValueError for any other file)."""
    with open(path) as f:
        doc: dict[str, Any] = json.load(f)
    meta = doc.get("otherData", {}).get("rdmamw") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or meta.get("version") != VERSION \
            or type(meta.get("wall_minus_clock_ns")) is not int:
        raise ValueError(f"{path}: not a timeline written by rdmamw.trace (version "
                         f"{VERSION})")
    return doc


def merge(paths: Sequence[str]) -> dict[str, Any]:
    """One trace-event document of the files at ``paths`` (each one process's)."""
    docs = [(p, load(p)) for p in paths]
    # (the offsets are ~1.8e18 ns: worked in integers, relative to the smallest, so
    # that the µs floats keep their ns)
    low = min((doc["otherData"]["rdmamw"]["wall_minus_clock_ns"] for _, doc in docs),
              default=0)
    owner: dict[Any, str] = {}
    starts = []
    for p, doc in docs:
        for pid in {e["pid"] for e in doc["traceEvents"]}:
            if pid in owner:
                raise ValueError(f"{p} and {owner[pid]} are both process {pid} (the same "
                                 f"rank twice?)")
            owner[pid] = p
        offset = (doc["otherData"]["rdmamw"]["wall_minus_clock_ns"] - low) / 1000
        starts += [e["ts"] + offset for e in doc["traceEvents"] if "ts" in e]
    base = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    sources = []
    for p, doc in docs:
        meta = doc["otherData"]["rdmamw"]
        shift = (meta["wall_minus_clock_ns"] - low) / 1000 - base
        for e in doc["traceEvents"]:
            if "ts" in e:
                e = {**e, "ts": max(0.0, round(e["ts"] + shift, 3))}
            events.append(e)
        sources.append({"path": p, **meta})
    events.sort(key=lambda e: (e["pid"], e.get("ts", -1.0)))
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"rdmamw": {
        "version": VERSION, "clock": "wall", "wall_start_ns": low + round(base * 1000),
        "merged": sources}}}


def main(argv: Sequence[str]) -> int:
    """``rdmamw trace merge FILE... -o OUT`` (and ``rdmamw trace plot``: plot.py)."""
    import argparse

    from rdmamw.trace import plot
    parser = argparse.ArgumentParser(prog="rdmamw trace",
                                     description="the ranks' timelines (RDMAMW_TRACE) "
                                                 "on one clock, for Perfetto")
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge per-rank trace files into one")
    m.add_argument("files", nargs="+", help="the ranks' files (RDMAMW_TRACE)")
    m.add_argument("-o", "--output", required=True, help="the merged file")
    plot.add_parser(sub)
    args = parser.parse_args(list(argv))
    if args.cmd == "plot":
        return plot.main(args, parser)
    try:
        doc = merge(args.files)
    except (OSError, ValueError) as e:
        parser.exit(2, f"rdmamw trace merge: {e}\n")
    with open(args.output, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    spans = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X")
    print(f"{args.output}: {spans} spans of {len(args.files)} processes")
    return 0
