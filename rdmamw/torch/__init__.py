"""PyTorch on rdmamw: ``import rdmamw.torch`` registers the ``torch.distributed``
backend "rdmamw" (CPU tensors), so a script switches with
``dist.init_process_group("rdmamw")``; DDP runs on it unchanged. ``DistributedOptimizer``
wraps any torch optimizer over the parameter server (rdmamw.ps). docs/torch.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rdmamw.torch.backend import ProcessGroupRdmamw, Rejoin, create, monitored_barrier
from rdmamw.torch.elastic import grow, join, shrink
from rdmamw.torch.optim import DistributedOptimizer, DistributedOptimizerError
from rdmamw.torch.p2p import P2PMismatch
from rdmamw.torch.tensors import UnsupportedOp, UnsupportedTensor
from rdmamw.torch.work import Timeout

BACKEND = "rdmamw"


def register() -> str:
    """Register the backend "rdmamw" with ``torch.distributed`` (CPU tensors) and
    return its name; idempotent (a second call, or one after ``import rdmamw.torch``,
    does nothing). Importing this package calls it; launchers that build each worker
    (Ray Train, a custom ``mp.spawn`` target) call it in the worker before
    ``init_process_group("rdmamw")`` to say so, whatever imported what."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
    if not getattr(dist.batch_isend_irecv, "_rdmamw", False):
        batch_isend_irecv.torchs = dist.batch_isend_irecv
        dist.batch_isend_irecv = c10d.batch_isend_irecv = batch_isend_irecv
    return BACKEND


def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    """torch's ``dist.batch_isend_irecv``, which ``register()`` puts in its place:
    on an rdmamw group, torch's own loop over the ops bracketed by the group's
    ``_start_coalescing`` / ``_end_coalescing``, so the sends of the batch to one
    peer go as one ``send_batch``. (torch coalesces only when
    ``type(group) is ProcessGroup``, never for a Python ProcessGroup subclass: it
    would call isend once per tensor.) Any other group: torch's unchanged."""
    torchs = batch_isend_irecv.torchs
    group = p2p_op_list[0].group if p2p_op_list else None
    if group is None and p2p_op_list and dist.is_initialized():
        group = c10d._get_default_group()
    if not isinstance(group, ProcessGroupRdmamw):
        return torchs(p2p_op_list)
    group._start_coalescing(torch.device("cpu"))
    try:
        return torchs(p2p_op_list)
    finally:
        group._end_coalescing(torch.device("cpu"))


batch_isend_irecv._rdmamw = True  # type: ignore[attr-defined]


register()

__all__ = ["BACKEND", "DistributedOptimizer", "DistributedOptimizerError", "P2PMismatch",
           "ProcessGroupRdmamw", "Rejoin", "Timeout", "UnsupportedOp", "UnsupportedTensor",
           "batch_isend_irecv", "create", "grow", "join", "monitored_barrier", "register",
           "shrink"]
