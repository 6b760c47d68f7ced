"""Train a small CNN in PyTorch on scikit-learn's digits (8x8 images) over rdmamw's
parameter server, once per consistency model, one worker slowed down; then a table
and a plot of test accuracy vs wall time, as ``rdmamw demo`` prints for its MLP.

    python examples/torch_ps_train.py                      # 4 workers + 2 servers, 2x straggler
    python examples/torch_ps_train.py --consistency bsp,lsp,alsp --epochs 6 --plot cnn.png
    python -m rdmamw.bootstrap.launch -n 6 -- python examples/torch_ps_train.py

The training loop is torch's own (model, loss, ``torch.optim.SGD`` with momentum); the
only change for the parameter server is ``rdmamw.torch.DistributedOptimizer`` around
the optimizer (docs/torch.md): gradients go to the servers from backward's hooks, the
servers merge them as the consistency model says. Every option of ``rdmamw demo``
applies (``--help``), e.g. ``--sched dsana``. Needs scikit-learn and matplotlib
(``pip install rdmamw[examples]``)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from rdmamw.apps.demo.demo import App, main
from rdmamw.apps.demo.train import RunConfig, Trainer
from rdmamw.torch import DistributedOptimizer


def cnn() -> torch.nn.Module:
    """1x8x8 -> conv 8 -> pool -> conv 16 -> pool -> 10 classes (about 2.9 k weights)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 2 * 2, 10))


def images(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).reshape(-1, 1, 8, 8)


class TorchTrainer(Trainer):
    """The demo's worker loop (shards, straggler, DSANA shares, worker 0's reports)
    with a torch model and optimizer in place of the numpy MLP."""

    @staticmethod
    def server_sgd(cfg: RunConfig) -> tuple[float, float]:
        return 1.0, 0.0                 # the servers aggregate; torch's optimizer steps

    def start(self) -> list[np.ndarray]:
        torch.set_num_threads(1)        # the ranks already share the cores
        # one seed for all: every run starts from the same model, so the runs compare
        # (the optimizer would start all workers from worker 0's model anyway)
        torch.manual_seed(self.cfg.seed)
        self.net = cnn()
        self.xt, self.yt = images(self.xs), torch.from_numpy(self.ys.astype(np.int64))
        self.xte = images(self.data.xte)
        inner = torch.optim.SGD(self.net.parameters(), lr=self.cfg.lr,
                                momentum=self.cfg.momentum)
        self.opt = DistributedOptimizer(inner, self.node,
                                        named_parameters=self.net.named_parameters())
        return []

    def step(self, idx: np.ndarray, started: float) -> list[np.ndarray]:
        self.opt.zero_grad()
        if len(idx):                    # an empty DSANA share: only the clock goes out
            i = torch.from_numpy(idx)
            torch.nn.functional.cross_entropy(self.net(self.xt[i]), self.yt[i]).backward()
        self.pace(started)
        self.opt.step(samples=len(idx) if self.cfg.sched == "dsana" else None)
        return []

    def accuracy(self, params: list[np.ndarray]) -> float:
        with torch.no_grad():
            pred = self.net(self.xte).argmax(1).numpy()
        return float(np.mean(pred == self.data.yte))


APP = App(label="digits CNN in torch (conv8-conv16-linear)", trainer=TorchTrainer,
          command=(os.path.abspath(__file__),))

if __name__ == "__main__":
    sys.exit(main(app=APP))
