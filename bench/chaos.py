"""Chaos test of rank failures: jobs of 3-5 ranks run collectives (or channel streams,
torch all_reduce, PS rounds, Dask comms) in a loop; at a random moment one random rank
is SIGKILLed, SIGSTOPped, closes its communicator (SIGUSR1) or is cut off (its
network namespace's link taken down), and every survivor must fail typed, naming it,
in time, with every result it got right, then shrink and go on (docs/testing.md,
"Chaos"; the ps and dask layers: judged_served).

    python bench/chaos.py --trials 1000 --seed 7 [--providers shm,tcp] [--seconds S]
    python bench/chaos.py --replay 7-12      # trial 12 of seed 7 again, its logs kept

Each trial draws from ``SEED-INDEX``: the ranks (3-5), the provider (shm or tcp;
``RDMAMW_PROVIDER=tcp`` forces tcp), the layer every rank loops
(tests/support/chaos_worker.py: ``allreduce`` ring/rhd/auto small and > 1 MiB,
``bcast_gather``, ``stream`` pairs of ranks on channels of their own with a checkpoint
allreduce between rounds, ``torch``; chaos_ps_worker.py: ``ps``; chaos_dask_worker.py:
``dask``), the victim, the fault (a drop runs on tcp) and when (0.2-2 s after every
rank said ready). Checked for every survivor:

* it reports within the bound: SIGKILL: KILL_BOUND (the library promises 2 s on a
  quiet machine, tests/integrations/test_coll_faults.py; the rest is slack for up to
  five ranks sharing two loaded cores), SIGSTOP: the deadline + STOP_SLACK (its
  collective may have started just before the stop; then the revoke's graces), plus
  the stream's deadline in the stream layer. Nothing by then is a *hang*;
* its error is typed, of the fault's kind (EXPECT: PeerLost for a kill or a close,
  Timeout for a stop, either for a drop; a stream error: PeerLost or ChannelClosed for
  a kill or a close, Timeout for a stop), else *untyped*;
* it names the victim (``e.rank``; a stream error: the partner must be the victim,
  but for a Timeout: a surviving partner held in a collective by the fault cannot
  answer within the stream's deadline), else *misnamed*;
* every result it got before was right (``wrong`` = 0);
* after ``coll.shrink()``, within the deadline + SHRINK_SLACK: the members are the
  world minus the victim, its new rank its place among them, and one allreduce on them
  is right, else a *shrink* failure.

A close and a drop are bounded as a kill and a stop. A stopped victim gets SIGCONT once
the survivors reported, then SIGKILL. One line per
trial, then the summary; exit status 1 if any check failed. A failed trial's ranks'
stderr is kept (its path printed)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rdmamw.bootstrap.launch import job_env, spawn  # noqa: E402
from tests.support.netns import ip, two_namespaces  # noqa: E402

WORKER = ROOT / "tests" / "support" / "chaos_worker.py"
#: layers with a worker of their own
WORKERS = {"ps": ROOT / "tests" / "support" / "chaos_ps_worker.py",
           "dask": ROOT / "tests" / "support" / "chaos_dask_worker.py"}
LAYERS = ("allreduce", "bcast_gather", "stream", "torch", "ps", "dask")
FAULTS = ("kill", "stop", "close", "drop")      # drop: root only
#: what a survivor's error must be after each fault (its collective's, its stream's)
EXPECT = {"kill": (("PeerLost",), ("PeerLost", "ChannelClosed")),
          "close": (("PeerLost",), ("PeerLost", "ChannelClosed")),
          "stop": (("Timeout",), ("Timeout",)),
          "drop": (("PeerLost", "Timeout"), ("PeerLost", "ChannelClosed", "Timeout"))}
#: faults whose survivors have a deadline to pass before they can know (else KILL_BOUND)
SLOW = ("stop", "drop")
KILL_BOUND = 5.0
STOP_SLACK = 5.0
SHRINK_SLACK = 5.0
STARTUP = 90.0          # every rank ready by then (imports, init, first call)
#: layers whose ranks take longer to be ready (torch's import: 3 s on a quiet machine,
#: 45 s on two cores at a load of 20)
STARTUP_OF = {"torch": 240.0}
#: a lost PS server: what its workers' calls must raise
PS_SERVER_EXPECT = {"kill": ("PeerLost", "ChannelClosed"), "close": ("ChannelClosed", "PeerLost"),
                    "stop": ("Timeout",), "drop": ("PeerLost", "Timeout")}
#: a lost Dask server: what its clients' reads and writes must raise (docs/dask.md)
DASK_EXPECT = ("CommClosedError",)
#: a lost PS worker or Dask client: the others must have had a round after the fault + the round
#: deadline; asked for their lines that much later (and the server must end by SERVED
#: once they left and the victim is dead)
GO_ON, SERVED = 3.0, 10.0
KINDS = ("hang", "wrong", "untyped", "misnamed", "shrink", "stalled", "crash", "setup")


@dataclass
class Plan:
    seed: str
    ranks: int
    provider: str
    layer: str
    fault: str
    victim: int
    delay: float
    worker_seed: int

    @classmethod
    def draw(cls, seed: str, providers: list[str], layers: tuple[str, ...] = LAYERS,
             faults: tuple[str, ...] = FAULTS) -> Plan:
        rng = random.Random(seed)
        ranks = rng.randint(3, 5)
        provider = rng.choice(providers)
        if os.environ.get("RDMAMW_PROVIDER") == "tcp":
            provider = "tcp"
        layer, fault = rng.choice(layers), rng.choice(faults)
        if fault == "drop":             # a link between two hosts: tcp's
            provider = "tcp"
        victim = rng.randrange(ranks)
        if layer == "dask" and fault == "stop":
            victim = victim % (ranks - 1) + 1   # (a stopped Dask server: nothing promised)
        return cls(seed, ranks, provider, layer, fault, victim,
                   round(rng.uniform(0.2, 2.0), 2), rng.getrandbits(31))

    def __str__(self) -> str:
        return (f"{self.ranks} ranks {self.provider:3} {self.layer:12} {self.fault} rank "
                f"{self.victim} @{self.delay:.2f}s")


@dataclass
class Result:
    plan: Plan
    problems: dict[str, list[str]] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)       # time to error, per survivor
    shrink_times: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)         # what the survivors raised
    late: list[str] = field(default_factory=list)           # lines past their bound

    def bad(self, kind: str, what: str) -> None:
        self.problems.setdefault(kind, []).append(what)


class Lines:
    """Every rank's stdout lines, as (rank, line) on one queue (None at EOF)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self.q: queue.Queue = queue.Queue()
        #: lines that came before the take() that wants them (a rank that shrank while
        #: another had not printed its error line yet), in order
        self.early: list[tuple[int, str | None]] = []
        for r, p in enumerate(procs):
            threading.Thread(target=self._read, args=(r, p), daemon=True).start()

    def _read(self, r: int, p: subprocess.Popen) -> None:
        for line in p.stdout:                               # type: ignore[union-attr]
            self.q.put((r, line))
        self.q.put((r, None))

    def take(self, want: set[int], until: float, res: Result, what: str,
             keys: tuple[str, ...]) -> dict[int, dict]:
        """The next JSON line with one of ``keys`` of each rank in ``want`` by ``until``
        (time.time()); a rank's line of another kind (an error line after its bound) is
        noted, not taken."""
        got: dict[int, dict] = {}
        early, self.early = self.early, []
        while want - set(got):
            if early:
                r, line = early.pop(0)
            else:
                try:
                    r, line = self.q.get(timeout=max(0.0, until - time.time()))
                except queue.Empty:
                    break
            if r not in want or r in got:
                self.early.append((r, line))        # for the next take()
                continue
            if line is None:
                try:        # (negative: the signal that ended it)
                    how = f"exit status {self.procs[r].wait(timeout=2)}"
                except subprocess.TimeoutExpired:
                    how = "stdout closed, still running"
                res.bad("crash", f"rank {r} exited before its {what} line ({how})")
                got[r] = {}
                continue
            try:
                v = json.loads(line)
            except ValueError:
                res.bad("crash", f"rank {r} printed {line!r}")
                got[r] = {}
                continue
            if any(k in v for k in keys):
                got[r] = v
            else:
                res.late.append(f"rank {r}, waiting for its {what} line, printed {line.strip()}")
        self.early.extend(early)
        for r in sorted(want - set(got)):
            res.bad("hang", f"rank {r}: no {what} line by its bound")
        return {r: v for r, v in got.items() if v}


