"""What the metrics say, read when asked (a scrape, :func:`snapshot`) from the counters
the channels keep anyway (``Channel.stats()``), so measuring costs the data path
nothing: no counter is incremented per message for the metrics' sake. Plain Python,
without prometheus_client: rdmamw/metrics/exporter.py turns a reading into its metric
families.

Per channel, by provider and peer (the peer's rank, or its address for a channel
opened by address), the channels to one peer summed, closed ones included; beyond
``RDMAMW_METRICS_MAX_PEERS`` peers, the later ones summed under ``peer="other"``. Per
process: the registration caches and pool, the errors by kind, the collectives' and
connects' times, the parameter servers' counters."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rdmamw import _fork, config, errors, observe
from rdmamw.engine import _messages
from rdmamw.errors import RdmamwError
from rdmamw.memory.counters import channel_stats

#: the counters per provider and peer: (name, unit, help, the stats() key it sums).
#: A counter's name in the exposition and in :func:`snapshot` is ``name + "_total"``.
CHANNEL_COUNTERS: tuple[tuple[str, str, str, str], ...] = (
    ("rdmamw_messages_sent", "", "messages sent to the peer", "messages"),
    ("rdmamw_messages_received", "", "messages received from the peer", "messages_received"),
    ("rdmamw_sent_bytes", "bytes", "bytes of the messages sent", "bytes"),
    ("rdmamw_received_bytes", "bytes", "bytes of the messages received", "bytes_received"),
    ("rdmamw_batches", "", "batches sent (one chain of work requests each)", "batches"),
    ("rdmamw_doorbells", "", "doorbells rung (writes posted to the transport)", "doorbells"),
    ("rdmamw_work_requests", "", "work requests posted", "work_requests"),
    ("rdmamw_signaled_completions", "", "work requests that asked for a completion",
     "signaled_completions"),
    ("rdmamw_credit_waits", "", "sends that waited for free slots in the peer's ring",
     "credit_waits"),
    ("rdmamw_credit_wait_seconds", "seconds", "time sends spent waiting for free slots, "
     "rendezvous entries or done bits", "credit_wait_seconds"),
    ("rdmamw_sleeps", "", "times this side slept in the transport's wait", "sleeps"),
    ("rdmamw_arrival_sleeps", "", "receives that slept for a message", "arrival_sleeps"),
    ("rdmamw_wakeups_sent", "", "wake-ups sent to a sleeping peer", "wakeups_sent"),
    ("rdmamw_rendezvous_received", "", "large messages received by rendezvous",
     "rndv_received"),
    ("rdmamw_rendezvous_sent_bytes", "bytes", "bytes sent by rendezvous", "rndv_bytes"),
)
#: rendezvous sends by strategy: ``write`` (we WROTE into the receiver's buffer) and
#: ``read`` (the receiver READ ours); in a reading's rows as the samples' names
RENDEZVOUS = "rdmamw_rendezvous_sent"


def sample(name: str, **labels: str) -> str:
    """``name{k="v",...}``: how a labelled value is keyed in a reading's rows."""
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


RNDV_READ = sample(RENDEZVOUS + "_total", strategy="read")
RNDV_WRITE = sample(RENDEZVOUS + "_total", strategy="write")
#: the per-process counters of the registration caches: (name, unit, help, key)
MEMORY_COUNTERS: tuple[tuple[str, str, str, str], ...] = (
    ("rdmamw_registrations", "", "memory registrations made (caches and pool)",
     "registrations"),
    ("rdmamw_registration_cache_hits", "", "large buffers found registered", "regcache_hits"),
    ("rdmamw_registration_cache_misses", "", "large buffers registered on use",
     "regcache_misses"),
)
#: the collectives' histogram buckets (seconds): sub-microsecond to 10 s, as the
#: default buckets (5 ms to 10 s) cannot tell a 2 us allreduce from a 2 ms one
BUCKETS: tuple[float, ...] = (
    5e-7, 1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
    5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: the parameter servers' counters (rdmamw.ps.KVServer.stats(), the servers of the
#: process summed): (name, help, how to read it from one server's stats)
PS_COUNTERS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("rdmamw_ps_rounds", "rounds closed", lambda s: sum(s.get("round_sizes", {}).values())),
    ("rdmamw_ps_round_timeouts", "rounds closed by their timeout, without every worker",
     lambda s: s.get("timeouts", 0)),
    ("rdmamw_ps_gradients_applied", "gradients taken into the model (or a round)",
     lambda s: s["applied"]),
    ("rdmamw_ps_gradients_dropped", "gradients dropped as too stale",
     lambda s: s["dropped"]),
    ("rdmamw_ps_staleness", "staleness (model versions behind) of the gradients applied, "
     "summed", lambda s: s.get("staleness_sum", 0)),
    ("rdmamw_ps_samples_moved", "samples DSANA moved from worker to worker",
     lambda s: s.get("dsana", {}).get("moved", 0)),
    ("rdmamw_ps_plan_changes", "DSANA's changes of the workers' shares",
     lambda s: s.get("dsana", {}).get("changes", 0)),
)
OTHER = "other"
K = TypeVar("K")


