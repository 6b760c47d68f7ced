"""Consistency models as pure server-side state machines, one per server shard.

They see only events (a worker's gradient arrived, a worker asks to read, a worker
is lost, time passes) and answer with decisions, so every rule can be tested without
processes or channels. The server (rdmamw/ps/server.py) applies the decisions.

Terms: a worker's *clock* is how many gradients it has pushed; the server's
*version* is how many model updates it has made (rounds closed, for round models);
a gradient's *base* is the version the worker read before computing it, and its
*staleness* is ``version - base`` when it is applied."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from rdmamw.bootstrap import ranklist

log = logging.getLogger("rdmamw.ps")

APPLY, PEND, DROP = "apply", "pend", "drop"


@dataclass
class Consistency:
    """The user's choice, one switch: ``Consistency.parse("ssp:2")`` etc."""

    mode: str                       # bsp | asp | ssp | lsp | alsp | hybrid
    s: int = 0                      # SSP staleness
    k: int = 0                      # LSP / hybrid quorum (0: all workers)
    bound: int = 1                  # LSP/ALSP: largest staleness ever applied
    round_timeout: float = 10.0     # BSP/LSP/ALSP: close a round without a silent worker
    ratio: float = 1.5              # ALSP: speed ratio inside one worker group
    global_every: int = 4           # ALSP: every this many rounds wait for everybody
    dc: float = 0.0                 # delay compensation lambda (DC-ASGD; rdmamw/ps/optim.py)

    MODES = ("bsp", "asp", "ssp", "lsp", "alsp", "hybrid")
    HYBRID_DC = 0.04                # hybrid's default lambda (DC-ASGD's constant variant)

    @classmethod
    def parse(cls, text: str, **kw: float) -> Consistency:
        """``"bsp"``, ``"asp"``, ``"ssp:S"``, ``"lsp:K[:BOUND]"``, ``"alsp[:BOUND]"``,
        ``"hybrid[:K]"``; any of them may end in ``":dcLAMBDA"`` (delay compensation,
        e.g. ``"ssp:2:dc0.1"``; hybrid defaults to ``dc0.04``)."""
        name, *args = text.lower().split(":")
        if name not in cls.MODES:
            raise ValueError(f"consistency must be one of {cls.MODES}, not {text!r}")
        c = cls(name, **kw)  # type: ignore[arg-type]
        if name == "hybrid" and "dc" not in kw:
            c.dc = cls.HYBRID_DC
        try:
            if args and args[-1].startswith("dc"):
                c.dc = float(args.pop()[2:])
            nums = [int(a) for a in args]
        except ValueError:
            raise ValueError(f"cannot read the parameters of {text!r}") from None
        if name == "ssp" and nums:
            c.s = nums[0]
        elif name in ("lsp", "hybrid") and nums:
            c.k = nums[0]
            c.bound = nums[1] if len(nums) > 1 and name == "lsp" else c.bound
        elif name == "alsp" and nums:
            c.bound = nums[0]
        if c.s < 0 or c.k < 0 or c.bound < 0 or not c.dc >= 0:
            raise ValueError(f"negative parameter in {text!r}")
        return c

    def policy(self, workers: list[int]) -> Policy:
        if self.mode == "asp":
            return Async(workers, None)
        if self.mode == "ssp":
            return Async(workers, self.s)
        if self.mode == "bsp":
            return Rounds(workers, k=0, bound=0, timeout=self.round_timeout)
        if self.mode == "lsp":
            return Rounds(workers, k=self.k, bound=self.bound, timeout=self.round_timeout)
        if self.mode == "hybrid":
            return Hybrid(workers, k=self.k, timeout=self.round_timeout)
        return Adaptive(workers, bound=self.bound, timeout=self.round_timeout,
                        ratio=self.ratio, global_every=self.global_every)