def start(plan: Plan, cmd: list[str], env: dict[str, str], log: Path,
          stack: contextlib.ExitStack) -> tuple[list[subprocess.Popen], Callable[[], None]]:
    """The job's ranks, and the fault to inflict on the victim. A ``drop`` job runs on
    two "hosts" (network namespaces on a veth link, tests/support/netns.py): the victim
    alone on one, the rest on the other; its fault takes the victim's end of the link
    down."""
    err = stack.enter_context(open(log, "w"))
    io: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": err, "text": True, "cwd": str(ROOT)}
    if plan.fault != "drop":
        procs = spawn(plan.ranks, cmd, env=env, **io)
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "close": signal.SIGUSR1}
        return procs, lambda: os.kill(procs[plan.victim].pid, sig[plan.fault])
    hosts, devs = stack.enter_context(two_namespaces())
    a, b = sorted(hosts)
    where = [b if r == plan.victim else a for r in range(plan.ranks)]
    port = random.randrange(20000, 60000)       # fresh namespaces: any port is free
    token = secrets.token_hex(32)
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, *cmd],
                              env=job_env(r, plan.ranks, hosts[where[0]], port, token, env),
                              **io) for r, ns in enumerate(where)]
    return procs, lambda: ip("-n", b, "link", "set", devs[b], "down")


