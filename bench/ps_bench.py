"""Parameter-server targets, each measured against its baseline in the same run.

    python bench/ps_bench.py                       # both parts
    python bench/ps_bench.py --only transfer --iters 40 --rounds 5
    python bench/ps_bench.py --only train --train-rounds 3 --wait-quiet 60

train: `rdmamw demo` (4 workers, the last one 2x slower, 2 servers, the same seed and
data for every model) --train-rounds times. Per round, each model's time to reach
BSP's final test accuracy minus 1 point, as a fraction of BSP's wall time; the
median over the rounds is judged (target: LSP and ALSP <= 0.7).

transfer: one server and one worker on shm. Rounds alternate two phases over the
same channel: --iters iterations of KVWorker push + pull of one float32 key of
--mib MiB (ASP: the server applies each push at once with SGD + momentum; as one
push_pull call, then as push and pull apart), and
--iters iterations of the two raw channel transfers the same traffic needs (the
worker sends the array in eager-limit blocks, the server copies them into an array,
sends its array back the same way, the worker copies it into its array). Median
iteration times; target: PS <= 1.5x raw. Also printed: raw without the receivers'
copies (the floor of the channel itself).

Load average is printed with the figures: the box is shared, ratios are what count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]
from run import wait_quiet  # noqa: E402

KEY = "w"


# ---- transfer: one rank of the two-process job -----------------------------------------


def blocks(a: np.ndarray, limit: int) -> list[np.ndarray]:
    step = max(1, limit // a.itemsize)
    return [a[i:i + step] for i in range(0, a.size, step)]


def recv_into(ch, dst: np.ndarray | None, nbytes: int) -> None:
    """Receive ``nbytes`` of blocks in order, copying them into ``dst`` (if given)."""
    got = 0
    while got < nbytes:
        for m in ch.recv_batch():
            n = len(m)
            if dst is not None:
                dst[got // dst.itemsize:(got + n) // dst.itemsize] = np.frombuffer(m, dst.dtype)
            m.release()
            got += n


def raw_server(ch, model: np.ndarray, iters: int, copy: bool) -> None:
    buf = np.empty_like(model)
    for _ in range(iters):
        recv_into(ch, buf if copy else None, model.nbytes)
        ch.send_batch(blocks(model, ch.eager_limit)).wait()


def raw_worker(ch, grad: np.ndarray, out: np.ndarray, iters: int, copy: bool) -> list[float]:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        ch.send_batch(blocks(grad, ch.eager_limit)).wait()
        recv_into(ch, out if copy else None, out.nbytes)
        times.append(time.perf_counter() - t0)
    return times


def transfer_rank(cfg: dict) -> None:
    import rdmamw
    from rdmamw.ps import KVServer, KVWorker
    w = rdmamw.init()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[w.rank % len(cores)]})
    ch = rdmamw.Channel.open(1 - w.rank, timeout=60, slots=cfg["slots"],
                             slot_size=cfg["slot_size"])
    n = cfg["mib"] << 18                                       # float32 elements
    res: dict = {"ps": [], "raw": [], "raw_nocopy": [], "push": [], "pull": [], "ps_split": []}
    model = np.ones(n, np.float32)
    grad = np.full(n, 1e-3, np.float32)
    out = np.empty_like(model)
    for _ in range(cfg["rounds"]):
        if w.rank == 0:
            KVServer({0: ch}, consistency="asp", lr=0.01, momentum=0.9).serve()
        else:
            node = KVWorker([ch])
            node.init([KEY], [model])
            node.pull([KEY], out=[out])
            for _ in range(cfg["iters"]):
                t0 = time.perf_counter()
                node.push_pull([KEY], [grad], out=[out])        # what the demo does
                t1 = time.perf_counter()
                node.push([KEY], [grad])
                t2 = time.perf_counter()
                node.pull([KEY], out=[out])
                t3 = time.perf_counter()
                res["ps"].append(t1 - t0)
                res["ps_split"].append(t3 - t1)
                res["push"].append(t2 - t1)
                res["pull"].append(t3 - t2)
            node.done()
        for copy, name in ((True, "raw"), (False, "raw_nocopy")):
            if w.rank == 0:
                raw_server(ch, model, cfg["iters"], copy)
            else:
                res[name] += raw_worker(ch, grad, out, cfg["iters"], copy)
    if w.rank == 1:
        print("RESULT " + json.dumps(res), flush=True)
    ch.close()


def transfer(a: argparse.Namespace) -> dict:
    from rdmamw.bootstrap.launch import free_port, job_env
    cfg = {"mib": a.mib, "iters": a.iters, "rounds": a.rounds, "slots": a.slots,
           "slot_size": a.slot_size}
    port, token = free_port("127.0.0.1"), os.urandom(16).hex()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", json.dumps(cfg)],
                              env=job_env(r, 2, "127.0.0.1", port, token),
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"transfer job failed: {[p.returncode for p in procs]}")
    line = next(x for x in outs[1].splitlines() if x.startswith("RESULT "))
    res = json.loads(line[7:])
    med = {k: statistics.median(v) for k, v in res.items()}
    med["ratio"] = med["ps"] / med["raw"]
    med["ratio_split"] = med["ps_split"] / med["raw"]
    med["ratio_nocopy"] = med["ps"] / med["raw_nocopy"]
    return med


# ---- train ------------------------------------------------------------------------------


def train(a: argparse.Namespace) -> dict:
    rounds = []
    for i in range(a.train_rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "d.json")
            cmd = [sys.executable, "-m", "rdmamw.cli", "demo", "--quiet", "--json", out,
                   "--plot", os.path.join(tmp, "d.png") if i else a.plot,
                   "--consistency", a.models, "--workers", "4", "--servers", "2",
                   "--straggler", "2", "--epochs", str(a.epochs),
                   "--compute-ms", str(a.compute_ms)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if p.returncode:
                raise SystemExit(f"demo failed:\n{p.stderr[-3000:]}")
            print(p.stdout, file=sys.stderr)
            with open(out) as f:
                rounds.append(json.load(f))
    names = [r["name"] for r in rounds[0]["summary"]]
    table = {}
    for name in names:
        rows = [next(r for r in rd["summary"] if r["name"] == name) for rd in rounds]
        ttt = [r["time_to_target_vs_reference"] for r in rows]
        table[name] = {
            "final_accuracy": statistics.median(r["final_accuracy"] for r in rows),
            "wall_vs_bsp": statistics.median(r["wall_vs_reference"] for r in rows),
            "time_to_bsp_acc_vs_bsp_wall":
                None if None in ttt else statistics.median(ttt),
            "per_round": ttt}
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("train", "transfer"))
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30, help="per phase and round")
    ap.add_argument("--rounds", type=int, default=5)
    from rdmamw.ps.job import ps_ring
    PS_SLOTS, PS_SLOT_SIZE = ps_ring()
    ap.add_argument("--slots", type=int, default=PS_SLOTS,
                    help=f"ring slots of the channel (default {PS_SLOTS}, the PS's)")
    ap.add_argument("--slot-size", type=int, default=PS_SLOT_SIZE,
                    help=f"ring slot bytes (default {PS_SLOT_SIZE}, the PS's)")
    ap.add_argument("--train-rounds", type=int, default=3)
    ap.add_argument("--models", default="bsp,asp,ssp,lsp,alsp,hybrid")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--plot", default=str(ROOT / "docs" / "ps-demo.png"),
                    help="the first training round's plot")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S s for other load to drop below 10%%")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_of:
        transfer_rank(json.loads(a.rank_of))
        return
    busy = wait_quiet(a.wait_quiet)
    print(f"load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores), others busy "
          f"{busy:.0f}% at start")
    if a.only in (None, "transfer"):
        m = transfer(a)
        print(f"\ntransfer: {a.mib} MiB float32 per direction, shm, slots {a.slots} x "
              f"{a.slot_size} B, median of {a.rounds} x {a.iters} iterations")
        print(f"  PS push_pull       {m['ps'] * 1e3:8.3f} ms  (one call, as the demo)")
        print(f"  PS push; pull      {m['ps_split'] * 1e3:8.3f} ms  (push {m['push'] * 1e3:.3f}, "
              f"pull {m['pull'] * 1e3:.3f}; x raw {m['ratio_split']:.2f})")
        print(f"  raw 2 transfers    {m['raw'] * 1e3:8.3f} ms  (receivers copy out)")
        print(f"  raw, no copy-out   {m['raw_nocopy'] * 1e3:8.3f} ms")
        verdict = "PASS" if m["ratio"] <= 1.5 else "FAIL"
        print(f"target: PS push_pull <= 1.5x raw  {m['ratio']:.2f}   {verdict}"
              f"   (vs no copy-out: {m['ratio_nocopy']:.2f})")
    if a.only in (None, "train"):
        t = train(a)
        print(f"\ntrain: rdmamw demo, 4 workers (one 2x slower), 2 servers, {a.epochs} epochs, "
              f"+{a.compute_ms:g} ms/iteration, median of {a.train_rounds} runs")
        print(f"{'model':>6} {'final acc':>9} {'wall/bsp':>8} {'to bsp acc-1pt / bsp wall':>26}"
              f"  per run")
        for name, r in t.items():
            v = r["time_to_bsp_acc_vs_bsp_wall"]
            per = " ".join("never" if x is None else f"{x:.2f}" for x in r["per_round"])
            print(f"{name:>6} {r['final_accuracy']:>9.3f} {r['wall_vs_bsp']:>8.2f} "
                  f"{'never' if v is None else format(v, '.2f'):>26}  {per}")
        for name in ("lsp", "alsp"):
            if name in t:
                v = t[name]["time_to_bsp_acc_vs_bsp_wall"]
                ok = v is not None and v <= 0.7
                print(f"target: {name} reaches bsp acc-1pt in <= 0.7x bsp wall   "
                      f"{'never' if v is None else format(v, '.2f')}   "
                      f"{'PASS' if ok else 'FAIL'}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
