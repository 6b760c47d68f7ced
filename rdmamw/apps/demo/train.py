"""Data-parallel training on the parameter server: one worker's loop (``Trainer``)
and one rank's part in a sequence of runs (``run_rank``), for ``rdmamw demo`` and
examples/ps_train.py.

A run ends when the servers have merged ``epochs`` epochs' worth of gradients
(``ceil(train size / batch)`` per epoch), whichever workers computed them: so a model
that lets fast workers go ahead finishes the same amount of work sooner. Worker 0
reports: it evaluates the model it pulled on the test set as the run goes, and its
clock gives the wall time. The last worker is the straggler (``straggler`` > 1)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

import rdmamw
from rdmamw.apps.demo import mlp
from rdmamw.ps.job import connect
from rdmamw.ps.server import KVServer
from rdmamw.ps.worker import KVWorker
from rdmamw.sched import Dsana
from rdmamw.sched.hook import ShareHook


@dataclass
class RunConfig:
    """One training run. ``compute_ms`` adds that much time per iteration (a sleep,
    standing in for a model larger than this MLP, e.g. on an accelerator), so a few
    workers sharing few cores measure synchronisation rather than CPU contention."""

    name: str                       # label in tables and plots
    consistency: str                # Consistency.parse text, e.g. "lsp:3:2"
    epochs: int = 10
    batch: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    hidden: int = 64
    straggler: float = 1.0          # the last worker's iterations take this many times longer
    compute_ms: float = 0.0
    seed: int = 0
    evals_per_epoch: int = 4
    sched: str = "none"             # "dsana": server 0 moves batch shares (docs/dsana.md)


@dataclass
class Point:
    """The model worker 0 pulled at ``t`` s into the run, after ``merged`` gradients."""

    t: float
    epoch: float
    merged: int
    accuracy: float


@dataclass
class RunResult:
    name: str
    consistency: str
    final_accuracy: float
    wall_s: float
    epochs: list[Point]             # at each epoch's end
    curve: list[Point]              # every 1 / evals_per_epoch epoch
    iterations: int                 # worker 0's
    metrics: dict                   # worker 0's WorkerMetrics
    sched: dict = field(default_factory=dict)   # DSANA's plans as worker 0 saw them

    def as_dict(self) -> dict:
        return asdict(self)


class Trainer:
    """One worker's loop. ``batch_size`` is read at every iteration and ``hooks`` run
    before each one (with the trainer), so a scheduler can move mini-batch shares
    between workers while training runs."""

    def __init__(self, node: KVWorker, index: int, workers: int, cfg: RunConfig,
                 data: mlp.Data, *, report: bool = False, progress: bool = False) -> None:
        self.node, self.index, self.cfg, self.data = node, index, cfg, data
        self.xs, self.ys = data.xtr[index::workers], data.ytr[index::workers]
        self.batch_size = cfg.batch
        self.slowdown = cfg.straggler if index == workers - 1 else 1.0
        self.steps_per_epoch = math.ceil(len(data.ytr) / cfg.batch)
        self.budget = cfg.epochs * self.steps_per_epoch
        self.hooks: list[Callable[[Trainer], None]] = []
        self.report, self.progress = report, progress
        self.iterations = 0
        self.params: list[np.ndarray] = []
        self._rng = np.random.default_rng(cfg.seed + 1 + index)
        self._order = np.empty(0, np.int64)
        self._eval_step = max(1, self.steps_per_epoch // max(1, cfg.evals_per_epoch))

    def next_batch(self) -> np.ndarray:
        """Indices of the next ``batch_size`` samples of this worker's shard (a fresh
        permutation each time the shard is used up)."""
        n = min(self.batch_size, len(self.ys))
        if len(self._order) < n:
            self._order = np.concatenate([self._order, self._rng.permutation(len(self.ys))])
        idx, self._order = self._order[:n], self._order[n:]
        return idx

    def pace(self, started: float) -> None:
        """Add ``compute_ms`` (per ``cfg.batch`` samples: a scheduler's smaller share
        takes less) to this iteration, then stretch it by ``slowdown``."""
        work = time.monotonic() - started
        if self.cfg.compute_ms > 0:
            extra = self.cfg.compute_ms / 1e3 * self.batch_size / self.cfg.batch
            time.sleep(extra)
            work += extra
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * work)

    @staticmethod
    def server_sgd(cfg: RunConfig) -> tuple[float, float]:
        """(lr, momentum) of the servers' SGD for this trainer's runs."""
        return cfg.lr, cfg.momentum

    def accuracy(self, params: list[np.ndarray]) -> float:
        """Test accuracy of the model ``params`` (the one last pulled)."""
        return mlp.accuracy(params, self.data.xte, self.data.yte)

    def run(self) -> RunResult | None:
        """Train until the budget is merged; worker 0 returns the run's result."""
        params = self.start()
        log = _Progress(self, params) if self.report else None
        while self.node.merged < self.budget:
            started = time.monotonic()
            for hook in self.hooks:
                hook(self)
            params = self.step(self.next_batch(), started)
            self.iterations += 1
            if log is not None:
                log.observe(params)
        return log.finish(params) if log is not None else None

    def start(self) -> list[np.ndarray]:
        """Declare the model on the servers; the model they hold (every worker's
        seed is the same; docs/ps.md, "Start")."""
        self.params = mlp.init_params(self.cfg.hidden, self.cfg.seed)
        self.node.init(mlp.KEYS, self.params)
        return self.node.pull(mlp.KEYS, out=self.params)

    def step(self, idx: np.ndarray, started: float) -> list[np.ndarray]:
        """One iteration on the samples ``idx`` of the shard (begun at ``started``):
        gradients, pace, push and pull; the model pulled."""
        params = self.params
        if len(idx):
            grads = mlp.gradients(params, self.xs[idx], self.ys[idx])
        else:                           # no share this round: a sign of life only
            grads = [np.zeros_like(p) for p in params]
        self.pace(started)
        return self.node.push_pull(mlp.KEYS, grads, out=params,
                                   samples=len(idx) if self.cfg.sched == "dsana" else None)


