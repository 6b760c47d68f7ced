"""A parameter-server job loses a worker and takes its replacement back while it runs
(rdmamw/ps/rejoin.py, KVServer.admit): one server and three workers, worker 2 SIGKILLs
itself between two pushes, the server drops it, a new process with its launcher
environment re-joins (after a slow start the others must not wait for), gets the
current model and is counted from then on; all finish. Per consistency model, on shm
and tcp, every value is compared whole with a sequential reference: the model after
c updates is a function of c alone (every worker's gradient is the same function of
the same model: ``quad`` = x - target under BSP; ``const`` = the target under the
others, whose rounds mix gradients computed on different models)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from rdmamw.bootstrap.launch import free_port, job_env
from tests.integrations.test_bootstrap import ROOT
from tests.support.helpers import reap
from tests.support.ps_job import shapes, targets
from tests.support.ps_join_job import BIG, DIE, EXTRA, KEYS, LR, MU, SERVERS

JOB = os.path.join(ROOT, "tests", "support", "ps_join_job.py")
WORKERS, VICTIM = 3, 2
#: (consistency, gradient, whether the model counts rounds (else gradients, x 1/n))
MODELS = [("bsp", "quad", True), ("asp", "const", False), ("ssp:1", "const", False),
          ("lsp:2:1", "const", True), ("alsp:1", "const", True)]


def start(rank: int, port: int, token: str, provider: str, args: list[str], logs: str,
          tag: str) -> subprocess.Popen:
    env = {"RDMAMW_JOB_ID": "ps-join-test", "PYTHONPATH": ROOT}   # (tests.support)
    if provider != "shm":
        env["RDMAMW_PROVIDER"] = provider
    with open(os.path.join(logs, f"rank{rank}-{tag}.log"), "w") as err:
        return subprocess.Popen([sys.executable, JOB, *args], cwd=ROOT, text=True,
                                env=job_env(rank, SERVERS + WORKERS, "127.0.0.1", port,
                                            token, env),
                                stdout=subprocess.PIPE, stderr=err)


def logs(out: str) -> str:
    return "\n".join(f"== {n}\n{open(os.path.join(out, n)).read()[-2000:]}"
                     for n in sorted(os.listdir(out)) if n.endswith(".log"))


def reference(grad: str, count: int, scale: float) -> list[np.ndarray]:
    """Every key after ``count`` SGD steps (lr, momentum as the job's) of ``scale`` x
    the gradient, from the initial ones."""
    out = []
    for (shape, _), t in zip(shapes(BIG), targets(BIG), strict=True):
        x, v, t = np.ones(shape), np.zeros(shape), t.astype(np.float64)
        for _ in range(count):
            v = MU * v + scale * ((x - t) if grad == "quad" else t)
            x = x - LR * v
        out.append(x)
    return out


def check_values(got: list[np.ndarray], grad: str, count: int, rounds: bool, what: str
                 ) -> None:
    ref = reference(grad, count, 1.0 if rounds else 1.0 / WORKERS)
    for k, g, r in zip(KEYS, got, ref, strict=True):
        assert g.shape == r.shape, (what, k)
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5, err_msg=f"{what}: key {k!r}")


def check_read(path: str, grad: str, rounds: bool) -> int:
    """A worker's saved values against the reference at the count it read them at."""
    with np.load(path) as f:
        got = [f[f"arr_{i}"] for i in range(len(KEYS))]
        count = int(f["versions"][0]) if rounds else int(f["merged"])
    check_values(got, grad, count, rounds, os.path.basename(path))
    return count


@pytest.mark.timeout(240)
@pytest.mark.parametrize("provider", ["shm", "tcp"])
@pytest.mark.parametrize(("consistency", "grad", "rounds"), MODELS,
                         ids=[m[0] for m in MODELS])
def test_a_replacement_worker_joins_a_running_job(provider, consistency, grad, rounds,
                                                  tmp_path):
    port, token, out = free_port(), secrets.token_hex(32), str(tmp_path)
    common = [consistency, out, grad, "1.0"]
    procs = [start(0, port, token, provider, ["server", *common, "10"], out, "server")]
    procs += [start(SERVERS + w, port, token, provider,
                    ["victim" if w == VICTIM else "member", *common], out, f"w{w}")
              for w in range(WORKERS)]
    try:
        for p in procs[1:]:
            assert json.loads(p.stdout.readline())["ready"] is not None
        assert procs[1 + VICTIM].wait(60) == -9                # it killed itself
        procs.append(start(SERVERS + VICTIM, port, token, provider,
                           ["replacement", *common], out, "replacement"))
        rows = [json.loads(line) for p in procs if p is not procs[1 + VICTIM]
                for line in p.communicate(timeout=180)[0].splitlines()]
    finally:
        reap(procs)
    for p in procs:
        assert p.returncode in (0, -9), logs(out)
    server = next(r for r in rows if r["role"] == "server")
    done = sorted((r["index"], r["mode"]) for r in rows if "index" in r)
    assert done == [(0, "member"), (1, "member"), (2, "replacement")]
    # the server dropped worker 2, took the replacement in (after the others moved on
    # without it: it arrived, then slept) and lost nobody in the end
    assert server["lost"] == [] and server["dropped_workers"] == 0
    (j,) = server["joined"]
    assert j["worker"] == VICTIM and j["version"] > j["arrived"], j
    assert server["timeouts"] == 0 and server["below_quorum"] == 0
    # the replacement's first values: the model at its version, whole
    first = check_read(os.path.join(out, f"first{VICTIM}-replacement.npz"), grad, rounds)
    assert first == (j["version"] if rounds else first)
    for w, mode in done:
        check_read(os.path.join(out, f"final{w}-{mode}.npz"), grad, rounds)
    count = server["version"] if rounds else server["merged"]
    with np.load(os.path.join(out, "server0.npz")) as f:
        check_values([f[str(k)] for k in KEYS], grad, count, rounds, "the server's model")
    clocks = {r["index"]: r["clock"] for r in rows if "index" in r}
    pushed = clocks[0] + clocks[1] + DIE + clocks[VICTIM]
    assert server["applied"] + server["dropped"] == pushed
    if consistency == "bsp":    # counted from its first round on, fresh every time
        assert server["max_staleness"] == 0 and server["dropped"] == 0
        assert server["merged"] == pushed
        sizes = dict(server["round_sizes"])
        assert sizes.get(3, 0) >= DIE + clocks[VICTIM] - 1 >= DIE + EXTRA - 1, sizes


def test_a_new_worker_index_is_admitted_on_a_channel_of_its_own():
    """KVServer.admit with channels opened by the caller (no launcher): a BSP job of
    workers 0 and 1 takes worker 5 while it runs; its first values are the model at the
    version it joined at, whole; the others went on while it started; the rounds
    after it hold its gradient; the final model is the sequential one."""
    import threading

    from rdmamw.ps import KVServer, KVWorker
    from tests.support.helpers import make_pair

    pairs = [make_pair(slots=16, slot_size=1 << 20) for _ in range(3)]
    srv = KVServer({0: pairs[0][1], 1: pairs[1][1]}, consistency="bsp", lr=LR, momentum=MU)
    loop = threading.Thread(target=srv.serve, daemon=True)
    loop.start()
    tg, stop, errors = targets(BIG), threading.Event(), []

    def run(w: KVWorker, iters: int | None, first: list | None = None) -> None:
        try:
            x = [np.zeros(s, d) for s, d in shapes(BIG)]
            w.init(KEYS, [np.full(s, 1.0, d) for s, d in shapes(BIG)])
            w.pull_start(KEYS, out=x)
            if first is not None:
                first.append(([v.copy() for v in x], w.base[0]))
            i = 0
            while (not stop.is_set()) if iters is None else i < iters:
                w.push(KEYS, [xi - ti for xi, ti in zip(x, tg, strict=True)])
                w.pull(KEYS, out=x)
                i += 1
            w.done()
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    members = [threading.Thread(target=run, args=(KVWorker([p[0]], timeout=30), None))
               for p in pairs[:2]]
    try:
        for t in members:
            t.start()
        while srv.policy.version < 5:
            threading.Event().wait(0.01)
        srv.admit(5, pairs[2][1])
        threading.Event().wait(0.5)         # a slow start: nobody waits for it
        first: list = []
        run(KVWorker([pairs[2][0]], timeout=30), EXTRA, first)
        stop.set()
        for t in members:
            t.join(30)
        loop.join(30)
    finally:
        stop.set()
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()
    assert not errors, errors
    s = srv.stats()
    (j,) = s["joined"]
    (x0, v0), = first
    assert j["worker"] == 5 and j["version"] == v0 > j["arrived"] >= 5 and srv.n == 3
    assert s["timeouts"] == 0 and s["below_quorum"] == 0
    check_values(x0, "quad", v0, True, "worker 5's first values")
    check_values([srv.model[k] for k in KEYS], "quad", s["version"], True, "the model")
    assert s["round_sizes"][3] >= EXTRA - 1 and s["max_staleness"] == 0 and s["lost"] == []


def test_a_live_workers_index_is_not_taken_and_a_joiner_may_not_push_first():
    """admit() of a live worker's index closes the new channel (a second process of a
    live rank never replaces it); a joiner's push before its first read is refused
    (PSError), nothing of it in the model."""
    import threading
    import time

    from rdmamw.errors import ChannelClosed, PeerLost
    from rdmamw.ps import KVServer, KVWorker, PSError
    from tests.support.helpers import make_pair

    pairs = [make_pair(slots=16, slot_size=1 << 20) for _ in range(3)]
    srv = KVServer({0: pairs[0][1]}, consistency="asp", lr=LR, momentum=MU)
    loop = threading.Thread(target=srv.serve, daemon=True)
    loop.start()
    w0 = KVWorker([pairs[0][0]], timeout=30)
    try:
        w0.init(["k"], [np.ones(100)])
        w0.pull_start(["k"])
        srv.admit(0, pairs[1][1])               # worker 0 is live
        w0.push(["k"], [np.ones(100)])
        assert np.array_equal(w0.pull(["k"])[0], srv.model["k"])
        with pytest.raises((PeerLost, ChannelClosed)):
            pairs[1][0].recv(timeout=10)
        before = srv.model["k"].copy()
        srv.admit(1, pairs[2][1])
        w1 = KVWorker([pairs[2][0]], timeout=30)
        w1.init(["k"], [np.zeros(100)])         # loses to the model's values
        w1.push(["k"], [np.full(100, 50.0)])
        with pytest.raises(PSError, match="pushed before it joined"):
            w1.pull(["k"])
        assert np.array_equal(srv.model["k"], before)
        # the pull takes it in (its first read; the server may not be there yet, the
        # refusal came first); the push before it counted nowhere
        end = time.monotonic() + 10
        while not srv.joined and time.monotonic() < end:
            time.sleep(0.01)
        assert [j["worker"] for j in srv.joined] == [1]
        assert srv.policy.merged == 1 and srv.policy.clock[1] == srv.policy.clock[0] == 1
        w0.done()
    finally:
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()
        loop.join(10)
