"""One rank of a DistributedOptimizer test job (started by the local launcher): ranks
below --servers serve, the others train a tiny torch MLP on a regression problem,
each worker on its half of every global batch. Each worker seeds its model
differently (the optimizer broadcasts worker 0's values) and saves its
initial and final parameters to --dump DIR/worker<index>.pt; each rank prints one
JSON line (a worker: its loss on a held-out set before and after training, or the
error it got)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from rdmamw import ps
from rdmamw.torch import DistributedOptimizer

IN, HIDDEN = 4, 3


def model(seed: int, hidden: int = HIDDEN) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1)).double()


def batches(iters: int, batch: int, seed: int = 123
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every iteration's global batch (``batch`` rows), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
    out = []
    for _ in range(iters):
        x = torch.randn(batch, IN, generator=g, dtype=torch.float64)
        out.append((x, torch.tanh(x @ w) + 0.1))
    return out


def emit(obj: dict) -> None:
    """One write per line: the ranks share the launcher's stdout pipe."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def inner(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.05)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--consistency", default="bsp")
    ap.add_argument("--opt", default="sgd")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--dump", default="")
    a = ap.parse_args()
    node = ps.start(a.servers, consistency=a.consistency, lr=1.0, momentum=0.0, timeout=60)
    import rdmamw
    w = rdmamw.world()
    if isinstance(node, ps.KVServer):
        node.serve()
        node.close()
        emit({"role": "server", "rank": w.rank})
        return 0
    index, workers = w.rank - a.servers, w.world_size - a.servers
    net = model(seed=index)
    row = {"role": "worker", "index": index}
    try:
        opt = DistributedOptimizer(inner(a.opt, net.parameters()), node,
                                   named_parameters=net.named_parameters())
        init = [p.detach().clone() for p in net.parameters()]
        held_out = batches(1, 256, seed=7)[0]
        row["init_loss"] = float(torch.nn.functional.mse_loss(net(held_out[0]), held_out[1]))
        share = a.batch // workers
        for x, y in batches(a.iters, a.batch):
            xs, ys = x[index * share:(index + 1) * share], y[index * share:(index + 1) * share]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(xs), ys)
            loss.backward()
            opt.step()
            row["loss"] = float(loss)
        row["final_loss"] = float(torch.nn.functional.mse_loss(net(held_out[0]), held_out[1]))
        if a.dump:
            torch.save({"init": init, "final": [p.detach() for p in net.parameters()]},
                       os.path.join(a.dump, f"worker{index}.pt"))
    except Exception as e:      # noqa: BLE001 - the test reads the error's text
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        node.close()
    emit(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
