"""Train a small MLP (numpy) on scikit-learn's digits with the parameter server: one
consistency model (BSP unless --consistency says otherwise), no plot unless --plot.

    python examples/ps_train.py --consistency ssp:3 --workers 3 --servers 2 --epochs 5
    python examples/ps_train.py --consistency lsp --straggler 3 --json out.json

This is ``rdmamw demo`` (rdmamw/apps/demo/demo.py) with other defaults: servers and workers
are local processes (or the ranks of torchrun / mpirun); each worker trains on its
slice of the training set; the last one can be slowed (--straggler); worker 0
evaluates the model it pulls on the held-out test set. Needs scikit-learn
(``pip install rdmamw[examples]``; `make` installs it)."""

from __future__ import annotations

import sys

from rdmamw.apps.demo.demo import main

if __name__ == "__main__":
    sys.exit(main(["--consistency", "bsp", "--plot", "", "--epochs", "5", *sys.argv[1:]]))