def run_trial(plan: Plan, timeout: float, logdir: Path) -> tuple[Result, Path]:
    res = Result(plan)
    stream_timeout = timeout / 3
    # (a rank ended by a fatal signal leaves its threads' tracebacks in its log)
    env = {"RDMAMW_COLL_TIMEOUT": str(timeout), "PYTHONFAULTHANDLER": "1"}
    if plan.provider != "shm":
        env["RDMAMW_PROVIDER"] = plan.provider
    log = logdir / f"chaos-{plan.seed}.log"
    cmd = [sys.executable, str(WORKERS.get(plan.layer, WORKER)), plan.layer,
           str(plan.worker_seed), str(timeout), str(stream_timeout)]
    with contextlib.ExitStack() as stack:
        procs, fault = start(plan, cmd, env, log, stack)
        try:
            if plan.layer in ("ps", "dask"):
                return judged_served(plan, res, procs, fault, timeout), log
            return judged(plan, res, procs, fault, timeout, stream_timeout), log
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait(timeout=30)
                p.stdout.close()                            # type: ignore[union-attr]


def struck(plan: Plan, res: Result, procs: list[subprocess.Popen],
           fault: Callable[[], None]) -> tuple[Lines, float] | None:
    """Once every rank said ready, the fault after the plan's delay: the ranks' lines
    and when it struck (None: the job never started, not the fault's doing)."""
    lines = Lines(procs)
    everyone = set(range(plan.ranks))
    ready = lines.take(everyone, time.time() + STARTUP_OF.get(plan.layer, STARTUP), res,
                       "ready", ("ready",))
    if len(ready) < plan.ranks or not all(v.get("ready") for v in ready.values()):
        res.problems = {"setup": [f"ready: {sorted(ready)} of {plan.ranks}; "
                                  + "; ".join(sum(res.problems.values(), []))]}
        return None
    time.sleep(plan.delay)
    t0 = time.time()
    fault()
    return lines, t0


def judged(plan: Plan, res: Result, procs: list[subprocess.Popen],
           fault: Callable[[], None], timeout: float, stream_timeout: float) -> Result:
    """``res`` once the job said ready, lost its victim and its survivors reported."""
    if (begun := struck(plan, res, procs, fault)) is None:
        return res
    lines, t0 = begun
    survivors = set(range(plan.ranks)) - {plan.victim}
    bound = timeout + STOP_SLACK if plan.fault in SLOW else KILL_BOUND
    if plan.layer == "stream":
        bound += stream_timeout
    errs = lines.take(survivors, t0 + bound, res, "error", ("error",))
    for r, v in sorted(errs.items()):
        judge(res, plan, r, v, t0)
    last = max([v["t"] for v in errs.values()], default=t0)
    after = lines.take(survivors, max(time.time(), last) + timeout + SHRINK_SLACK,
                       res, "shrink", ("t_after",))
    members = sorted(survivors)
    for r, v in sorted(after.items()):
        if "shrink_error" in v:
            res.bad("shrink", f"rank {r}: {v['shrink_error']}: {v['msg']}")
            continue
        res.shrink_times.append(v["t_after"] - errs.get(r, {}).get("t", last))
        if v["members"] != members or v["new_rank"] != members.index(r) \
                or v["sum"] != v["want"]:
            res.bad("shrink", f"rank {r}: members {v['members']} (want {members}), "
                              f"new rank {v['new_rank']}, sum {v['sum']} (want "
                              f"{v['want']})")
    if plan.fault == "stop":
        procs[plan.victim].send_signal(signal.SIGCONT)
    return res


