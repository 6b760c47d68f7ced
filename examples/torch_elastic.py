"""A DDP job that loses a rank, finishes on the others, or takes a replacement back:
each rank fits the same linear model to its own share of the data; one rank dies half
way; the survivors catch the error (it names the lost rank), agree on who they are
(``rdmamw.torch.shrink()``), wrap the model again on the survivors' group and go on.

    python -m rdmamw.bootstrap.launch -n 4 --max-lost 1 -- \\
        python examples/torch_elastic.py --lose 2 --at 20

``--max-lost 1`` lets the launcher's other ranks run on when one fails (its default
stops them all). Under torchrun the agent stops and restarts every rank when one
fails; run the training loop the same way, it is the launcher that decides.

With ``--replace`` the job comes back to full size: the survivors' rank 0 plays the
elastic launcher and starts a new process for the lost rank (that rank's environment,
``--joining``); it calls ``rdmamw.torch.join()`` while the survivors, at step
``--back``, call ``rdmamw.torch.grow()``; every rank wraps the model in DDP on the
grown group, which broadcasts rank 0's parameters to the newcomer (its own model is
a fresh one), and rank 0 broadcasts the step the job is at.

Each process prints one line: ``result {json}`` (its rank before and after, the error
it saw, the loss, and its whole state_dict: equal on every rank at the end)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
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


def replacement(lost: int) -> subprocess.Popen[bytes]:
    """What an elastic launcher does after a loss: a new process of this script for
    rank ``lost``, with that rank's environment (the job's store, token and size)."""
    env = dict(os.environ, RANK=str(lost), LOCAL_RANK=str(lost))
    return subprocess.Popen([sys.executable, *sys.argv, "--joining"], env=env)


def wrap(model: torch.nn.Module, pg: object) -> torch.nn.parallel.DistributedDataParallel:
    """DDP on ``pg``: its construction broadcasts rank 0's parameters and buffers to
    every rank of the group (a newcomer's model becomes the job's)."""
    return torch.nn.parallel.DistributedDataParallel(model, process_group=pg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lose", type=int, default=-1, help="this rank dies (default none)")
    ap.add_argument("--at", type=int, default=20, help="... at this step")
    ap.add_argument("--replace", action="store_true",
                    help="a new process takes the lost rank's place")
    ap.add_argument("--back", type=int, default=40, help="... at this step")
    ap.add_argument("--joining", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=30.0, help="the group's deadline, s")
    args = ap.parse_args()

    timeout = datetime.timedelta(seconds=args.timeout)
    error, pg, step, loss, first, child = None, None, 0, float("nan"), None, None
    if args.joining:                            # the replacement of a lost rank
        pg = rt.join(timeout)                   # waits for the members' grow
        torch.manual_seed(1000)                 # a model of its own: not the job's
        model = torch.nn.Linear(FEATURES, 1)
        net = wrap(model, pg)                   # now it is rank 0's
        at = torch.tensor([0])
        pg.broadcast([at]).wait()               # the step the job is at
        step, error = int(at), f"joined at step {int(at)}"
    else:
        dist.init_process_group("rdmamw", timeout=timeout)
        torch.manual_seed(0)                    # the same initial model on every rank
        model = torch.nn.Linear(FEATURES, 1)
        net = torch.nn.parallel.DistributedDataParallel(model)
    me = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data(me, 256)
    while step < args.steps:
        if me == args.lose and step == args.at and not args.joining:
            os.kill(os.getpid(), signal.SIGKILL)  # dies without a word, as a crash does
        if args.replace and step == args.back and error and not args.joining:
            t0 = time.monotonic()
            pg = rt.grow(pg)                    # every member calls it; waits for the new
            net = wrap(model, pg)
            pg.broadcast([torch.tensor([step])]).wait()
            error += f" (grown to {pg.size()} ranks in {time.monotonic() - t0:.2f} s)"
        try:
            opt.zero_grad()
            out = torch.nn.functional.mse_loss(net(x), y)
            out.backward()                      # DDP's allreduce of the gradients
            opt.step()
            loss, step = float(out.detach()), step + 1
            first = loss if first is None else first
        except (RuntimeError, rdmamw.RdmamwError) as e:
            if pg is not None:                  # lost a second time: give up
                raise
            error, t0 = f"{type(e).__name__}: {str(e).splitlines()[0]}", time.monotonic()
            pg = rt.shrink()                    # every survivor calls it
            net = wrap(model, pg)
            error += f" (shrunk to {pg.size()} ranks in {time.monotonic() - t0:.2f} s)"
            if args.replace and pg.rank() == 0:
                child = replacement(args.lose)
    # one write of the whole line: the ranks share the launcher's stdout, and with
    # PYTHONUNBUFFERED a print() of text and newline is two writes that interleave
    sys.stdout.write("result " + json.dumps({
        "rank": me, "new_rank": pg.rank() if pg else me,
        "size": pg.size() if pg else dist.get_world_size(), "error": error,
        "steps": step, "first_loss": first, "loss": loss,
        "state": {k: v.flatten().tolist() for k, v in model.state_dict().items()}}) + "\n")
    sys.stdout.flush()
    if child is not None and child.wait() != 0:
        sys.exit(f"the replacement of rank {args.lose} failed ({child.returncode})")


if __name__ == "__main__":
    main()
