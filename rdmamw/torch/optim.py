"""``DistributedOptimizer``: any torch optimizer, data-parallel over rdmamw's parameter
servers (rdmamw.ps), the way BytePS wraps one: the servers only aggregate gradients.

The servers run plain SGD with lr 1 and no momentum (``ps.start(..., lr=1.0,
momentum=0.0)``) on a copy of every parameter, so a server's value is the initial
parameter minus the sum of the (mean) gradients merged so far: not a model, so every
worker takes its parameters from the servers once, at the start, when none has pushed
yet (``KVWorker.pull_start``). Each worker keeps the value it pulled last; after the
next pull, ``last - new`` is exactly the aggregated gradient the servers merged in
between. It becomes ``p.grad`` and the wrapped
optimizer steps as in one process. Which gradients are merged, and when a pull is
answered, is the servers' consistency model's business (BSP, ASP, SSP, LSP, ALSP,
hybrid): nothing here changes with it. docs/torch.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from rdmamw.errors import RdmamwError
from rdmamw.ps.worker import KVWorker

#: parameter dtypes the servers hold: their copy is a running sum of gradients, which
#: float16 would round away (and numpy has no bfloat16); keep float32 master weights
DTYPES = (torch.float32, torch.float64)


class DistributedOptimizerError(RdmamwError, ValueError):
    """A parameter the servers cannot hold (not on the CPU, sparse, an unsupported
    dtype) or that ``named_parameters`` does not name; raised before anything is sent."""


class DistributedOptimizer:
    """Wrap ``optimizer`` (any ``torch.optim.Optimizer``) over the servers ``node``
    talks to. Keys are the names in ``named_parameters`` (pass
    ``model.named_parameters()``; every parameter of the optimizer must be there), else
    ``"param.<group>.<index>"``.

    Construction declares every parameter on the servers with this worker's values,
    then waits until every worker has done so (``KVWorker.pull_start``) and copies in
    worker 0's values: all start from one model (a broadcast through the servers;
    seeds need not agree) and nothing is merged before each holds it. Then each
    gradient is pushed (``KVWorker.push_part``) as soon as backward has accumulated it,
    and :meth:`step` ends the iteration, pulls, sets every ``p.grad`` to the
    aggregated gradient and steps the wrapped optimizer. One ``backward()`` per
    ``step()``: the pushed gradients must not change before it."""

    def __init__(self, optimizer: torch.optim.Optimizer, node: KVWorker, *,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        self.optimizer, self.node = optimizer, node
        self.params, self.keys = self._index(optimizer, named_parameters)
        with torch.no_grad():
            values = [p.detach().numpy() for p in self.params]
            node.init(self.keys, values)
            self._last = node.pull_start(self.keys)     # worker 0's, once all are here
            for p, v in zip(self.params, self._last, strict=True):
                p.copy_(torch.from_numpy(v))
        self._new = [np.empty_like(v) for v in self._last]
        self._key_of = {id(p): k for p, k in zip(self.params, self.keys, strict=True)}
        self._sent: list[np.ndarray] = []           # in flight until step()
        self._hooks = [p.register_post_accumulate_grad_hook(self._push)
                       for p in self.params if p.requires_grad]

    @staticmethod
    def _index(optimizer: torch.optim.Optimizer,
               named: Iterable[tuple[str, torch.Tensor]] | None
               ) -> tuple[list[torch.Tensor], list[str]]:
        names = None if named is None else {id(p): n for n, p in named}
        params, keys, seen = [], [], set()
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                where = f"parameter {i} of param group {g} ({tuple(p.shape)})"
                if names is not None and id(p) not in names:
                    raise DistributedOptimizerError(
                        f"{where} is not in named_parameters: pass the named_parameters() "
                        "of the model whose parameters the optimizer holds")
                if p.device.type != "cpu" or p.layout != torch.strided or \
                        p.dtype not in DTYPES or not p.is_contiguous():
                    raise DistributedOptimizerError(
                        f"{where}: the servers hold dense contiguous CPU tensors of "
                        f"float32 or float64 (keep float32 master weights for 16-bit "
                        f"training), not {p.dtype} {p.layout} on {p.device}")
                params.append(p)
                keys.append(f"param.{g}.{i}" if names is None else names[id(p)])
        if len(set(keys)) != len(keys):
            raise DistributedOptimizerError("named_parameters gives two parameters one name")
        return params, keys

    def _push(self, p: torch.Tensor) -> None:
        """Backward has accumulated ``p.grad``: send it now, while backward goes on."""
        g = p.grad.detach()
        if g.layout != torch.strided:
            raise DistributedOptimizerError(f"{self._key_of[id(p)]}: sparse gradients are "
                                            "not supported")
        arr = g.contiguous().numpy()
        self._sent.append(arr)
        self.node.push_part([self._key_of[id(p)]], [arr])

    def step(self, closure: Callable[[], float] | None = None,
             samples: int | None = None) -> float | None:
        """End the iteration (the clock to the servers), pull, set each ``p.grad`` to
        the gradient merged since the last pull and step the wrapped optimizer.
        ``samples``: this worker's batch size, which the round models weight its
        gradient by (needed with unequal shares, ``sched="dsana"``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.node.push_end(samples)
        self._sent.clear()
        self.node.pull(self.keys, out=self._new)
        with torch.no_grad():
            for p, last, new in zip(self.params, self._last, self._new, strict=True):
                np.subtract(last, new, out=last)
                if p.grad is None or p.grad.shape != p.shape:
                    p.grad = torch.from_numpy(last.copy())
                else:
                    p.grad.copy_(torch.from_numpy(last))
            self._last, self._new = self._new, self._last
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def close(self) -> None:
        """Remove the gradient hooks (the node stays open: ``node.close()`` ends it)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