def judged_served(plan: Plan, res: Result, procs: list[subprocess.Popen],
                  fault: Callable[[], None], timeout: float) -> Result:
    """The ``ps`` and ``dask`` layers (tests/support/chaos_ps_worker.py,
    chaos_dask_worker.py; rank 0 serves the others): a lost server fails every
    client's next call, typed, in time; a lost client is dropped, the others go on
    with every result right (the PS server ends once they left; the Dask server saw
    the lost client's comm end with CommClosedError and no other error)."""
    if (begun := struck(plan, res, procs, fault)) is None:
        return res
    lines, t0 = begun
    clients = set(range(1, plan.ranks))
    if plan.victim == 0:        # (a PS worker's call waits 3 x the round's deadline)
        bound = (3 * timeout if plan.layer == "ps" else timeout) + STOP_SLACK \
            if plan.fault in SLOW else KILL_BOUND
        kinds = PS_SERVER_EXPECT[plan.fault] if plan.layer == "ps" else DASK_EXPECT
        errs = lines.take(clients, t0 + bound, res, "error", ("error",))
        for r, v in sorted(errs.items()):
            res.times.append(v["t"] - t0)
            res.errors.append(str(v["error"]))
            if v["wrong"]:
                res.bad("wrong", f"rank {r}: {v['wrong']} of {v['calls']} results wrong")
            if v["error"] not in kinds:
                res.bad("untyped", f"rank {r}: {v['error']} (want {'/'.join(kinds)}): "
                                   f"{v.get('msg')}")
        return res
    survivors = clients - {plan.victim}
    asked = survivors | ({0} if plan.layer == "dask" else set())
    time.sleep(max(0.0, t0 + timeout + GO_ON - time.time()))
    for r in asked:
        procs[r].send_signal(signal.SIGUSR2)
    got = lines.take(asked, time.time() + KILL_BOUND, res, "report", ("error",))
    for r, v in sorted(got.items()):
        if r == 0:
            for odd in v["odd"]:
                res.bad("untyped", f"rank 0: a comm ended with {odd}")
            if plan.fault != "stop" and not v["closed"]:
                res.bad("hang", "rank 0: the lost client's comm has not ended")
            continue
        if v["wrong"]:
            res.bad("wrong", f"rank {r}: {v['wrong']} of {v['calls']} results wrong")
        if v["error"] is not None:
            res.errors.append(str(v["error"]))
            res.bad("stalled", f"rank {r}: {v['error']}: {v.get('msg')}")
        elif v["t_last"] < t0 + timeout:
            res.bad("stalled", f"rank {r}: no round ended in the {v['t'] - t0:.1f} s "
                               f"after the fault but in its first {timeout:g} s")
    if plan.fault == "stop":
        procs[plan.victim].send_signal(signal.SIGCONT)
    procs[plan.victim].kill()
    if plan.layer == "ps":
        lines.take({0}, time.time() + SERVED, res, "served", ("served",))
    return res


def judge(res: Result, plan: Plan, r: int, v: dict, t0: float) -> None:
    """One survivor's error line against the fault."""
    res.times.append(v["t"] - t0)
    res.errors.append(v["error"] if v["stream_error"] is None
                      else f"{v['stream_error']}+{v['error']}")
    if v["wrong"]:
        res.bad("wrong", f"rank {r}: {v['wrong']} of {v['calls']} results wrong")
    kinds, stream_kinds = EXPECT[plan.fault]
    if v["error"] not in kinds:
        res.bad("untyped", f"rank {r}: {v['error']} (want {'/'.join(kinds)}): {v['msg']}")
    elif v["named"] != plan.victim:
        res.bad("misnamed", f"rank {r}: names rank {v['named']}: {v['msg']}")
    if v["stream_error"] is not None:
        if v["stream_peer"] == plan.victim:
            if v["stream_error"] not in stream_kinds:
                res.bad("untyped", f"rank {r}: stream {v['stream_error']} (want "
                                   f"{'/'.join(stream_kinds)}): {v['stream_msg']}")
        # a partner that survived: only its stream deadline may have passed (held in a
        # collective by the fault, or gone on to shrink, it cannot answer in time)
        elif v["stream_error"] != "Timeout":
            res.bad("misnamed", f"rank {r}: stream to rank {v['stream_peer']} failed: "
                                f"{v['stream_error']}: {v['stream_msg']}")