@dataclass
class Reading:
    """One reading of everything: ``channels`` (provider, peer label) -> metric name ->
    value (``rdmamw_channels_open`` too), ``memory`` and ``errors`` per process,
    ``collectives`` kind -> :class:`Times`, ``connects`` (provider, outcome) ->
    :class:`Times`, ``ps`` the parameter servers' counters, and this process's rank
    ("" before init)."""

    rank: str
    channels: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, Times] = field(default_factory=dict)
    connects: dict[tuple[str, str], Times] = field(default_factory=dict)
    ps: dict[str, float] = field(default_factory=dict)
    batches: Times | None = None


class Times:
    """A histogram of one collective's times (its buckets are :data:`BUCKETS`)."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)     # the last: above 10 s
        self.count, self.sum = 0, 0.0

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at most that) per bucket, +Inf last."""
        out, n = [], 0
        for le, c in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            n += c
            out.append((le, n))
        return out


class _Recorder(Generic[K]):
    """Histograms of times by a key (a collective's kind; a connect's provider and
    outcome), filled by the hooks of rdmamw.observe while metrics are enabled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times: dict[K, Times] = {}

    def __call__(self, key: K, seconds: float) -> None:
        i = bisect.bisect_left(BUCKETS, seconds)
        with self.lock:
            t = self.times.get(key)
            if t is None:
                t = self.times[key] = Times()
            t.counts[i] += 1
            t.count += 1
            t.sum += seconds

    def copy(self) -> dict[K, Times]:
        with self.lock:
            out = {}
            for key, t in self.times.items():
                c = out[key] = Times()
                c.counts, c.count, c.sum = list(t.counts), t.count, t.sum
            return out


_recorder: _Recorder[str] = _Recorder()
_connects: _Recorder[tuple[str, str]] = _Recorder()


def _connected(provider: str, outcome: str, seconds: float) -> None:
    """rdmamw.observe.connect while metrics are enabled."""
    _connects((provider, outcome), seconds)
_labels: dict[str, str] = {}        # peer -> its label (itself, or OTHER): fixed once given
_labels_lock = threading.Lock()


def enable() -> None:
    """Record the collectives', the connects' and the batches' completion times (the
    histograms) from now on."""
    observe.collective = _recorder
    observe.connect = _connected
    _messages.time_batches(BUCKETS, True)


def disable() -> None:
    observe.collective = None
    observe.connect = None
    _messages.time_batches(BUCKETS, False)


def batch_times() -> Times:
    """The batches' completion times so far (rdmamw/engine/_messages.pyx keeps them:
    from a batch's post to the first ``done()`` that says so, or its ``wait()``)."""
    t = Times()
    t.counts, t.sum = _messages.batch_times()
    t.count = sum(t.counts)
    return t


def label(peer: str) -> str:
    """``peer``'s label: its own while fewer than RDMAMW_METRICS_MAX_PEERS peers have one,
    else ``"other"``; once given, a peer keeps its label (a series never moves)."""
    with _labels_lock:
        got = _labels.get(peer)
        if got is None:
            own = sum(1 for v in _labels.values() if v != OTHER)
            got = _labels[peer] = peer if own < config.get("RDMAMW_METRICS_MAX_PEERS") \
                else OTHER
        return got