@dataclass
class Policy:
    """Common state: who is alive, each worker's clock, and what was observed (the
    counters tests check the invariants against)."""

    workers: list[int]
    live: set[int] = field(init=False)
    clock: dict[int, int] = field(init=False)
    version: int = 0
    stats: dict = field(init=False)

    def __post_init__(self) -> None:
        self.live = set(self.workers)
        self.clock = {w: 0 for w in self.workers}
        self.stats = {"applied": 0, "dropped": 0, "merged": 0, "max_staleness": 0,
                      "staleness_sum": 0, "max_gap": 0,
                      "round_sizes": Counter(), "timeouts": 0,
                      "below_quorum": 0}

    def on_push(self, w: int, base: int, now: float, samples: int | None = None) -> str:
        """Worker ``w``'s gradient, computed on version ``base``, over ``samples``
        samples if it said (DSANA's unequal shares)."""
        raise NotImplementedError

    def can_read(self, w: int) -> bool:
        raise NotImplementedError

    def close_due(self, now: float) -> bool:
        return False

    def close(self, now: float) -> list[int]:
        raise NotImplementedError

    def lost(self, w: int) -> None:
        self.live.discard(w)

    def boundary(self) -> bool:
        """Whether a worker may join now: no round is open (its gradients would be
        judged by a membership they were not computed for)."""
        return True

    def join(self, w: int) -> None:
        """Worker ``w`` (a new one, or a lost one's replacement) is live from now on, at
        a :meth:`boundary`: counted in every later decision, never in an earlier one."""
        if w not in self.workers:
            self.workers.append(w)
        self.live.add(w)
        self.clock[w] = 0

    def _note_applied(self, staleness: int) -> None:
        self.stats["applied"] += 1
        self.stats["staleness_sum"] += staleness
        self.stats["max_staleness"] = max(self.stats["max_staleness"], staleness)

    @property
    def merged(self) -> int:
        """Gradients already in the model (a pending round's are not yet): what a
        training job counts its epochs by."""
        return self.stats["merged"]


class Async(Policy):
    """ASP (``s is None``): every gradient is applied when it arrives, reads never
    wait. SSP(s): the same, but a worker that has pushed ``c`` gradients may read only
    once every live worker has pushed at least ``c - s``, so the fastest worker starts
    an iteration at most ``s`` clocks ahead of the slowest."""

    def __init__(self, workers: list[int], s: int | None) -> None:
        super().__init__(list(workers))
        self.s = s

    def on_push(self, w: int, base: int, now: float, samples: int | None = None) -> str:
        self.clock[w] += 1
        self._note_applied(self.version - base)
        self.version += 1
        self.stats["merged"] += 1
        return APPLY

    def join(self, w: int) -> None:
        """SSP counts the newcomer's staleness from the current clock: it starts at the
        slowest live worker's, so nobody's read waits for it to catch up and it is not
        ahead of anybody."""
        others = [self.clock[v] for v in self.live if v != w]
        super().join(w)
        self.clock[w] = min(others, default=0)

    def can_read(self, w: int) -> bool:
        if self.s is None or not self.live:
            return True
        gap = self.clock[w] - min(self.clock[v] for v in self.live)
        if gap > self.s:
            return False
        self.stats["max_gap"] = max(self.stats["max_gap"], gap)
        return True


class Rounds(Policy):
    """BSP and LSP(k, bound). A round collects gradients and closes once ``k`` of the
    live workers have pushed a *fresh* gradient (computed on this round's model;
    ``k=0``: all of them: BSP), or once every live worker is in it, or after
    ``timeout`` s without the rest (logged). A late gradient (from a round that
    closed without it) joins the open round but does not count towards ``k``: a
    straggler's late work must not close a round before the fast workers' own. A
    worker whose fresh gradient is in the open round may not read until it closes, so
    each adds at most one fresh gradient per round; a late gradient's worker reads at
    once (each server decides its rounds alone: a worker late on one server and held
    there would wait for a round that needs the fresh gradient of a worker late and
    held on another, until ``timeout``). A gradient whose staleness would exceed
    ``bound`` is dropped (logged, counted) and its worker reads at once.

    When every live worker reports its samples (DSANA's shares), ``k`` of the ``n``
    live workers means fresh gradients over ``k / n`` of their latest shares' sum
    (the global batch): a worker left with a sliver of the batch cannot close a round
    alone."""

    def __init__(self, workers: list[int], *, k: int, bound: int, timeout: float) -> None:
        super().__init__(list(workers))
        self.k, self.bound, self.timeout = k, bound, timeout
        self.pending: list[int] = []
        self.fresh = 0                  # staleness-0 gradients in the open round
        self.holding: set[int] = set()  # their workers: no read until the round closes
        self.fresh_samples = 0
        self.share: dict[int, int] = {}   # each worker's latest reported samples
        self.opened = 0.0

    def quorum(self) -> int:
        n = len(self.live)
        return n if self.k <= 0 else min(self.k, n)

    def on_push(self, w: int, base: int, now: float, samples: int | None = None) -> str:
        self.clock[w] += 1
        staleness = self.version - base
        if samples is not None:
            self.share[w] = samples
        if staleness > self.bound:
            self.stats["dropped"] += 1
            log.warning("rdmamw.ps: dropped worker %d's gradient: staleness %d > bound %d",
                        w, staleness, self.bound)
            return DROP
        if not self.pending:
            self.opened = now
        self.pending.append(w)
        if staleness == 0:
            self.fresh += 1
            self.fresh_samples += samples or 0
            self.holding.add(w)
        self._note_applied(staleness)
        return PEND

    def can_read(self, w: int) -> bool:
        return w not in self.holding

    def boundary(self) -> bool:
        return not self.pending

    def join(self, w: int) -> None:
        super().join(w)
        self.share.pop(w, None)         # a lost worker's share is not its replacement's

    def close_due(self, now: float) -> bool:
        if not self.pending:
            return False
        if self._full():
            return True
        if now - self.opened >= self.timeout:
            missing = self.live - set(self.pending)
            self.stats["timeouts"] += 1
            log.warning("rdmamw.ps: round %d closed after %.1f s without workers %s",
                        self.version, self.timeout, ranklist.compact(missing))
            return True
        return False

    def _full(self) -> bool:
        """k fresh gradients (or k/n of the batch), or nobody live left to wait for."""
        if self.live.issubset(self.pending):
            return True
        k, n = max(1, self.quorum()), len(self.live)
        if k < n and all(w in self.share for w in self.live):
            return self.fresh >= 1 and \
                self.fresh_samples * n >= k * sum(self.share[w] for w in self.live)
        return self.fresh >= k

    def close(self, now: float) -> list[int]:
        if not self._full():
            self.stats["below_quorum"] += 1          # only a timeout closes these
        done, self.pending, self.fresh, self.fresh_samples = self.pending, [], 0, 0
        self.holding.clear()
        self.stats["round_sizes"][len(done)] += 1      # size -> rounds: bounded memory
        self.stats["merged"] += len(done)
        self.version += 1
        return done


