"""Ranks as an error message names them: compact and bounded, whatever the world size.

``compact([1, 3, 4, 5, 9])`` is ``"[1, 3-5, 9]"``; past ``SHOWN`` runs the rest is
counted, not listed (``"[0-3, 5, 7, ... and 1048000 more]"``), so a message about a job
of a million ranks stays a line."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

#: runs of consecutive ranks a message lists before "... and N more"
SHOWN = 16


def runs(ranks: Iterable[int]) -> Iterator[tuple[int, int]]:
    """(first, last) of each run of consecutive ranks of an ascending ``ranks``."""
    lo = hi = None
    for r in ranks:
        if hi is not None and r == hi + 1:
            hi = r
            continue
        if lo is not None:
            yield lo, hi
        lo = hi = r
    if lo is not None:
        yield lo, hi


def gaps(present: Iterable[int], size: int) -> Iterator[tuple[int, int]]:
    """The runs of ranks of ``range(size)`` not in ``present``: in the time of sorting
    ``present``, not of walking the whole range."""
    nxt = 0
    for r in sorted(set(present)):
        if r >= size:
            break
        if r > nxt:
            yield nxt, r - 1
        nxt = max(nxt, r + 1)
    if nxt < size:
        yield nxt, size - 1


def compact_runs(spans: Iterable[tuple[int, int]], shown: int = SHOWN) -> str:
    """``spans`` ((first, last) runs, ascending) as ``"[3-17, 20, 40-1023]"``, the runs
    past the first ``shown`` counted as "... and N more" (N ranks)."""
    parts: list[str] = []
    more = 0
    for lo, hi in spans:
        if len(parts) < shown:
            parts.append(str(lo) if lo == hi else f"{lo}-{hi}")
        else:
            more += hi - lo + 1
    if more:
        parts.append(f"... and {more} more")
    return "[" + ", ".join(parts) + "]"


def compact(ranks: Iterable[int], shown: int = SHOWN) -> str:
    """Any ``ranks`` (sorted here, repeats ignored) as :func:`compact_runs` shows them."""
    return compact_runs(runs(sorted(set(ranks))), shown)
