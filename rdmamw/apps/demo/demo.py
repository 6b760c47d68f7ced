"""``rdmamw demo``: a training cluster. Parameter servers and workers train an MLP on
scikit-learn's digits, once per consistency model with the same seed and data, one
worker slowed down; then a table and a plot of test accuracy vs wall time.

Run plainly, it starts ``servers + workers`` local processes (shm between them).
Under a launcher (torchrun, mpirun, srun; ``tcp`` across hosts) every rank runs the
same command and worker 0 (rank ``servers``) prints the table and writes the files:

    torchrun --nnodes 2 --nproc-per-node 3 ... -m rdmamw.apps.demo.demo --workers 4 --servers 2
    mpirun -n 6 -hosts a,b -genv MASTER_ADDR a rdmamw demo --workers 4 --servers 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from rdmamw.apps.demo import mlp, report
from rdmamw.apps.demo.train import RankOutcome, RunConfig, Trainer, run_rank
from rdmamw.errors import RdmamwError
from rdmamw.ps.consistency import Consistency

DEFAULT_MODELS = "bsp,asp,ssp,lsp,alsp,hybrid"


@dataclass(frozen=True)
class App:
    """What the job trains: the model's label (``{hidden}`` is filled in), the worker
    loop, and the command (after the Python interpreter) that starts one rank."""

    label: str = "digits MLP (64-{hidden}-10)"
    trainer: type[Trainer] = Trainer
    command: tuple[str, ...] = ("-m", "rdmamw.apps.demo.demo")


DEMO = App()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rdmamw demo", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Consistency texts: bsp, asp, ssp:S, lsp:K[:BOUND], "
                                        "alsp[:BOUND], hybrid[:K], each optionally ending "
                                        "in :dcLAMBDA; a bare name takes the options above. "
                                        "See docs/ps.md.")
    ap.add_argument("--consistency", default=DEFAULT_MODELS,
                    help=f"comma-separated models to run in turn (default {DEFAULT_MODELS}); "
                         "the first is the reference of the table")
    ap.add_argument("--staleness", type=int, default=2, help="SSP's s (default 2)")
    ap.add_argument("--quorum", type=int, default=0,
                    help="LSP's and hybrid's k (default: workers - 1)")
    ap.add_argument("--bound", type=int, default=2,
                    help="LSP/ALSP: largest staleness applied (default 2)")
    ap.add_argument("--dc", type=float, default=Consistency.HYBRID_DC,
                    help="hybrid's delay compensation lambda (default %(default)s; 0: none)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--straggler", type=float, default=2.0,
                    help="the last worker's iterations take FACTOR times longer (default 2)")
    ap.add_argument("--epochs", type=int, default=8, help="per run (default 8)")
    ap.add_argument("--batch", type=int, default=32, help="mini-batch per worker iteration")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    ap.add_argument("--compute-ms", type=float, default=20.0,
                    help="time added to every iteration of --batch samples (a sleep standing "
                         "in for a larger model; a DSANA share takes proportionally less), "
                         "so the workers sharing this machine's cores measure "
                         "synchronisation, not CPU contention (default 20; 0: none)")
    ap.add_argument("--sched", default="none",
                    help="comma-separated: none, dsana (DSANA moves mini-batch shares from "
                         "the straggler to the others; docs/dsana.md); each model runs once "
                         "per value, e.g. --consistency bsp --sched none,dsana")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write every run's figures here")
    ap.add_argument("--plot", metavar="PATH", default="rdmamw-demo.png",
                    help="PNG of accuracy vs wall time (default rdmamw-demo.png; '' for none)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--data", help=argparse.SUPPRESS)      # the split, saved by the launcher
    return ap


def configs(a: argparse.Namespace) -> list[RunConfig]:
    """One RunConfig per model named in ``--consistency`` (ValueError if unknown)."""
    k = a.quorum or max(1, a.workers - 1)
    bare = {"bsp": "bsp", "asp": "asp", "ssp": f"ssp:{a.staleness}",
            "lsp": f"lsp:{k}:{a.bound}", "alsp": f"alsp:{a.bound}",
            "hybrid": f"hybrid:{k}:dc{a.dc:g}"}
    scheds = [x.strip().lower() for x in a.sched.split(",") if x.strip()]
    for x in scheds:
        if x not in ("none", "dsana"):
            raise ValueError(f"--sched: {x!r} is neither 'none' nor 'dsana'")
    out = []
    for item in filter(None, (x.strip() for x in a.consistency.split(","))):
        text = bare.get(item.lower(), item)
        Consistency.parse(text)                                 # the error names it
        for sched in scheds or ["none"]:
            name = item.split(":")[0].lower() + ("+dsana" if sched == "dsana" else "")
            out.append(RunConfig(name=name, consistency=text, epochs=a.epochs,
                                 batch=a.batch, lr=a.lr, hidden=a.hidden,
                                 straggler=a.straggler, compute_ms=a.compute_ms,
                                 seed=a.seed, sched=sched))
    if not out:
        raise ValueError("--consistency names no model")
    return out


def launched() -> bool:
    """Whether a launcher (torchrun, mpirun, srun, ps-lite, rdmamw's) started us."""
    from rdmamw.bootstrap.env import detect
    try:
        detect()
    except RdmamwError:
        return False
    return True


def main(argv: list[str] | None = None, app: App = DEMO) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    a = ap.parse_args(argv)
    if a.workers < 1 or a.servers < 1:
        ap.error("need at least one worker and one server")
    if a.epochs < 1 or a.batch < 1 or a.straggler < 1 or a.compute_ms < 0:
        ap.error("--epochs and --batch must be >= 1, --straggler >= 1, --compute-ms >= 0")
    try:
        cfgs = configs(a)
    except ValueError as e:
        ap.error(str(e))
    if launched():
        return rank(a, cfgs, app)
    return local(a, argv, app)


def local(a: argparse.Namespace, argv: list[str], app: App = DEMO) -> int:
    """Start the job on this host with rdmamw's launcher; worker 0 reports."""
    from rdmamw.bootstrap.launch import run
    n = a.servers + a.workers
    print(f"rdmamw demo: {a.servers} servers + {a.workers} workers as local processes "
          f"(shm), load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rdmamw-demo-") as tmp:
        path = os.path.join(tmp, "digits.npz")
        mlp.load(seed=a.seed).save(path)
        # one BLAS thread per rank: the ranks already share the cores
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
        code = run([sys.executable, *app.command, *argv, "--data", path], n)
    if code:
        print(f"rdmamw demo: the job failed (exit code {code})", file=sys.stderr)
    return code


def rank(a: argparse.Namespace, cfgs: list[RunConfig], app: App = DEMO) -> int:
    """One rank of the job; worker 0 prints the table and writes the files."""
    data = mlp.load(a.data, seed=a.seed)
    import rdmamw
    w = rdmamw.init()
    if w.world_size != a.servers + a.workers:
        raise SystemExit(f"rdmamw demo: --servers {a.servers} + --workers {a.workers} "
                         f"!= the launcher's world size {w.world_size}")
    reporter = w.rank == a.servers
    if reporter:
        print(f"{app.label.format(hidden=a.hidden)}, {len(data.ytr)} train / {len(data.yte)} test "
              f"images, batch {a.batch}, {a.epochs} epochs per run, +{a.compute_ms:g} ms per "
              f"iteration; worker {a.workers - 1} is {a.straggler:g}x slower; "
              f"models: {', '.join(c.consistency for c in cfgs)}", flush=True)
    t0 = time.monotonic()
    out = run_rank(cfgs, a.servers, data, progress=reporter and not a.quiet,
                   trainer=app.trainer)
    if reporter:
        finish(a, out, w.launcher, time.monotonic() - t0, app)
    return 0


def finish(a: argparse.Namespace, out: RankOutcome, launcher: str, total: float,
           app: App = DEMO) -> None:
    rows = report.summary(out.results)
    print()
    print(report.table(rows))
    print(f"\n{len(rows)} runs in {total:.1f} s; load average {os.getloadavg()[0]:.1f}. "
          f"'to {rows[0]['target_accuracy']:.3f}': first time the model reached "
          f"{rows[0]['name']}'s final accuracy minus 1 point.")
    job = {"workers": a.workers, "servers": a.servers, "straggler": a.straggler,
           "epochs": a.epochs, "batch": a.batch, "lr": a.lr, "hidden": a.hidden,
           "compute_ms": a.compute_ms, "seed": a.seed, "sched": a.sched,
           "launcher": launcher,
           "loadavg": os.getloadavg()[0], "total_s": total}
    if a.plot:
        report.plot(out.results, a.plot, title=f"{app.label.format(hidden=a.hidden)}, "
                    f"{a.workers} workers (one {a.straggler:g}x slower), {a.servers} servers")
        print(f"plot: {a.plot}")
    if a.json:
        report.write_json(a.json, out.results, rows, job)
        print(f"json: {a.json}")


if __name__ == "__main__":
    sys.exit(main())