class Adaptive(Rounds):
    """ALSP: LSP whose quorum follows live per-worker compute times. Workers are split
    into speed groups (consecutive, by time, within ``ratio`` of the group's fastest);
    the quorum is the smallest k covering whole groups, fastest first, such that every
    worker left out is expected to arrive within ``bound`` rounds (ceil(its time / the
    k-th fastest time) - 1 <= bound), so the
    fast group syncs among itself without dropping the slow ones' work; every
    ``global_every`` rounds the quorum is everybody (a global sync). Until every live
    worker has reported a time, it behaves as BSP."""

    def __init__(self, workers: list[int], *, bound: int, timeout: float, ratio: float,
                 global_every: int) -> None:
        super().__init__(workers, k=0, bound=bound, timeout=timeout)
        self.ratio, self.global_every = ratio, global_every
        self.times: dict[int, float] = {}
        self.groups: list[list[int]] = [sorted(workers)]

    def observe(self, w: int, seconds: float) -> None:
        """A worker's current compute time (the server passes a moving average from
        its metrics), then re-plan."""
        self.times[w] = seconds
        self.replan()

    def replan(self) -> None:
        live = [w for w in self.live if w in self.times]
        if len(live) < len(self.live) or not live:
            self.k = 0
            return
        order = sorted(live, key=lambda w: self.times[w])
        self.groups = []
        for w in order:
            if self.groups and self.times[w] <= self.ratio * self.times[self.groups[-1][0]]:
                self.groups[-1].append(w)
            else:
                self.groups.append([w])
        self.k = len(order)
        size = 0
        for g in self.groups:              # whole groups only: a group syncs together
            size += len(g)
            t_round = max(self.times[order[size - 1]], 1e-9)
            if all(math.ceil(self.times[w] / t_round) - 1 <= self.bound
                   for w in order[size:]):
                self.k = size
                break
        self.stats["k"] = self.k
        self.stats["groups"] = self.groups

    def quorum(self) -> int:
        if self.global_every > 0 and (self.version + 1) % self.global_every == 0:
            return len(self.live)
        return super().quorum()

    def lost(self, w: int) -> None:
        super().lost(w)
        self.times.pop(w, None)
        self.replan()

    def join(self, w: int) -> None:
        """A newcomer has no compute time yet: BSP until it reports one."""
        super().join(w)
        self.times.pop(w, None)
        self.replan()


class Hybrid(Rounds):
    """Hybrid sync/async: fresh gradients (computed on the current round's model)
    are synchronised in rounds that close at the first ``k`` of the live workers, as
    in LSP; a stale gradient (its round closed without it) is applied at once, alone,
    instead of waiting for or joining a round, and never dropped: its staleness is
    what delay compensation (``dc``) corrects. The version counts rounds only, so
    the async applies do not make the synchronous workers' gradients stale."""

    def __init__(self, workers: list[int], *, k: int, timeout: float) -> None:
        super().__init__(workers, k=k, bound=0, timeout=timeout)
        self.stats["async"] = 0                 # stale gradients applied on arrival

    def on_push(self, w: int, base: int, now: float, samples: int | None = None) -> str:
        staleness = self.version - base
        if staleness == 0 and w not in self.holding:
            return super().on_push(w, base, now, samples)
        self.clock[w] += 1
        self._note_applied(staleness)
        self.stats["merged"] += 1
        self.stats["async"] += 1
        return APPLY


def now() -> float:
    return time.monotonic()
