"""rdmamw.torch.DistributedOptimizer end to end: small jobs of tests/support/torch_ps_job.py
(1 server + 2 workers on shm). BSP must give exactly what one process computes on
the concatenated batches with the same torch optimizer (SGD with momentum, Adam)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from test_ps import ROOT, clean_env  # noqa: E402

from rdmamw.torch import DistributedOptimizer  # noqa: E402
from tests.support.torch_ps_job import batches, inner, model  # noqa: E402

JOB = os.path.join(ROOT, "tests", "support", "torch_ps_job.py")
#: the jobs start 3-6 processes that each import torch: ~10 s on a quiet machine,
#: past the suite's 120 s once on 2 cores at load 25 (their own timeouts stay 120-150 s)
pytestmark = pytest.mark.timeout(300)


def job(*args: str, n: int = 3) -> list[dict]:
    p = subprocess.run([sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", str(n), "--",
                        sys.executable, JOB, *args], cwd=ROOT,
                       env={**clean_env(), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return sorted((r for r in rows if r["role"] == "worker"), key=lambda r: r["index"])


def single_process(opt: str, init: list, iters: int, batch: int) -> list:
    """The same model and optimizer in one process on the whole global batches."""
    net = model(seed=99)
    with torch.no_grad():
        for p, v in zip(net.parameters(), init, strict=True):
            p.copy_(v)
    o = inner(opt, net.parameters())
    for x, y in batches(iters, batch):
        o.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        o.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_bsp_equals_one_process_on_the_concatenated_batches(opt, tmp_path):
    iters = 6
    workers = job("--opt", opt, "--iters", str(iters), "--dump", str(tmp_path))
    assert [w.get("error") for w in workers] == [None, None]
    dumps = [torch.load(tmp_path / f"worker{i}.pt") for i in range(2)]
    for a, b, c in zip(dumps[0]["init"], dumps[1]["init"], model(seed=0).parameters(),
                       strict=True):
        assert torch.equal(a, b) and torch.equal(a, c.detach())    # worker 0's, broadcast
    ref = single_process(opt, dumps[0]["init"], iters, 8)
    start = [p.clone() for p in dumps[0]["init"]]
    assert any(not torch.allclose(r, s) for r, s in zip(ref, start, strict=True))
    for d in dumps:
        for got, want in zip(d["final"], ref, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mode", ["asp", "ssp:2", "alsp:2", "hybrid:1:dc0.04"])
def test_asynchronous_models_converge(mode):
    workers = job("--consistency", mode, "--iters", "60", "--opt", "adam")
    assert len(workers) == 2
    for w in workers:
        assert "error" not in w, w
        # a held-out loss: without the merged gradients it stays at init_loss
        assert w["final_loss"] < 0.3 * w["init_loss"], w


def test_shapes_that_differ_across_workers_name_the_parameter_and_release_the_others():
    """The worker declaring second gets PSError naming the first key that differs;
    leaving (done) releases the other from the start barrier."""
    from helpers import PSInProcess
    job = PSInProcess(2, consistency="bsp", lr=1.0, momentum=0.0)

    def build(w: int) -> None:
        net = model(seed=w, hidden=3 + w)
        DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), job.workers[w],
                             named_parameters=net.named_parameters())

    got = job.run(build)
    job.close()
    assert sorted(v.split(":")[0] for v in got.values()) == ["PSError", "ok"], got
    assert "'0.weight'" in next(v for v in got.values() if v != "ok"), got


@pytest.mark.parametrize("param, text", [
    (torch.zeros(3, dtype=torch.bfloat16), "float32 or float64"),
    (torch.zeros(3, dtype=torch.float16), "float32 or float64"),
    (torch.zeros(4, 4).t(), "contiguous"),
])
def test_parameters_the_servers_cannot_hold_are_refused_before_sending(param, text):
    from rdmamw.torch.optim import DistributedOptimizer, DistributedOptimizerError
    with pytest.raises(DistributedOptimizerError, match=text):
        DistributedOptimizer(torch.optim.SGD([param.requires_grad_()], lr=0.1), None)


def test_parameters_the_names_miss_are_refused_before_sending():
    from rdmamw.torch.optim import DistributedOptimizerError
    net = model(seed=0)
    with pytest.raises(DistributedOptimizerError, match="not in named_parameters"):
        DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), None,
                             named_parameters=list(net.named_parameters())[1:])


def test_the_example_trains_the_cnn_under_each_model_with_and_without_dsana(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "torch_ps_train.py"),
                        "--workers", "2", "--servers", "1", "--epochs", "3",
                        "--compute-ms", "1", "--quiet", "--consistency", "bsp,asp",
                        "--sched", "none,dsana",
                        "--json", str(out), "--plot", str(png)],
                       cwd=tmp_path, env={**clean_env(), "PYTHONPATH": ROOT},
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "digits CNN in torch" in p.stdout and "test acc" in p.stdout
    r = json.loads(out.read_text())
    # (lsp and the other models: test_asynchronous_models_converge, in-process)
    assert [run["name"] for run in r["runs"]] == ["bsp", "bsp+dsana", "asp", "asp+dsana"]
    for run in r["runs"]:
        assert len(run["epochs"]) == 3
        assert run["final_accuracy"] > max(0.3, run["curve"][0]["accuracy"] + 0.15), run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for run in r["runs"][1::2]:         # the workers trained on DSANA's shares of 64
        assert run["sched"]["global_batch"] == 64 and sum(run["sched"]["last_shares"]) == 64


class _Recorder:
    """A KVWorker stand-in: records the pushes and when they came, serves pulls of
    ``value - pulled`` (a server that merged ``step`` into each key)."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self.log: list[tuple[str, str]] = []
        self.step = 0.0

    def init(self, keys, values) -> None:
        for k, v in zip(keys, values, strict=True):
            self.values.setdefault(k, v.copy())

    def pull_start(self, keys):
        return self.pull(keys)

    def pull(self, keys, out=None):
        self.log.append(("pull", ""))
        got = [self.values[k] - self.step for k in keys]
        if out is None:
            return got
        for o, g in zip(out, got, strict=True):
            o[...] = g
        return out

    def push_part(self, keys, values) -> None:
        self.log.append(("push", keys[0]))

    def push_end(self, samples=None) -> None:
        self.log.append(("end", str(samples)))


def test_gradients_go_out_during_backward_and_the_pulled_difference_is_the_gradient():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    node = _Recorder()
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1.0), node,
                               named_parameters=net.named_parameters())
    before = [p.detach().clone() for p in net.parameters()]
    net(torch.ones(5, 3)).sum().backward()
    # pushed by backward's hooks, as backward reaches them (last layer first), before
    # step() is called
    pushed = [k for op, k in node.log if op == "push"]
    assert len(pushed) == 4 and [k[0] for k in pushed] == ["1", "1", "0", "0"], pushed
    assert set(pushed) == {"1.weight", "1.bias", "0.weight", "0.bias"}
    node.step = 0.25                    # the servers merged 0.25 into every element
    opt.step(samples=5)
    assert node.log[-2:] == [("end", "5"), ("pull", "")]
    for p, b in zip(net.parameters(), before, strict=True):
        torch.testing.assert_close(p.grad, torch.full_like(p, 0.25))   # not backward's
        torch.testing.assert_close(p.detach(), b - 0.25)                # SGD lr 1
    opt.close()
    net(torch.ones(5, 3)).sum().backward()
    assert [op for op, _ in node.log].count("push") == 4               # hooks removed