class _Progress:
    """Worker 0's record of the run: test accuracy as the servers merge gradients,
    and a progress bar per epoch."""

    def __init__(self, tr: Trainer, params: list[np.ndarray]) -> None:
        self.tr = tr
        self.t0 = time.monotonic()
        self.curve = [self._point(params, 0.0)]
        self.epochs: list[Point] = []
        self.next_eval = tr._eval_step
        self.bar = None
        self._open_bar()

    def _point(self, params: list[np.ndarray], t: float) -> Point:
        merged = self.tr.node.merged
        return Point(t, merged / self.tr.steps_per_epoch, merged, self.tr.accuracy(params))

    def _open_bar(self) -> None:
        if not self.tr.progress or len(self.epochs) >= self.tr.cfg.epochs:
            return
        from tqdm import tqdm
        self.bar = tqdm(total=self.tr.steps_per_epoch, unit="grad", leave=False,
                        desc=f"{self.tr.cfg.name:>7} epoch {len(self.epochs) + 1}/"
                             f"{self.tr.cfg.epochs}")

    def observe(self, params: list[np.ndarray]) -> None:
        merged = self.tr.node.merged
        if self.bar is not None:
            self.bar.n = min(self.tr.steps_per_epoch,
                             merged - len(self.epochs) * self.tr.steps_per_epoch)
            self.bar.refresh()
        if merged < self.next_eval and merged < self.tr.budget:
            return
        p = self._point(params, time.monotonic() - self.t0)
        self.curve.append(p)
        self.next_eval = (merged // self.tr._eval_step + 1) * self.tr._eval_step
        while (len(self.epochs) < self.tr.cfg.epochs
               and merged >= (len(self.epochs) + 1) * self.tr.steps_per_epoch):
            self.epochs.append(p)
            if self.bar is not None:
                self.bar.close()
                self.bar = None
                from tqdm import tqdm
                tqdm.write(f"{self.tr.cfg.name:>7} epoch {len(self.epochs)}/"
                           f"{self.tr.cfg.epochs}: test accuracy {p.accuracy:.3f} "
                           f"at {p.t:5.2f} s")
            self._open_bar()

    def finish(self, params: list[np.ndarray]) -> RunResult:
        if self.bar is not None:
            self.bar.close()
        last = self.curve[-1]
        cfg = self.tr.cfg
        return RunResult(cfg.name, cfg.consistency, last.accuracy, last.t, self.epochs,
                         self.curve, self.tr.iterations, self.tr.node.metrics.as_dict())


@dataclass
class RankOutcome:
    """What one rank did in a sequence of runs: worker 0's results, or a server's
    stats per run (other workers: their iteration counts)."""

    rank: int
    role: str
    results: list[RunResult] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)


def run_rank(cfgs: list[RunConfig], servers: int, data: mlp.Data, *,
             progress: bool = False, trainer: type[Trainer] = Trainer) -> RankOutcome:
    """This rank's part in every run of ``cfgs``, one after the other over the same
    channels (ranks ``0 .. servers-1`` serve, the others train with ``trainer``)."""
    serving, chans = connect(servers)
    w = rdmamw.world()
    out = RankOutcome(w.rank, "server" if serving else "worker")
    try:
        for cfg in cfgs:
            if serving:
                plan = None
                if cfg.sched == "dsana" and w.rank == 0:
                    plan = Dsana(sorted(chans), cfg.batch * len(chans))
                lr, momentum = trainer.server_sgd(cfg)
                srv = KVServer(chans, consistency=cfg.consistency, lr=lr,
                               momentum=momentum, scheduler=plan)
                st = srv.serve()
                st.pop("round_sizes", None)
                st["workers"] = srv.worker_metrics()
                out.stats.append(st)
                continue
            node = KVWorker([chans[s] for s in sorted(chans)])
            index = w.rank - servers
            tr = trainer(node, index, w.world_size - servers, cfg, data,
                         report=index == 0, progress=progress)
            hook = ShareHook() if cfg.sched == "dsana" else None
            if hook is not None:
                tr.hooks.append(hook)
            res = tr.run()
            node.done()
            if res is not None:
                if hook is not None:
                    res.sched = {"sched": "dsana", "global_batch": cfg.batch * (
                        w.world_size - servers), **hook.summary()}
                out.results.append(res)
            out.stats.append({"iterations": tr.iterations})
    finally:
        for ch in chans.values():
            ch.close()
    return out
