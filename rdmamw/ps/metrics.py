"""Per-worker measurements: compute time per iteration, push / pull latency, bytes.

The compute time (pull returned -> next push starts) is what ALSP plans with; it
leaves out time spent waiting on the server, which a synchronous model would
otherwise spread from the slowest worker to everybody."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Series:
    """Count, total, last, exponential moving average (alpha 0.3) and maximum."""

    n: int = 0
    total: float = 0.0
    last: float = 0.0
    ema: float = 0.0
    max: float = 0.0

    def add(self, x: float) -> None:
        self.ema = x if self.n == 0 else 0.7 * self.ema + 0.3 * x
        self.n += 1
        self.total += x
        self.last = x
        self.max = max(self.max, x)

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def as_dict(self) -> dict:
        return {"n": self.n, "mean": self.mean, "last": self.last, "ema": self.ema,
                "max": self.max}


class ComputeClock:
    """A worker's compute time: from the end of its last pull to its next push, less
    the time it spent communicating meanwhile (push_part, stream waits): what it
    reports to ALSP and DSANA."""

    def __init__(self) -> None:
        self.since: float | None = None     # end of the last pull; None before the first
        self.comm_s = 0.0

    def restart(self, now: float) -> None:
        self.since, self.comm_s = now, 0.0

    def add_comm(self, seconds: float) -> None:
        self.comm_s += seconds

    def compute(self, now: float) -> float | None:
        return None if self.since is None else max(0.0, now - self.since - self.comm_s)


@dataclass
class WorkerMetrics:
    """What one KVWorker measured; ``as_dict()`` for logs and JSON."""

    compute: Series = field(default_factory=Series)
    push: Series = field(default_factory=Series)
    pull: Series = field(default_factory=Series)
    bytes_pushed: int = 0
    bytes_pulled: int = 0

    def as_dict(self) -> dict:
        return {"compute_s": self.compute.as_dict(), "push_s": self.push.as_dict(),
                "pull_s": self.pull.as_dict(), "bytes_pushed": self.bytes_pushed,
                "bytes_pulled": self.bytes_pulled}


@dataclass
class PeerMetrics:
    """What a server sees of one worker: its reported compute times (ALSP's input),
    gradients received and bytes each way."""

    compute: Series = field(default_factory=Series)
    gradients: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def as_dict(self) -> dict:
        return {"compute_s": self.compute.as_dict(), "gradients": self.gradients,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}
