"""Is a new assignment worth it? Time saved against the cost of moving the work.

A BSP round lasts as long as its slowest worker: ``max_w share_w * t_w`` with ``t_w``
the worker's per-sample time. Moving to new shares saves
``(round(old) - round(new)) * horizon`` seconds over the next ``horizon`` rounds and
costs ``switch_s`` (a fixed price per change: a new plan, colder caches) plus the
transfer of every moved sample (``sample_bytes`` at ``bandwidth`` bytes/s; the
samples a worker gains have to reach it). The change is taken only if it saves more
than it costs and at least ``min_gain`` of the current round time, so measurement
noise does not shuffle samples back and forth."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """The numbers behind one decision (for logs, stats and tests)."""

    take: bool
    saved_s: float          # over the horizon
    cost_s: float
    moved: int              # samples that change worker
    round_old_s: float
    round_new_s: float


@dataclass(frozen=True)
class CostModel:
    sample_bytes: int = 256             # 64 float32 features (digits)
    bandwidth: float = 1e9              # bytes/s a moved sample travels at
    switch_s: float = 1e-4              # fixed price of changing the plan
    horizon: int = 1                    # rounds the new plan is expected to hold
    min_gain: float = 0.02              # of the current round time

    def __post_init__(self) -> None:
        if self.sample_bytes < 0 or self.bandwidth <= 0 or self.switch_s < 0 \
                or self.horizon < 1 or self.min_gain < 0:
            raise ValueError(f"bad cost model {self}")

    @staticmethod
    def round_time(shares: Mapping[int, int], per_sample: Mapping[int, float]) -> float:
        return max((shares[w] * per_sample[w] for w in shares), default=0.0)

    @staticmethod
    def moved(old: Mapping[int, int], new: Mapping[int, int]) -> int:
        """Samples that change hands: what the gaining workers gain."""
        return sum(max(0, n - old.get(w, 0)) for w, n in new.items())

    def judge(self, old: Mapping[int, int], new: Mapping[int, int],
              per_sample: Mapping[int, float]) -> Verdict:
        r_old, r_new = self.round_time(old, per_sample), self.round_time(new, per_sample)
        moved = self.moved(old, new)
        cost = self.switch_s + moved * self.sample_bytes / self.bandwidth
        saved = (r_old - r_new) * self.horizon
        take = saved > cost and r_old - r_new >= self.min_gain * r_old
        return Verdict(take, saved, cost, moved, r_old, r_new)
