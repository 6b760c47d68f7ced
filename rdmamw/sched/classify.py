"""Which workers are stragglers, normal or fast: a robust, flap-free rule.

Input: each worker's reported iteration (compute) time and the number of samples it
processed. The rule looks at the **per-sample** time, smoothed by an EWMA: once the
scheduler has given a straggler fewer samples, its iteration time is no longer long
(that was the point), but its per-sample time still is, so it stays a straggler and
the assignment does not swing back.

``r = ewma(w) / median(ewma over the live workers)``; a normal worker becomes a
straggler at ``r >= slow_enter`` and only returns to normal at ``r < slow_exit``
(likewise fast at ``r <= fast_enter``, back at ``r > fast_exit``): the gap between
enter and exit is the hysteresis. The median ignores one outlier among three or
more. A worker silent for more than ``fail_after`` seconds is FAILED (it gets no
samples, and its stale time does not enter the median); it rejoins as soon as it
reports again."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

STRAGGLER, NORMAL, FAST, FAILED = "straggler", "normal", "fast", "failed"


@dataclass
class Classifier:
    """State of the rule for a fixed set of worker ids; time is passed in (``now``),
    so every decision can be replayed with injected timings."""

    workers: list[int]
    alpha: float = 0.3              # EWMA weight of the newest sample
    slow_enter: float = 1.3
    slow_exit: float = 1.15
    fast_enter: float = 0.8
    fast_exit: float = 0.9
    fail_after: float = 5.0         # s without a report -> FAILED
    ewma: dict[int, float] = field(init=False)
    seen: dict[int, float] = field(init=False)
    state: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        if not (0 < self.alpha <= 1):
            raise ValueError(f"alpha must be in (0, 1], not {self.alpha}")
        if not (self.fast_enter <= self.fast_exit <= 1 <= self.slow_exit <= self.slow_enter):
            raise ValueError("need fast_enter <= fast_exit <= 1 <= slow_exit <= slow_enter")
        if self.fail_after <= 0:
            raise ValueError(f"fail_after must be > 0, not {self.fail_after}")
        self.ewma, self.seen = {}, {}
        self.state = dict.fromkeys(self.workers, NORMAL)

    def observe(self, w: int, seconds: float, samples: int, now: float) -> None:
        """One iteration of worker ``w``: ``seconds`` of compute on ``samples`` samples
        (0 samples: only a sign of life, from a worker that had no share). A FAILED
        worker that reports again rejoins as NORMAL with a fresh average."""
        if w not in self.state:
            raise KeyError(f"unknown worker {w!r}")
        if not (math.isfinite(seconds) and seconds >= 0) or samples < 0:
            raise ValueError(f"worker {w}: bad report ({seconds!r} s, {samples!r} samples)")
        self.seen[w] = now
        if samples == 0:
            if self.state[w] == FAILED:
                self.state[w] = NORMAL
            return
        x = seconds / samples
        if self.state[w] == FAILED or w not in self.ewma:
            self.ewma[w] = x
            self.state[w] = NORMAL
        else:
            self.ewma[w] = (1 - self.alpha) * self.ewma[w] + self.alpha * x

    def lost(self, w: int) -> None:
        """The server lost the worker (or it said goodbye): FAILED until it reports."""
        self.state[w] = FAILED
        self.ewma.pop(w, None)

    def median(self) -> float | None:
        vals = [self.ewma[w] for w in self.live() if w in self.ewma]
        return statistics.median(vals) if vals else None

    def live(self) -> list[int]:
        return [w for w in self.workers if self.state[w] != FAILED]

    def update(self, now: float) -> dict[int, str]:
        """Apply the failure timeout and the hysteresis rule; return every class."""
        for w in self.workers:
            self.seen.setdefault(w, now)            # the clock of one never heard starts now
            if self.state[w] != FAILED and now - self.seen[w] > self.fail_after:
                self.lost(w)
        med = self.median()
        for w in self.live():
            if med is None or med <= 0 or w not in self.ewma:
                continue
            r, s = self.ewma[w] / med, self.state[w]
            if s == STRAGGLER:
                s = STRAGGLER if r >= self.slow_exit else NORMAL
            elif s == FAST:
                s = FAST if r <= self.fast_exit else NORMAL
            if s == NORMAL:
                s = STRAGGLER if r >= self.slow_enter else FAST if r <= self.fast_enter else NORMAL
            self.state[w] = s
        return dict(self.state)