def quantiles(xs: list[float]) -> str:
    if not xs:
        return "none"
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))]
    return (f"p50 {q(0.5):.2f} s, p90 {q(0.9):.2f} s, p99 {q(0.99):.2f} s, "
            f"max {s[-1]:.2f} s (n={len(s)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", default=None, help="default: a random one (printed)")
    ap.add_argument("--providers", default="shm,tcp")
    ap.add_argument("--seconds", type=float, default=0,
                    help="start no trial after this many seconds (0: no cap)")
    ap.add_argument("--timeout", type=float, default=3.0,
                    help="every collective's deadline (what names a stopped rank)")
    ap.add_argument("--layers", default=",".join(LAYERS), help="drawn from these")
    ap.add_argument("--faults", default=",".join(FAULTS), help="drawn from these")
    ap.add_argument("--replay", default=None, help="run the one trial SEED-INDEX "
                    "(with the same --layers and --faults)")
    ap.add_argument("--logs", default=None, help="where failed trials' stderr is kept")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else str(random.randrange(1 << 16))
    if a.replay:
        seed = a.replay.rpartition("-")[0]
    seeds = [a.replay] if a.replay else [f"{seed}-{i}" for i in range(a.trials)]
    providers = a.providers.split(",")
    layers, faults = tuple(a.layers.split(",")), tuple(a.faults.split(","))
    if not set(layers) <= set(LAYERS) or not set(faults) <= set(FAULTS):
        ap.error(f"--layers from {LAYERS}, --faults from {FAULTS}")
    if "drop" in faults and (os.geteuid() != 0 or shutil.which("ip") is None):
        ap.error("--faults drop makes network namespaces: it needs root and iproute2 "
                 "(`ip`); leave it out")
    logdir = Path(a.logs or tempfile.mkdtemp(prefix="rdmamw-chaos-"))
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"[chaos] seed {seed}: {len(seeds)} trials on {','.join(providers)}, collective "
          f"deadline {a.timeout:g} s (replay one: --replay SEED-INDEX)", flush=True)
    start = time.time()
    results: list[Result] = []
    for s in seeds:
        if a.seconds and time.time() - start > a.seconds:
            print(f"[chaos] --seconds {a.seconds:g} reached: {len(results)} trials run")
            break
        plan = Plan.draw(s, providers, layers, faults)
        began = time.time()
        res, log = run_trial(plan, a.timeout, logdir)
        took = f"[{time.time() - began:.0f} s]"
        results.append(res)
        t = (f"{','.join(sorted(set(res.errors))) or '-'} "
             f"{min(res.times, default=0):.2f}-{max(res.times, default=0):.2f} s")
        if res.problems:
            print(f"trial {s:>8}: {plan}: FAIL {t} {took}; ranks' stderr: {log}",
                  flush=True)
            for kind, whats in res.problems.items():
                for w in whats:
                    print(f"    {kind}: {w}", flush=True)
            for w in res.late:
                print(f"    late: {w}", flush=True)
        else:
            log.unlink(missing_ok=True)
            print(f"trial {s:>8}: {plan}: ok {t}, shrink "
                  f"{max(res.shrink_times, default=0):.2f} s {took}", flush=True)
    counts = {k: sum(len(r.problems.get(k, ())) for r in results) for k in KINDS}
    failed = sum(1 for r in results if r.problems)
    print(f"[chaos] seed {seed}: {len(results)} trials, {failed} failed, "
          f"{time.time() - start:.0f} s")
    print("[chaos] " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    for fault in faults:
        xs = [t for r in results if r.plan.fault == fault for t in r.times]
        print(f"[chaos] time to error after {fault:4}: {quantiles(xs)}")
    xs = [t for r in results for t in r.shrink_times]
    print(f"[chaos] shrink + allreduce after the error: {quantiles(xs)}")
    if not any(r.problems for r in results):
        try:
            logdir.rmdir()
        except OSError:
            pass
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