def rank() -> str:
    """This process's rank in the job of rdmamw.init(), "" before it."""
    from rdmamw import bootstrap
    try:
        return str(bootstrap.world().rank)
    except RdmamwError:
        return ""


def read() -> Reading:
    """Everything, now."""
    caches: dict[int, Any] = {}

    def one(key: observe.Key, ch: Any) -> dict[str, Any]:
        for c in (getattr(ch, "regcache", None), getattr(ch, "regcache_dst", None)):
            if c is not None:
                caches[id(c)] = c
        s: dict[str, Any] = ch.stats()
        add(key, s, 1)
        return s

    r = Reading(rank())

    def add(key: observe.Key, s: dict[str, Any], live: int) -> None:
        row = r.channels.setdefault((key[0], label(key[1])), _zero())
        for name, _, _, k in CHANNEL_COUNTERS:
            row[name + "_total"] += s.get(k, 0)
        writes = s.get("rndv_writes", 0)
        row[RNDV_WRITE] += writes
        row[RNDV_READ] += s.get("rndv_sends", 0) - writes
        row["rdmamw_channels_open"] += live

    closed = observe.read(one)
    for key, s in closed.items():
        add(key, s, 0)
    mem = channel_stats(list(caches.values()))
    r.memory = {name + "_total": mem[k] for name, _, _, k in MEMORY_COUNTERS}
    r.memory["rdmamw_pinned_bytes"] = mem["bytes_pinned"]
    r.errors = dict(errors.COUNTS)
    r.collectives = _recorder.copy()
    r.connects = _connects.copy()
    r.ps = ps()
    r.batches = batch_times()
    return r


def ps() -> dict[str, float]:
    """The parameter servers' counters (``name + "_total"``, summed over the process's
    servers) and ``rdmamw_ps_staleness_max``; empty without a server."""
    out: dict[str, float] = {}
    for srv in observe.servers():
        s = srv.stats()
        for name, _, get in PS_COUNTERS:
            out[name + "_total"] = out.get(name + "_total", 0) + get(s)
        out["rdmamw_ps_staleness_max"] = max(out.get("rdmamw_ps_staleness_max", 0),
                                             s["max_staleness"])
    return out


def _zero() -> dict[str, float]:
    row: dict[str, float] = {name + "_total": 0 for name, _, _, _ in CHANNEL_COUNTERS}
    row.update({RNDV_READ: 0, RNDV_WRITE: 0, "rdmamw_channels_open": 0})
    return row


def snapshot() -> dict[str, Any]:
    """The metrics now, as plain data: ``{"rank", "channels": [{"provider", "peer",
    <metric>: value, ...}], "memory": {...}, "errors": {kind: n}, "collectives":
    {kind: {"count", "sum", "buckets": [[le, n], ...]}}, "connects": [{"provider",
    "outcome", "count", "sum", "buckets"}], "ps": {<metric>: value},
    "batch_completion": {"count", "sum", "buckets"}}``, with the names a Prometheus
    scrape shows (docs/metrics.md)."""
    r = read()
    return {
        "rank": r.rank,
        "channels": [{"provider": p, "peer": peer, **row}
                     for (p, peer), row in sorted(r.channels.items())],
        "memory": r.memory,
        "errors": r.errors,
        "collectives": {k: _histogram(t) for k, t in sorted(r.collectives.items())},
        "connects": [{"provider": p, "outcome": o, **_histogram(t)}
                     for (p, o), t in sorted(r.connects.items())],
        "ps": r.ps,
        "batch_completion": _histogram(r.batches or Times()),
    }


def _histogram(t: Times) -> dict[str, Any]:
    return {"count": t.count, "sum": t.sum, "buckets": [list(b) for b in t.cumulative()]}


@_fork.at_child
def _forget() -> None:
    global _recorder, _connects, _labels_lock
    _recorder, _connects = _Recorder(), _Recorder()
    _labels_lock = threading.Lock()
    _labels.clear()
    _messages.forget_batch_times()
    if observe.collective is not None:
        observe.collective = _recorder
