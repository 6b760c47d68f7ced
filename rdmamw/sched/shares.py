"""Integer mini-batch shares in proportion to speed, within bounds, summing exactly to
the global batch (no sample unassigned, none twice, none negative).

First the continuous bounded-proportional split (water-filling: a worker whose
proportional part falls outside its bounds is pinned there and the rest is split
again among the others), then Hamilton's largest-remainder rounding: every worker
gets the floor of its part, and the samples still missing go one each to the largest
fractional parts. Each share is then within one sample of its exact part."""

from __future__ import annotations

import math
from collections.abc import Mapping


def bounds(total: int, n: int, min_frac: float, max_frac: float) -> tuple[int, int]:
    """Per-worker integer bounds around the fair share ``total / n``:
    ``[max(1, floor(min_frac * fair)), max(ceil(max_frac * fair), lo)]``, widened so
    that ``n`` workers can always cover ``total`` (``n * lo <= total <= n * hi``)."""
    if n <= 0 or total < 0:
        raise ValueError(f"need workers and a batch >= 0 (n={n}, total={total})")
    if not (0 <= min_frac <= 1 <= max_frac):
        raise ValueError(f"need 0 <= min_frac <= 1 <= max_frac, not {min_frac}, {max_frac}")
    fair = total / n
    lo = min(max(1, math.floor(min_frac * fair)), total // n)
    hi = max(math.ceil(max_frac * fair), lo, -(-total // n))
    return lo, hi


def apportion(total: int, weights: Mapping[int, float], lo: int = 0,
              hi: int | None = None) -> dict[int, int]:
    """Split ``total`` samples among the workers of ``weights`` (speed: larger gets
    more), each share in ``[lo, hi]``. Raises ValueError if the bounds cannot be met
    or a weight is not a finite positive number."""
    if total < 0 or lo < 0:
        raise ValueError(f"negative batch or bound (total={total}, lo={lo})")
    ws = dict(weights)
    if not ws:
        raise ValueError("no workers to share the batch")
    for w, x in ws.items():
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"worker {w!r}: weight must be finite and > 0, not {x!r}")
    hi = total if hi is None else hi
    if hi < lo or len(ws) * lo > total or len(ws) * hi < total:
        raise ValueError(f"{len(ws)} shares in [{lo}, {hi}] cannot sum to {total}")
    part = _water_fill(total, ws, lo, hi)
    share = {w: min(hi, max(lo, math.floor(p))) for w, p in part.items()}
    missing = total - sum(share.values())
    # largest remainders first; ties by worker id so the result is deterministic
    order = sorted(ws, key=lambda w: (-(part[w] - share[w]), w))
    while missing:
        step = 1 if missing > 0 else -1
        for w in order if step > 0 else reversed(order):
            if missing and lo <= share[w] + step <= hi:
                share[w] += step
                missing -= step
    return share


def _water_fill(total: int, ws: dict[int, float], lo: int, hi: int) -> dict[int, float]:
    part: dict[int, float] = {}
    free = dict(ws)
    left = float(total)
    while free:
        scale = left / sum(free.values())
        over = {w for w, x in free.items() if x * scale > hi}
        under = {w for w, x in free.items() if x * scale < lo}
        if not over and not under:
            part.update({w: x * scale for w, x in free.items()})
            break
        for w in over or under:           # pin one side, then split the rest again
            part[w] = hi if w in over else lo
            left -= part[w]
            del free[w]
    return part
