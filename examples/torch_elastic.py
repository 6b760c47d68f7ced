"""A DDP job that loses a rank and finishes on the others: each rank fits the same
linear model to its own share of the data; one rank dies half way; the survivors
catch the error (it names the lost rank), agree on who they are
(``rdmamw.torch.shrink()``), wrap the model again on the survivors' group and finish
the training with identical parameters.

    python -m rdmamw.bootstrap.launch -n 4 --max-lost 1 -- \\
        python examples/torch_elastic.py --lose 2 --at 20

``--max-lost 1`` lets the launcher's other ranks run on when one fails (its default
stops them all). Under torchrun the agent stops and restarts every rank when one
fails; run the training loop the same way, it is the launcher that decides. Each
rank prints one line: ``result {json}`` (its rank before and after, the error it saw,
the loss, and its parameters' sum: equal on every survivor)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import rdmamw
import rdmamw.torch as rt

FEATURES = 16


def data(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share: y = x w* + noise, the same w* on every rank."""
    w = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, FEATURES, generator=g)
    return x, x @ w + 0.01 * torch.randn(n, 1, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lose", type=int, default=-1, help="this rank dies (default none)")
    ap.add_argument("--at", type=int, default=20, help="... at this step")
    ap.add_argument("--timeout", type=float, default=30.0, help="the group's deadline, s")
    args = ap.parse_args()

    dist.init_process_group("rdmamw", timeout=datetime.timedelta(seconds=args.timeout))
    me = dist.get_rank()
    torch.manual_seed(0)                        # the same initial model on every rank
    model = torch.nn.Linear(FEATURES, 1)
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data(me, 256)
    error, pg, step, loss = None, None, 0, float("nan")
    while step < args.steps:
        if me == args.lose and step == args.at:
            os.kill(os.getpid(), signal.SIGKILL)  # dies without a word, as a crash does
        try:
            opt.zero_grad()
            out = torch.nn.functional.mse_loss(net(x), y)
            out.backward()                      # DDP's allreduce of the gradients
            opt.step()
            loss, step = float(out.detach()), step + 1
        except (RuntimeError, rdmamw.RdmamwError) as e:
            if pg is not None:                  # lost a second time: give up
                raise
            error, t0 = f"{type(e).__name__}: {str(e).splitlines()[0]}", time.monotonic()
            pg = rt.shrink()                    # every survivor calls it
            net = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
            error += f" (shrunk to {pg.size()} ranks in {time.monotonic() - t0:.2f} s)"
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    # one write of the whole line: the ranks share the launcher's stdout, and with
    # PYTHONUNBUFFERED a print() of text and newline is two writes that interleave
    sys.stdout.write("result " + json.dumps({
        "rank": me, "new_rank": pg.rank() if pg else me,
        "size": pg.size() if pg else dist.get_world_size(), "error": error,
        "steps": step, "loss": loss, "params_sum": float(params.double().sum())}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
