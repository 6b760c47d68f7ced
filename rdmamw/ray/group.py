"""The ``ray.util.collective`` group "rdmamw": Ray's collective API over rdmamw.

It meets the way Ray's gloo group does, through Ray's own key-value store (the GCS
``internal_kv``), and is the ``torch.distributed`` backend's process group
(:class:`rdmamw.torch.ProcessGroupRdmamw`) underneath: each Ray call becomes that
group's operation on the same memory (a numpy array is wrapped by
``torch.from_numpy``, no copy), so dtype checks, float16 widening, staging of
non-contiguous tensors, send/recv channels and timeouts are the torch backend's,
written once. Calls block until done, as Ray's gloo group's do."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import numpy as np
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import ReduceOp

from rdmamw import config
from rdmamw.ray.store import NAMESPACE, RayKV, group_root, meet

__all__ = ["NAMESPACE", "RayKV", "RdmamwGroup", "group_root"]

def _torch() -> Any:
    import torch

    import rdmamw.torch  # noqa: F401 - the backend's modules
    return torch


def _tensor(x: Any) -> Any:
    """A torch CPU tensor over ``x``'s memory: ``x`` itself, or a numpy array wrapped
    (``torch.from_numpy``: results land in the array)."""
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    raise TypeError(f"the rdmamw group takes numpy arrays and torch CPU tensors, "
                    f"not {type(x).__name__}")


def _one(tensors: Sequence[Any], what: str) -> Any:
    """Ray hands every tensor argument wrapped in a list (one per GPU): one here."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        raise ValueError(f"{what}: the rdmamw group takes one tensor per process (the "
                         f"multi-GPU calls are nccl's)")
    return tensors[0]


def _blocking(kind: str, **fields: Any) -> Any:
    """torch's ``<kind>Options`` for a blocking call (``asyncOp`` False: the
    collective runs in this thread, no hand-over to the progress thread and back,
    0.2 ms of a 1 MiB allreduce here), with ``fields`` set."""
    from torch.distributed import distributed_c10d as c10d

    o = getattr(c10d, f"{kind}Options")()
    o.asyncOp = False
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def _op(opts: Any) -> Any:
    """Ray's reduce op (options may be None, an instance or the class itself: Ray's
    ``allreduce`` passes the class) as torch's."""
    from torch.distributed import ReduceOp as TorchOp

    op = getattr(opts, "reduceOp", ReduceOp.SUM)
    return {ReduceOp.SUM: TorchOp.SUM, ReduceOp.PRODUCT: TorchOp.PRODUCT,
            ReduceOp.MIN: TorchOp.MIN, ReduceOp.MAX: TorchOp.MAX}[op]


class RdmamwGroup(BaseGroup):
    """A Ray collective group on rdmamw (module doc). Made by Ray's group manager
    (``init_collective_group`` in an actor, or lazily after the driver's
    ``create_collective_group``) with ``(world_size, rank, group_name)``."""

    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        super().__init__(world_size, rank, group_name)
        from rdmamw.torch.backend import ProcessGroupRdmamw

        secs = config.get("RDMAMW_INIT_TIMEOUT")
        # this attempt's own keys (rdmamw/ray/store.py): never a dead attempt's
        self._kv = meet(group_name, rank, world_size, secs)
        self._pg = ProcessGroupRdmamw(self._kv, rank, world_size,
                                      datetime.timedelta(seconds=secs))
        # every rank has read every key once the barrier passes: rank 0 removes the
        # name's (the attempt's and the meeting's), so the store does not keep them
        try:
            self.barrier()
        except BaseException:
            self._pg.shutdown()         # its channels and listeners, not left open
            raise
        if rank == 0:
            RayKV(group_root(group_name), self._kv.host).clear()

    @classmethod
    def backend(cls) -> str:
        return "RDMAMW"

    @classmethod
    def check_backend_availability(cls) -> bool:
        try:
            _torch()
        except ImportError:
            return False
        return True

    def destroy_group(self) -> None:
        self._pg.shutdown()
        if self.rank == 0:              # what was written since (monitored barriers)
            self._kv.clear()

    # ---- collectives -----------------------------------------------------------------

    def allreduce(self, tensor: list, allreduce_options: Any = None) -> None:
        o = _blocking("Allreduce", reduceOp=_op(allreduce_options))
        self._pg.allreduce([_tensor(_one(tensor, "allreduce"))], o).wait()

    def reduce(self, tensor: list, reduce_options: Any = None) -> None:
        """The result in ``tensor`` on the root; the others' tensors are left as they were."""
        o = _blocking("Reduce", reduceOp=_op(reduce_options),
                      rootRank=getattr(reduce_options, "root_rank", 0))
        self._pg.reduce([_tensor(_one(tensor, "reduce"))], o).wait()

    def broadcast(self, tensor: list, broadcast_options: Any = None) -> None:
        o = _blocking("Broadcast", rootRank=getattr(broadcast_options, "root_rank", 0))
        self._pg.broadcast([_tensor(_one(tensor, "broadcast"))], o).wait()

    def allgather(self, tensor_list: list, tensor: list, allgather_options: Any = None
                  ) -> None:
        outs = [_tensor(t) for t in _one(tensor_list, "allgather")]
        self._pg.allgather([outs], [_tensor(_one(tensor, "allgather"))],
                           _blocking("Allgather")).wait()

    def reducescatter(self, tensor: list, tensor_list: list,
                      reducescatter_options: Any = None) -> None:
        """This rank's part of the reduced list in ``tensor``; the list is left as it
        was (Ray's gloo group all-reduces it in place, an implementation detail)."""
        o = _blocking("ReduceScatter", reduceOp=_op(reducescatter_options))
        ins = [_tensor(t) for t in _one(tensor_list, "reducescatter")]
        self._pg.reduce_scatter([_tensor(_one(tensor, "reducescatter"))], [ins], o).wait()

    def barrier(self, barrier_options: Any = None) -> None:
        self._pg.barrier(_blocking("Barrier")).wait()

    # ---- point to point --------------------------------------------------------------

    def send(self, tensor: list, send_options: Any) -> None:
        self._pg.send([_tensor(_one(tensor, "send"))], send_options.dst_rank, 0).wait()

    def recv(self, tensor: list, recv_options: Any) -> None:
        self._pg.recv([_tensor(_one(tensor, "recv"))], recv_options.src_rank, 0).wait()

