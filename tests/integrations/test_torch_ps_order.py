"""DistributedOptimizer under the orders a real job's timing only sometimes gives (a
quiet machine let one worker run far ahead, or declare the model first): one
KVServer on a thread and two KVWorkers on threads of this process, over shm channel
pairs, the test deciding who goes when by watching the server's state (no sleeps).

Whatever the order, every worker must start from worker 0's parameters, and no
gradient may be merged before every worker holds them: a worker that joined late
once copied the servers' running gradient sum as its model, and its gradients then
stopped the others learning (tests/integrations/test_torch_ps.py's ASP job, the example's
lsp+dsana run)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rdmamw.ps.consistency import Consistency  # noqa: E402
from rdmamw.sched import Dsana  # noqa: E402
from rdmamw.torch import DistributedOptimizer  # noqa: E402
from tests.support.helpers import PSInProcess, wait_for  # noqa: E402
from tests.support.torch_ps_job import batches, model  # noqa: E402

ITERS, BATCH = 40, 8


class Job(PSInProcess):
    """A server (lr 1, no momentum: it only sums gradients) and two workers, each
    training on a thread once :meth:`start` says so."""

    def __init__(self, consistency: str, dsana: bool) -> None:
        super().__init__(2, consistency=consistency, lr=1.0, momentum=0.0,
                         scheduler=Dsana([0, 1], BATCH) if dsana else None)
        self.dsana = dsana
        self.out: dict[int, dict] = {0: {}, 1: {}}
        self.threads: dict[int, threading.Thread] = {}

    def start(self, w: int) -> None:
        self.threads[w] = threading.Thread(target=self._train, args=(w,), daemon=True)
        self.threads[w].start()

    def finish(self) -> dict[int, dict]:
        for t in self.threads.values():
            t.join(60)
        self.close()
        return self.out

    def _train(self, w: int) -> None:
        out, node = self.out[w], self.workers[w]
        try:
            net = model(seed=w)                 # the workers' own inits differ
            opt = DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.05), node,
                                       named_parameters=net.named_parameters())
            out["start"] = [p.detach().clone() for p in net.parameters()]
            out["merged_at_start"] = node.merged
            x_test, y_test = batches(1, 256, seed=7)[0]
            mse = torch.nn.functional.mse_loss
            with torch.no_grad():
                out["init_loss"] = float(mse(net(x_test), y_test))
            for x, y in batches(ITERS, BATCH):
                off, share = node.assignment[:2] if self.dsana else (w * BATCH // 2, BATCH // 2)
                opt.zero_grad()
                if share:
                    mse(net(x[off:off + share]), y[off:off + share]).backward()
                opt.step(samples=share if self.dsana else None)
            with torch.no_grad():
                out["final_loss"] = float(mse(net(x_test), y_test))
            out["done"] = True
        except Exception as e:      # noqa: BLE001 - the test shows it
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            node.done()


MODES = [("asp", False), ("ssp:2", False), ("lsp:1:2", True), ("alsp:2", False),
         ("hybrid:1:dc0.04", False)]


@pytest.mark.parametrize("order", ["worker 0 runs ahead", "worker 1 declares first"])
@pytest.mark.parametrize("consistency, dsana", MODES,
                         ids=[m + ("+dsana" if d else "") for m, d in MODES])
def test_every_worker_starts_from_worker_0s_model_and_learns(consistency, dsana, order):
    job = Job(consistency, dsana)
    first, second = (0, 1) if order == "worker 0 runs ahead" else (1, 0)
    job.start(first)
    # the first worker trains as far as the servers let it before the second exists
    wait_for(lambda: job.out[first].get("done") or "error" in job.out[first]
             or job.held(first), f"worker {first} finished or waits for the other")
    job.start(second)
    out = job.finish()
    assert [out[w].get("error") for w in (0, 1)] == [None, None], out
    want = [p.detach() for p in model(seed=0).parameters()]
    seen = {w: {"merged at start": out[w]["merged_at_start"],
                "starts from worker 0's model": all(
                    torch.equal(a, b) for a, b in zip(out[w]["start"], want, strict=True)),
                "held-out loss ratio < 0.5": out[w]["final_loss"] < 0.5 * out[w]["init_loss"]}
            for w in (0, 1)}
    ok = {"merged at start": 0, "starts from worker 0's model": True,
          "held-out loss ratio < 0.5": True}
    assert seen == {0: ok, 1: ok}, {w: (out[w]["init_loss"], out[w]["final_loss"])
                                     for w in (0, 1)}


@pytest.mark.parametrize("consistency", ["asp", "lsp:1:100"])
def test_a_worker_far_behind_gets_every_gradient_merged_since_its_last_pull(consistency):
    """Plain SGD with lr 1 on the workers makes each one's model the servers' value as
    it last read it, if the baseline (the value pulled before) is kept right: worker 1
    waits after its first step until worker 0 has done all of its, then its next pull
    holds 39 of worker 0's gradients at once."""
    # lsp: worker 0's first gradient may come late to a round only worker 1's fresh
    # one would close; worker 1 waits, so that round closes by its timeout
    job = PSInProcess(2, consistency=Consistency.parse(consistency, round_timeout=0.2),
                      lr=1.0, momentum=0.0)
    nets = [model(seed=w) for w in (0, 1)]
    ahead_done, snapshot = threading.Event(), {}

    def train(w: int) -> None:
        opt = DistributedOptimizer(torch.optim.SGD(nets[w].parameters(), lr=1.0),
                                   job.workers[w], named_parameters=nets[w].named_parameters())
        for i, (x, y) in enumerate(batches(ITERS, BATCH)):
            if w == 1 and i == 1:
                assert ahead_done.wait(30)
            opt.zero_grad()
            mine = slice(w * BATCH // 2, (w + 1) * BATCH // 2)
            torch.nn.functional.mse_loss(nets[w](x[mine]), y[mine]).backward()
            opt.step()
        if w == 0:      # the server is idle now: its model is what worker 0 read last
            snapshot.update({k: v.copy() for k, v in job.server.model.items()})
            ahead_done.set()

    got = job.run(train)
    final = {k: v.copy() for k, v in job.server.model.items()}
    job.close()
    assert got == {0: "ok", 1: "ok"}
    assert job.server.policy.merged == 2 * ITERS
    for w, want in ((0, snapshot), (1, final)):
        for name, p in nets[w].named_parameters():
            np.testing.assert_allclose(p.detach().numpy(), want[name], rtol=1e-9, atol=1e-12,
                                       err_msg=f"worker {w} {name}")
