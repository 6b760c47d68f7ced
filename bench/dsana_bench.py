"""DSANA end to end, against plain BSP in the same run with the same seed.

    python bench/dsana_bench.py                       # both parts, ~5 min
    python bench/dsana_bench.py --part train --repeats 3 --epochs 6
    python bench/dsana_bench.py --part overlap --chunks 16K,64K

**train**: an MLP on scikit-learn's digits over the parameter server (1 server, 4
workers, BSP), each round one global batch drawn from a permutation every worker
shares (same seed in every run), so plain BSP (equal shares) and DSANA (shares from
the scheduler) make the same sequence of full-batch steps. Worker 0 is made
``--straggler`` times slower exactly as ``examples/ps_train.py --straggler`` does it
(it sleeps (F-1) x (its compute time + 2 ms) per iteration: a slower machine, not
CPU contention). The digits MLP needs about 20 us of numpy per sample, far less than
moving its parameters, and this box runs five processes on two cores; so each
worker's *device* is emulated as well: it sleeps ``--sample-ms`` per sample of its
share (the regime DSANA is for: compute that scales with the share; ``0`` leaves
only numpy). Configurations run interleaved ``--repeats`` times; each figure is
the median. Reported: time per epoch, final test accuracy, the ratios the targets
are stated in (DSANA / BSP with and without the straggler).

**overlap**: one worker and one server, a model of ``--model-mib`` MiB (4 square
float32 layers). Each iteration: forward, backward, push, pull. *sequential* pushes
after the whole backward and pulls before the next forward; *overlapped* pushes each
layer's gradient as soon as backward has it (``KVWorker.push_part``, blocks of
``chunk`` bytes) and starts the next forward as soon as the first layer's
parameters are back (``KVWorker.pull_stream``); *overlapped+thread* also copies the
pushed parts out on a sender thread. The communication wait of an
iteration is its time minus the compute-only time of the same loop without the
parameter server, measured in the same process just before.

Results go to stdout and, with ``--json``, to a file. On a shared box the load
average is printed with the figures; treat single runs with caution.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]

LAYERS = 4


# -- the training part ---------------------------------------------------------------------

def train_child(a: argparse.Namespace) -> None:
    import rdmamw
    from rdmamw import ps
    from rdmamw.apps.demo import mlp
    from rdmamw.sched import apportion
    keys = mlp.KEYS
    node = ps.start(1, consistency="bsp", lr=a.lr, momentum=0.9, sched=a.sched,
                    global_batch=a.batch)
    if isinstance(node, ps.KVServer):
        stats = node.serve()
        np.savez(os.path.join(a.out, "model.npz"), **node.model)
        with open(os.path.join(a.out, "server.json"), "w") as f:
            json.dump({k: v for k, v in stats.items() if k != "round_sizes"}, f, default=str)
        node.close()
        return
    me = rdmamw.world().rank - 1
    d = mlp.load(a.data)
    xtr, ytr = d.xtr, d.ytr
    static = apportion(a.batch, dict.fromkeys(range(a.workers), 1.0))
    static_off = {w: sum(static[v] for v in range(w)) for w in static}
    params = mlp.init_params(a.hidden)
    node.init(keys, params)
    node.pull(keys, out=params)
    rounds = len(ytr) // a.batch
    epoch_s, shares = [], []
    for e in range(a.epochs):
        order = np.random.default_rng(1000 + e).permutation(len(ytr))  # the same everywhere
        t_epoch = time.monotonic()
        for r in range(rounds):
            if a.sched == "dsana":
                off, share, _ = node.assignment
            else:
                off, share = static_off[me], static[me]
            shares.append(share)
            idx = order[r * a.batch + off:r * a.batch + off + share]
            t0 = time.monotonic()
            if share:
                g = mlp.gradients(params, xtr[idx], ytr[idx])
            else:
                g = [np.zeros_like(p) for p in params]
            time.sleep(a.sample_ms * 1e-3 * share)    # the emulated device's time
            if me == 0 and a.straggler > 1:       # as examples/ps_train.py --straggler
                time.sleep((a.straggler - 1) * (time.monotonic() - t0 + 0.002))
            node.push(keys, g, samples=share)
            node.pull(keys, out=params)
        epoch_s.append(time.monotonic() - t_epoch)
    with open(os.path.join(a.out, f"worker{me}.json"), "w") as f:
        json.dump({"epoch_s": epoch_s, "rounds": rounds, "mean_share": float(np.mean(shares)),
                   "last_share": shares[-1], "metrics": node.metrics.as_dict()}, f)
    node.close()


def train_job(a: argparse.Namespace, sched: str, straggler: float) -> dict:
    from rdmamw.apps.demo import mlp
    from rdmamw.bootstrap.launch import run
    with tempfile.TemporaryDirectory() as out:
        data = os.path.join(out, "digits.npz")
        mlp.load().save(data)               # the ranks need not import sklearn
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "train", "--out", out,
               "--data", data,
               "--sched", sched, "--straggler", str(straggler), "--workers", str(a.workers),
               "--epochs", str(a.epochs), "--batch", str(a.batch), "--hidden", str(a.hidden),
               "--lr", str(a.lr), "--sample-ms", str(a.sample_ms)]
        code = run(cmd, 1 + a.workers)
        if code:
            sys.exit(f"dsana_bench: the {sched} job failed (exit code {code})")
        with np.load(os.path.join(out, "model.npz")) as z:
            model = [z[k] for k in mlp.KEYS]
        workers = []
        for w in range(a.workers):
            with open(os.path.join(out, f"worker{w}.json")) as f:
                workers.append(json.load(f))
        with open(os.path.join(out, "server.json")) as f:
            server = json.load(f)
    d = mlp.load()
    # BSP keeps the workers in lock step: an epoch ends for all within a round
    epoch = [max(w["epoch_s"][e] for w in workers) for e in range(a.epochs)]
    return {"sched": sched, "straggler": straggler, "epoch_s": epoch,
            "rounds_per_epoch": workers[0]["rounds"],
            "epoch_median_s": statistics.median(epoch),
            "test_accuracy": mlp.accuracy(model, d.xte, d.yte),
            "shares": [w["mean_share"] for w in workers],
            "last_shares": [w["last_share"] for w in workers],
            "dsana": server.get("dsana")}


def train_part(a: argparse.Namespace, out: dict) -> list[str]:
    configs = [("none", a.straggler), ("dsana", a.straggler), ("none", 1.0), ("dsana", 1.0)]
    runs: dict[str, list[dict]] = {f"{s}@{f:g}": [] for s, f in configs}
    for rep in range(a.repeats):
        for s, f in configs:
            r = train_job(a, s, f)
            runs[f"{s}@{f:g}"].append(r)
            print(f"  rep {rep} {s:5s} straggler x{f:g}: {r['epoch_median_s']:.3f} s/epoch, "
                  f"accuracy {r['test_accuracy']:.4f}, shares {r['last_shares']}", flush=True)
    med = {k: statistics.median(r["epoch_median_s"] for r in v) for k, v in runs.items()}
    acc = {k: statistics.median(r["test_accuracy"] for r in v) for k, v in runs.items()}
    sf = f"{a.straggler:g}"
    ratio_s = med[f"dsana@{sf}"] / med[f"none@{sf}"]
    ratio_n = med["dsana@1"] / med["none@1"]
    # paired ratios (same repeat, neighbours in time) as a check on the medians
    paired_s = statistics.median(d["epoch_median_s"] / b["epoch_median_s"] for d, b in
                                 zip(runs[f"dsana@{sf}"], runs[f"none@{sf}"], strict=True))
    paired_n = statistics.median(d["epoch_median_s"] / b["epoch_median_s"] for d, b in
                                 zip(runs["dsana@1"], runs["none@1"], strict=True))
    per_round = [r["dsana"]["busy_s"] / max(1, r["dsana"]["rounds"]) for k in runs
                 if k.startswith("dsana") for r in runs[k]]
    sched_us = statistics.median(per_round) * 1e6
    round_ms = med["none@1"] / runs["none@1"][0]["rounds_per_epoch"] * 1e3
    out["train"] = {"sched_us_per_round": sched_us, "runs": runs, "median_epoch_s": med,
                    "median_accuracy": acc,
                    "ratio_straggler": ratio_s, "ratio_no_straggler": ratio_n,
                    "paired_ratio_straggler": paired_s, "paired_ratio_no_straggler": paired_n}
    return [
        f"train: {a.workers} workers, 1 server, BSP, global batch {a.batch}, hidden {a.hidden}, "
        f"device {a.sample_ms:g} ms/sample, {a.epochs} epochs, {a.repeats} repeats (medians)",
        f"  straggler x{sf}: BSP {med[f'none@{sf}']:.3f} s/epoch, DSANA "
        f"{med[f'dsana@{sf}']:.3f} s/epoch -> ratio {ratio_s:.3f} (paired {paired_s:.3f}; "
        f"target <= 0.65)",
        f"  accuracy: BSP {acc[f'none@{sf}']:.4f}, DSANA {acc[f'dsana@{sf}']:.4f} "
        f"(target: within 0.01)",
        f"  no straggler: BSP {med['none@1']:.3f} s/epoch, DSANA {med['dsana@1']:.3f} -> "
        f"ratio {ratio_n:.3f} (paired {paired_n:.3f}; target <= 1.03)",
        f"  the scheduler's own time: {sched_us:.0f} us per round = "
        f"{sched_us / 1e3 / round_ms * 100:.2f}% of a {round_ms:.0f} ms round",
    ]


# -- the overlap part ----------------------------------------------------------------------

class Deep:
    """LAYERS square float32 layers, tanh between them, squared error: backward yields
    each layer's gradient as soon as it is computed, last layer first."""

    def __init__(self, width: int, batch: int) -> None:
        rng = np.random.default_rng(0)
        self.params = [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
                       for _ in range(LAYERS)]
        self.x = rng.standard_normal((batch, width)).astype(np.float32)
        self.y = rng.standard_normal((batch, width)).astype(np.float32)
        self.keys = [f"L{i}" for i in range(LAYERS)]

    def forward(self, get=lambda i, p: p) -> list[np.ndarray]:
        acts = [self.x]
        for i, p in enumerate(self.params):
            acts.append(np.tanh(acts[-1] @ get(i, p)))
        return acts

    def backward(self, acts: list[np.ndarray]):
        d = (acts[-1] - self.y) * (1 - acts[-1] ** 2) / len(self.x)
        for i in reversed(range(LAYERS)):
            g = acts[i].T @ d
            if i:
                d = (d @ self.params[i].T) * (1 - acts[i] ** 2)
            yield i, g


