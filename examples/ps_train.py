"""Train a small MLP (numpy) on scikit-learn's digits with the parameter server.

    python examples/ps_train.py --consistency ssp --workers 3 --servers 2 --epochs 5
    python examples/ps_train.py --consistency lsp --straggler 3 --json out.json

Servers and workers are local processes started by rdmamw's launcher; each worker
trains on its own slice of the training set; worker 0 can be made FACTOR times
slower (--straggler). At the end the servers' model is evaluated on the held-out
test set. Needs scikit-learn (``pip install rdmamw[examples]``; `make` installs it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

#: the text each --consistency choice stands for (parameters of SSP / LSP / ALSP)
MODELS = {"bsp": "bsp", "asp": "asp", "ssp": "ssp:2", "lsp": "lsp:{k}:2", "alsp": "alsp:2"}
KEYS = ["W1", "b1", "W2", "b2"]
HIDDEN, BATCH = 64, 32


def data() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return tuple(train_test_split(x, y, test_size=0.25, random_state=0, stratify=y))


def init_params() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((64, HIDDEN)) * np.sqrt(2 / 64)).astype(np.float32),
            np.zeros(HIDDEN, np.float32),
            (rng.standard_normal((HIDDEN, 10)) * np.sqrt(2 / HIDDEN)).astype(np.float32),
            np.zeros(10, np.float32)]


def forward(p: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.maximum(x @ p[0] + p[1], 0)
    return h, h @ p[2] + p[3]


def gradients(p: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Softmax cross-entropy gradients of a mini-batch, by hand."""
    h, z = forward(p, x)
    z = np.exp(z - z.max(1, keepdims=True))
    d = z / z.sum(1, keepdims=True)
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    dh = (d @ p[2].T) * (h > 0)
    return [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def accuracy(p: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float((forward(p, x)[1].argmax(1) == y).mean())


def child(a: argparse.Namespace) -> None:
    """One rank: a server (serves, then saves its shard) or a worker (trains)."""
    import rdmamw
    from rdmamw import ps
    text = MODELS[a.consistency].format(k=max(1, a.workers - 1))
    node = ps.start(a.servers, consistency=text, lr=a.lr, momentum=0.9)
    rank = rdmamw.world().rank
    if isinstance(node, ps.KVServer):
        stats = node.serve()
        np.savez(os.path.join(a.out, f"server{rank}.npz"), **node.model)
        with open(os.path.join(a.out, f"server{rank}.json"), "w") as f:
            json.dump({"stats": {k: v for k, v in stats.items() if k != "round_sizes"},
                       "workers": node.worker_metrics()}, f)
        node.close()
        return
    me = ps.worker_index(a.servers)
    xtr, _, ytr, _ = data()
    xs, ys = xtr[me::a.workers], ytr[me::a.workers]
    steps = len(ytr) // a.workers // BATCH          # the same count on every worker
    params = init_params()
    node.init(KEYS, params)
    node.pull(KEYS, out=params)
    rng = np.random.default_rng(1 + me)
    for _ in range(a.epochs):
        order = rng.permutation(len(ys))
        for i in range(steps):
            t0 = time.monotonic()
            idx = order[i * BATCH:(i + 1) * BATCH]
            g = gradients(params, xs[idx], ys[idx])
            if me == 0 and a.straggler > 1:
                time.sleep((a.straggler - 1) * (time.monotonic() - t0 + 0.002))
            node.push(KEYS, g)
            node.pull(KEYS, out=params)
    with open(os.path.join(a.out, f"worker{me}.json"), "w") as f:
        json.dump(node.metrics.as_dict(), f)
    node.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--consistency", choices=sorted(MODELS), default="bsp")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--straggler", type=float, default=1.0,
                    help="worker 0 is this many times slower")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    if a.workers < 1 or a.servers < 1:
        ap.error("need at least one worker and one server")
    from rdmamw.bootstrap.launch import run
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--out", out,
               "--consistency", a.consistency, "--workers", str(a.workers),
               "--servers", str(a.servers), "--straggler", str(a.straggler),
               "--epochs", str(a.epochs), "--lr", str(a.lr)]
        t0 = time.monotonic()
        code = run(cmd, a.servers + a.workers)
        wall = time.monotonic() - t0
        if code:
            sys.exit(f"ps_train: the job failed (exit code {code})")
        model: dict = {}
        servers, workers = [], []
        for s in range(a.servers):
            with np.load(os.path.join(out, f"server{s}.npz")) as z:
                model.update({k: z[k] for k in z.files})
            with open(os.path.join(out, f"server{s}.json")) as f:
                servers.append(json.load(f))
        for w in range(a.workers):
            with open(os.path.join(out, f"worker{w}.json")) as f:
                workers.append(json.load(f))
    _, xte, _, yte = data()
    acc = accuracy([model[k] for k in KEYS], xte, yte)
    res = {"consistency": a.consistency, "model": MODELS[a.consistency].format(
        k=max(1, a.workers - 1)), "workers": a.workers, "servers": a.servers,
        "straggler": a.straggler, "epochs": a.epochs, "test_accuracy": acc,
        "wall_s": wall, "worker_metrics": workers, "server_stats": servers}
    print(f"{a.consistency}: test accuracy {acc:.4f} ({a.workers} workers, {a.servers} "
          f"servers, straggler x{a.straggler}, {a.epochs} epochs, {wall:.1f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
