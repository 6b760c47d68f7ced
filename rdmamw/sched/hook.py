"""DSANA in a training loop: before each iteration, take this worker's share of the
round's global batch from the plan the scheduling server sent with the last pull, and
keep what the report needs (every worker's shares as the plan changed)."""

from __future__ import annotations

from typing import Any


class ShareHook:
    """A ``Trainer`` hook (rdmamw/apps/demo/train.py): sets ``trainer.batch_size`` to the
    worker's share (``node.assignment``); records every plan it sees."""

    def __init__(self) -> None:
        self.iterations = 0
        self.changes = 0
        self.first: list[int] | None = None
        self.last: list[int] | None = None
        self._sum: list[int] = []

    def __call__(self, trainer: Any) -> None:
        node = trainer.node
        if node.assignment is not None:
            trainer.batch_size = node.assignment[1]
        shares = getattr(node, "plan_shares", None)
        if shares is None:
            return
        if self.first is None:
            self.first, self._sum = list(shares), [0] * len(shares)
        elif shares != self.last:
            self.changes += 1
        self.last = list(shares)
        self._sum = [a + b for a, b in zip(self._sum, shares, strict=False)]
        self.iterations += 1

    def summary(self) -> dict:
        """Plans seen by this worker: first, last, mean per worker, and how often the
        plan changed."""
        n = max(1, self.iterations)
        return {"first_shares": self.first, "last_shares": self.last,
                "mean_shares": [s / n for s in self._sum], "plan_changes": self.changes,
                "iterations": self.iterations}