MODES = ("sequential", "overlapped", "overlapped+thread")


def overlap_child(a: argparse.Namespace) -> None:
    """One worker cycles through blocks of every mode (and compute only) ``--repeats``
    times on the same channels, so the load of the moment hits them alike."""
    from rdmamw import ps
    width = int(np.sqrt(a.model_mib * 2**20 / 4 / LAYERS))
    node = ps.start(1, consistency="bsp", lr=1e-3, momentum=0.9, chunk=a.chunk)
    if isinstance(node, ps.KVServer):
        node.serve()
        node.close()
        return
    m = Deep(width, a.mb)
    node.init(m.keys, m.params)
    node.pull(m.keys, out=m.params)
    times: dict[str, list[float]] = {k: [] for k in ("compute", *MODES)}
    for _ in range(a.repeats):
        for mode in times:
            node.send_thread = mode == "overlapped+thread"
            stream = None
            for i in range(a.iters + 1):        # the first of a block is its warm-up
                t0 = time.monotonic()
                if mode == "compute":
                    for _i, _g in m.backward(m.forward()):
                        pass
                elif mode == "sequential":
                    grads = [g for _, g in sorted(m.backward(m.forward()), key=lambda t: t[0])]
                    node.push(m.keys, grads)
                    node.pull(m.keys, out=m.params)
                else:
                    if stream is not None:
                        acts = m.forward(lambda i, p, s=stream: s.wait(m.keys[i]))
                        stream.join()
                    else:
                        acts = m.forward()
                    for j, g in m.backward(acts):
                        node.push_part([m.keys[j]], [g])
                    stream = node.push_end_pull(m.keys, m.params)
                if i:
                    times[mode].append(time.monotonic() - t0)
            if stream is not None:
                stream.join()
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"chunk": a.chunk, "width": width, "mb": a.mb,
           "model_bytes": sum(p.nbytes for p in m.params), "iter_median_s": med,
           "wait_s": {k: med[k] - med["compute"] for k in MODES}}
    print("RESULT " + json.dumps(res), flush=True)
    node.close()


