"""One rank of a DSANA test job (started by the local launcher): rank 0 serves (BSP,
optionally with the DSANA scheduler), the others fit a linear model by least squares
on a fixed data set. Each round is one global batch; a worker computes the mean
gradient over its share (its DSANA assignment, or an equal split) and pushes it with
its sample count. Worker 0 takes --slow ms per sample more: a slower machine. The
compute times are synthetic (nothing sleeps): each worker reports share x ms per sample
as its compute time (report_compute), so the scheduler sees fixed inputs, whatever the
load on the machine. Each rank prints one JSON line: the server its stats, a worker its
final weights and every round's (offset, share).

--late W:S: worker W starts S s late (before its init), so the scheduler has marked
it FAILED (silent longer than --fail-after s while rounds close on --round-timeout
without it) when it joins: it is told share 0, then rejoins.

--stream: push each key as it is "computed" (push_part, last key first) and pull
with pull_stream, waiting per key, to check the overlapped path gives the same
numbers."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import rdmamw
from rdmamw import ps
from rdmamw.sched import apportion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ps_job import emit  # noqa: E402  (one write per line: the ranks share the pipe)

D = 3000                   # features: key "w" spans several blocks, "b" is tiny
KEYS = ["w", "b"]


def dataset(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, D))
    y = x @ rng.standard_normal(D) + 0.5 + 0.1 * rng.standard_normal(rows)
    return x, y


def grads(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Mean gradient of 0.5 (x.w + b - y)^2 over the rows (zeros for no rows)."""
    if not len(y):
        return [np.zeros(D), np.zeros(1)]
    r = x @ w + b[0] - y
    return [x.T @ r / len(y), np.array([r.mean()])]


def reference(rounds: int, batch: int, lr: float, mu: float) -> np.ndarray:
    """Plain BSP on the whole batch, sequentially: what every run must produce."""
    x, y = dataset(rounds * batch)
    w, b = np.zeros(D), np.zeros(1)
    vw, vb = np.zeros(D), np.zeros(1)
    for r in range(rounds):
        s = slice(r * batch, (r + 1) * batch)
        gw, gb = grads(w, b, x[s], y[s])
        vw, vb = mu * vw + gw, mu * vb + gb
        w, b = w - lr * vw, b - lr * vb
    return np.concatenate([w, b])


def report_compute(node, seconds: float) -> None:
    """Make the worker's next push report ``seconds`` of compute (the worker measures
    from the end of its pull, minus its communication): a synthetic clock, no sleep."""
    node.compute_clock.restart(time.monotonic() - seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sched", default="none")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch", type=int, default=60)
    ap.add_argument("--slow", type=float, default=0.0, help="worker 0: ms per sample more")
    ap.add_argument("--base", type=float, default=20.0, help="every worker: ms per sample")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--consistency", default="bsp")
    ap.add_argument("--ignore-plan", action="store_true",
                    help="compute the equal split but report DSANA's share (a broken worker)")
    ap.add_argument("--late", default="", help="W:S: worker W sleeps S s before its init")
    ap.add_argument("--round-timeout", type=float, default=10.0)
    ap.add_argument("--fail-after", type=float, default=0.0,
                    help="the scheduler's silence limit (0: its default)")
    a = ap.parse_args()
    lr, mu = 0.05, 0.5
    consistency = ps.Consistency.parse(a.consistency, round_timeout=a.round_timeout)
    node = ps.start(1, consistency=consistency, lr=lr, momentum=mu, sched=a.sched,
                    global_batch=a.batch, chunk=a.chunk or None, send_thread=a.stream)
    if isinstance(node, ps.KVServer):
        if a.fail_after and node.scheduler is not None:
            node.scheduler.classifier.fail_after = a.fail_after
        stats = node.serve()
        stats.pop("round_sizes", None)
        emit({"role": "server", **stats})
        node.close()
        return
    me = rdmamw.world().rank - 1
    n = rdmamw.world().world_size - 1
    x, y = dataset(a.rounds * a.batch)
    late, sleep = (int(a.late.split(":")[0]), float(a.late.split(":")[1])) if a.late else (-1, 0)
    if me == late:
        time.sleep(sleep)
    params = [np.zeros(D), np.zeros(1)]
    node.init(KEYS, params)
    node.pull(KEYS, out=params)
    equal = apportion(a.batch, dict.fromkeys(range(n), 1.0))
    plan, stream = [], None
    for r in range(a.rounds):
        if a.sched == "dsana" and not a.ignore_plan:
            off, share, _ = node.assignment
        else:
            off, share = sum(equal[v] for v in range(me)), equal[me]
        told = node.assignment[1] if a.ignore_plan else share
        plan.append([off, share])
        if stream is not None:
            stream.wait("w"), stream.wait("b")
            stream.join()
        lo = r * a.batch + off
        g = grads(params[0], params[1], x[lo:lo + share], y[lo:lo + share])
        report_compute(node, 1e-3 * share * (a.base + (a.slow if me == 0 else 0.0)))
        if a.stream:
            node.push_part(["b"], [g[1]])        # backward: the last layer first
            node.push_part(["w"], [g[0]])
            if a.sched == "dsana":           # both ways of ending an overlapped step
                stream = node.push_end_pull(KEYS, params, samples=told)
            else:
                node.push_end(samples=told)
                stream = node.pull_stream(KEYS, params)
        else:
            node.push(KEYS, g, samples=told)
            node.pull(KEYS, out=params)
    if stream is not None:
        stream.join()
    got = np.concatenate(params)      # the whole vector is too long for one pipe write
    ref = reference(a.rounds, a.batch, lr, mu)
    emit({"role": "worker", "index": me, "plan": plan,
          "max_rel_err": float(np.abs(got - ref).max() / np.abs(ref).max()),
          "moved": float(np.abs(got).max()), "compute_n": node.metrics.compute.n,
          "chunk": node.chunk})
    node.close()


if __name__ == "__main__":
    sys.exit(main())
