"""The DSANA scheduler: metrics in, one assignment of the global batch per round out.

Each round (the server calls :meth:`Dsana.plan` when a BSP round closes):

1. :class:`~rdmamw.sched.classify.Classifier` updates every worker's class from its
   smoothed per-sample time (hysteresis; silent workers FAILED).
2. Target weights: if every live worker is NORMAL, equal weights (noise among equals
   moves nothing); otherwise speed ``1 / ewma`` for stragglers and fast workers and the
   median speed for normal ones.
3. :func:`~rdmamw.sched.shares.apportion` turns them into integer shares in
   ``[min_frac, max_frac]`` x the fair share that sum to ``global_batch``.
4. :class:`~rdmamw.sched.cost.CostModel` keeps the old shares unless the change saves
   more than it costs. A change of the live set (a worker failed or came back) is
   always taken: the batch must stay fully assigned.

The plan is a ``{worker: (offset, share)}`` map over the live workers: worker ``w``
computes samples ``[offset, offset + share)`` of the round's global batch."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rdmamw.sched.classify import FAILED, NORMAL, Classifier
from rdmamw.sched.cost import CostModel, Verdict
from rdmamw.sched.shares import apportion, bounds


@dataclass
class Dsana:
    workers: list[int]
    global_batch: int
    classifier: Classifier | None = None
    cost: CostModel = field(default_factory=CostModel)
    min_frac: float = 0.1
    max_frac: float = 2.0
    shares: dict[int, int] = field(init=False)
    stats: dict = field(init=False)
    last: Verdict | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("DSANA needs at least one worker")
        if self.global_batch < len(self.workers):
            raise ValueError(f"global batch {self.global_batch} < {len(self.workers)} workers")
        if self.classifier is None:
            self.classifier = Classifier(list(self.workers))
        self.shares = self._equal(sorted(self.workers))
        self.stats = {"rounds": 0, "changes": 0, "refused": 0, "moved": 0,
                      "membership_changes": 0, "classes": Counter(), "busy_s": 0.0}

    # -- inputs -------------------------------------------------------------------------

    def observe(self, w: int, seconds: float, samples: int, now: float) -> None:
        """Worker ``w`` spent ``seconds`` computing its ``samples`` (its report)."""
        assert self.classifier is not None
        t0 = time.perf_counter()
        self.classifier.observe(w, seconds, samples, now)
        self.stats["busy_s"] += time.perf_counter() - t0

    def lost(self, w: int) -> None:
        assert self.classifier is not None
        self.classifier.lost(w)

    # -- the decision ---------------------------------------------------------------------

    def plan(self, now: float) -> dict[int, tuple[int, int]]:
        """Decide this round's assignment (see the module doc); returns
        ``{worker: (offset, share)}``. ``stats["busy_s"]``: the scheduler's own time."""
        t0 = time.perf_counter()
        try:
            return self._plan(now)
        finally:
            self.stats["busy_s"] += time.perf_counter() - t0

    def _plan(self, now: float) -> dict[int, tuple[int, int]]:
        c = self.classifier
        assert c is not None
        classes = c.update(now)
        self.stats["rounds"] += 1
        self.stats["classes"] = Counter(classes.values())
        live = sorted(w for w, s in classes.items() if s != FAILED)
        if not live:
            return {}
        if sorted(self.shares) != live:
            self.shares = self._target(live, classes)
            self.stats["membership_changes"] += 1
            return self.assignment()
        target = self._target(live, classes)
        if target != self.shares:
            med = c.median() or 1.0
            per_sample = {w: c.ewma.get(w, med) for w in live}
            self.last = v = self.cost.judge(self.shares, target, per_sample)
            if v.take:
                self.shares = target
                self.stats["changes"] += 1
                self.stats["moved"] += v.moved
            else:
                self.stats["refused"] += 1
        return self.assignment()

    def assignment(self) -> dict[int, tuple[int, int]]:
        out, o = {}, 0
        for w in sorted(self.shares):
            out[w] = (o, self.shares[w])
            o += self.shares[w]
        return out

    def classes(self) -> dict[int, str]:
        assert self.classifier is not None
        return dict(self.classifier.state)

    # -- helpers --------------------------------------------------------------------------

    def _target(self, live: list[int], classes: dict[int, str]) -> dict[int, int]:
        c = self.classifier
        assert c is not None
        med = c.median()
        if med is None or all(classes[w] == NORMAL for w in live):
            return self._equal(live)
        weights = {w: 1.0 / max(1e-12, med if classes[w] == NORMAL else c.ewma.get(w, med))
                   for w in live}
        lo, hi = bounds(self.global_batch, len(live), self.min_frac, self.max_frac)
        return apportion(self.global_batch, weights, lo, hi)

    def _equal(self, live: list[int]) -> dict[int, int]:
        return apportion(self.global_batch, dict.fromkeys(live, 1.0))