def overlap_job(a: argparse.Namespace, chunk: int, slot: int) -> dict:
    import subprocess
    cmd = [sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", "2", "--",
           sys.executable, os.path.abspath(__file__), "--child", "overlap",
           "--chunk", str(chunk), "--model-mib", str(a.model_mib), "--iters", str(a.iters),
           "--mb", str(a.mb), "--repeats", str(a.repeats)]
    env = {**os.environ, "RDMAMW_SLOT_SIZE": str(slot),
           "RDMAMW_SLOTS": str(max(8, a.ring_mib * 2**20 // slot))}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    if p.returncode:
        sys.exit(f"dsana_bench: overlap job failed: {p.stderr[-2000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[7:])


def overlap_part(a: argparse.Namespace, out: dict) -> list[str]:
    chunks = [parse_size(c) for c in a.chunks.split(",")]
    slot = max(65536, *chunks)          # every chunk size on the same rings
    runs = {c: overlap_job(a, c, slot) for c in chunks}
    lines = [f"overlap: 1 worker, 1 server, {a.model_mib} MiB model ({LAYERS} layers), "
             f"mini-batch {a.mb}, rings of {a.ring_mib} MiB in {slot // 1024} KiB slots; "
             f"per chunk size one job cycling {a.repeats} x {a.iters} iterations of each "
             f"mode; wait = median iteration - median compute-only iteration"]
    for c, r in runs.items():
        w = r["wait_s"]
        base = w["sequential"]
        row = (f"  chunk {c // 1024:>5d} KiB: compute {r['iter_median_s']['compute'] * 1e3:.1f}"
               f" ms; wait: push-after-backward {base * 1e3:.1f} ms")
        for mode in MODES[1:]:
            row += f", {mode} {w[mode] * 1e3:.1f} ms ({(1 - w[mode] / base) * 100:+.0f}%)"
        lines.append(row)
    best_seq = min(r["wait_s"]["sequential"] for r in runs.values())
    best_ovl = min(r["wait_s"][m] for r in runs.values() for m in MODES[1:])
    lines.append(f"  best overlapped {best_ovl * 1e3:.1f} ms vs best push-after-backward "
                 f"{best_seq * 1e3:.1f} ms -> {(1 - best_ovl / best_seq) * 100:.0f}% less "
                 f"(target >= 30%)")
    out["overlap"] = {"runs": {str(c): r for c, r in runs.items()}, "slot_size": slot,
                      "reduction_best_vs_best": 1 - best_ovl / best_seq}
    return lines


def parse_size(text: str) -> int:
    mult = {"K": 1024, "M": 2**20}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["train", "overlap", "all"], default="all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--straggler", type=float, default=2.0)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256, help="global batch per BSP round")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--sample-ms", type=float, default=1.0,
                    help="emulated device time per sample (sleep; 0: numpy only)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--model-mib", type=int, default=16)
    ap.add_argument("--chunks", default="64K,256K,1M", help="chunk sizes to try (bytes, K, M)")
    ap.add_argument("--ring-mib", type=int, default=16, help="overlap part: ring size")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--mb", type=int, default=32, help="overlap part: mini-batch")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="wait up to S s for other load to drop before starting")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--child", choices=["train", "overlap"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--sched", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=65536, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "train":
        train_child(a)
        return
    if a.child == "overlap":
        overlap_child(a)
        return
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(v, "1")           # one core per rank: no BLAS thread pools
    from run import wait_quiet
    busy = wait_quiet(a.wait_quiet) if a.wait_quiet else None
    out: dict = {"loadavg_start": os.getloadavg(), "cores": os.cpu_count(),
                 "busy_percent_at_start": busy, "args": vars(a)}
    lines = []
    if a.part in ("train", "all"):
        lines += train_part(a, out)
    if a.part in ("overlap", "all"):
        lines += overlap_part(a, out)
    out["loadavg_end"] = os.getloadavg()
    lines.append(f"load average {out['loadavg_start'][0]:.2f} -> {out['loadavg_end'][0]:.2f} "
                 f"on {out['cores']} cores")
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
