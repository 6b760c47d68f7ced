"""PyTorch on rdmamw: ``import rdmamw.torch`` registers the ``torch.distributed``
backend "rdmamw" (CPU tensors), so a script switches with
``dist.init_process_group("rdmamw")``; DDP runs on it unchanged. ``DistributedOptimizer``
wraps any torch optimizer over the parameter server (rdmamw.ps). docs/torch.md."""

from __future__ import annotations

import torch.distributed as dist

from rdmamw.torch.backend import ProcessGroupRdmamw, create, monitored_barrier
from rdmamw.torch.optim import DistributedOptimizer, DistributedOptimizerError
from rdmamw.torch.p2p import P2PMismatch
from rdmamw.torch.tensors import UnsupportedOp, UnsupportedTensor

BACKEND = "rdmamw"


def register() -> str:
    """Register the backend "rdmamw" with ``torch.distributed`` (CPU tensors) and
    return its name; idempotent (a second call, or one after ``import rdmamw.torch``,
    does nothing). Importing this package calls it; launchers that build each worker
    (Ray Train, a custom ``mp.spawn`` target) call it in the worker before
    ``init_process_group("rdmamw")`` to say so, whatever imported what."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
    return BACKEND


register()

__all__ = ["BACKEND", "DistributedOptimizer", "DistributedOptimizerError", "P2PMismatch",
           "ProcessGroupRdmamw", "UnsupportedOp", "UnsupportedTensor", "create",
           "monitored_barrier", "register"]
