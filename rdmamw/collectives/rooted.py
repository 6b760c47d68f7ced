"""Collectives with a root: gather, scatter and reduce.

gather and scatter are flat (the root trades with each rank in turn, rank order): each
byte crosses one link once, and the root's link is the bound either way. reduce is
the pipelined chain of tree.py (each rank adds its array to the partial result
passing through)."""

from __future__ import annotations

from typing import Any

import numpy as np

from rdmamw.collectives import results, tree
from rdmamw.collectives._kernels import Copier
from rdmamw.collectives.api import Plan, _input, _output, default_comm
from rdmamw.collectives.comm import Communicator, Steps
from rdmamw.collectives.ops import dtype_name, ufunc


def _check_root(comm: Communicator, root: int) -> None:
    if not 0 <= root < comm.size:
        raise ValueError(f"root {root} is not a rank of a world of {comm.size}")


def _flat_peers(comm: Communicator, root: int) -> list[int]:
    return [r for r in range(comm.size) if r != comm.rank] if comm.rank == root else [root]


def gather(array: np.ndarray, root: int = 0, out: np.ndarray | None = None, *,
           comm: Communicator | None = None, async_op: bool = False,
           timeout: float | None = None) -> Any:
    """Every rank's ``array`` stacked on ``root``: shape ``(size, *array.shape)``, row r
    from rank r (in ``out`` if given). Other ranks get None."""
    return plan_gather(comm or default_comm(), array, root, out).call(async_op, timeout)


def plan_gather(comm: Communicator, array: np.ndarray, root: int,
                out: np.ndarray | None) -> Plan:
    a = _input(array)
    _check_root(comm, root)
    n, N = comm.size, a.size
    src = np.ascontiguousarray(a).reshape(-1)
    res = _output(a, out, (n, *a.shape)) if comm.rank == root else None

    def body() -> Steps:
        if res is None:
            yield from comm.exchange_steps(root, src, None, 0, None, a.dtype)
            return None
        flat = res.reshape(-1)
        np.copyto(flat[root * N:(root + 1) * N], src)
        for r in range(n):
            if r != root:
                yield from comm.exchange_steps(None, None, r, N, Copier(flat, r * N),
                                               a.dtype)
        return res

    return Plan(comm, ["gather", dtype_name(a.dtype), list(a.shape), "", root, ""],
                     _flat_peers(comm, root), body)


def scatter(array: np.ndarray | None, root: int = 0, out: np.ndarray | None = None, *,
            comm: Communicator | None = None, async_op: bool = False,
            timeout: float | None = None) -> Any:
    """Row r of root's ``array`` (shape ``(size, *part)``) to rank r; returns this
    rank's row (in ``out`` if given). Ranks other than root pass ``array=None`` and an
    ``out`` of the part's shape and dtype (they have no array to take it from)."""
    return plan_scatter(comm or default_comm(), array, root, out).call(async_op, timeout)


def plan_scatter(comm: Communicator, array: np.ndarray | None, root: int,
                 out: np.ndarray | None) -> Plan:
    _check_root(comm, root)
    n = comm.size
    if comm.rank == root:
        a = _input(array)
        if a.ndim == 0 or a.shape[0] != n:
            raise ValueError(f"scatter's array needs one row per rank: shape ({n}, ...), "
                             f"not {a.shape}")
        part = a[0]
        res = _output(part, out, part.shape)
        src = np.ascontiguousarray(a).reshape(n, -1)
    else:
        if out is None:
            raise ValueError("scatter: ranks other than root must pass out= (the array "
                             "their part lands in)")
        part = _input(out)
        res = _output(part, out, part.shape)
        src = None
    N = part.size

    def body() -> Steps:
        flat = res.reshape(-1)
        if src is None:
            yield from comm.exchange_steps(None, None, root, N, Copier(flat, 0),
                                           part.dtype)
            return res
        for r in range(n):
            if r != root:
                yield from comm.exchange_steps(r, src[r], None, 0, None, part.dtype)
        np.copyto(flat, src[root])
        return res

    return Plan(comm, ["scatter", dtype_name(part.dtype), list(part.shape), "", root, ""],
                     _flat_peers(comm, root), body)


def reduce(array: np.ndarray, op: str = "sum", root: int = 0,
           out: np.ndarray | None = None, *, comm: Communicator | None = None,
           async_op: bool = False, timeout: float | None = None) -> Any:
    """Reduce ``array`` over all ranks with ``op`` into ``root`` (in ``out`` if given,
    ``out is array`` reduces in place); other ranks get None."""
    return plan_reduce(comm or default_comm(), array, op, root, out).call(async_op, timeout)


def plan_reduce(comm: Communicator, array: np.ndarray, op: str, root: int,
                out: np.ndarray | None) -> Plan:
    a = _input(array)
    uf = ufunc(op, a.dtype)
    _check_root(comm, root)
    members = list(range(comm.size))
    res = _output(a, out, a.shape) if comm.rank == root else None
    x = np.ascontiguousarray(a).reshape(-1)
    if res is not None and res is a:
        x = res.reshape(-1)

    def body() -> Steps:
        if res is not None:
            yield from tree.reduce(comm, x, res.reshape(-1), uf, root, members)
            return res
        yield from tree.reduce(comm, x, results.empty(x.shape, x.dtype), uf, root, members)
        return None

    n, v = comm.size, (comm.rank - root) % comm.size
    peers = [p for p in ((root + v - 1) % n if v else None,
                         (root + v + 1) % n if v + 1 < n else None) if p is not None]
    return Plan(comm, ["reduce", dtype_name(a.dtype), list(a.shape), op, root, ""], peers, body)
