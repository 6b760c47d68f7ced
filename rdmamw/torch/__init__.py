"""PyTorch on rdmamw: ``import rdmamw.torch`` registers the ``torch.distributed``
backend "rdmamw" (CPU tensors), so a script switches with
``dist.init_process_group("rdmamw")``; DDP runs on it unchanged. ``DistributedOptimizer``
wraps any torch optimizer over the parameter server (rdmamw.ps). docs/torch.md."""

from __future__ import annotations

import torch.distributed as dist

from rdmamw.torch.backend import ProcessGroupRdmamw, create
from rdmamw.torch.optim import DistributedOptimizer, DistributedOptimizerError
from rdmamw.torch.p2p import P2PMismatch
from rdmamw.torch.tensors import UnsupportedOp, UnsupportedTensor

BACKEND = "rdmamw"

if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])

__all__ = ["BACKEND", "DistributedOptimizer", "DistributedOptimizerError", "P2PMismatch",
           "ProcessGroupRdmamw", "UnsupportedOp", "UnsupportedTensor", "create"]
