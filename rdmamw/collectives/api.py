"""The public collectives: allreduce, broadcast, reduce_scatter, allgather, barrier
(alltoall, gather, scatter and reduce are in rooted.py).

Each takes an optional ``comm``; without it they use one default
:class:`Communicator` over the ranks of :func:`rdmamw.init` (called if needed). Each
takes ``timeout=`` (seconds; default the communicator's, RDMAMW_COLL_TIMEOUT): past it
every member raises Timeout naming the rank that made no progress (comm.py).
``async_op=True`` returns a progress.Handle instead of the result (progress.py).
Each is a ``plan_*`` (arguments checked, the schedule to run) and its run, so
rdmamw.aio.collectives awaits the same plans.
Results not given an ``out`` come from the results pool (results.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from rdmamw.collectives import algorithms, results, ring, topology, tree
from rdmamw.collectives._kernels import bounds
from rdmamw.collectives.comm import Communicator, Steps
from rdmamw.collectives.ops import check_dtype, dtype_name, ufunc

_default: Communicator | None = None
_default_lock = threading.Lock()


def default_comm() -> Communicator:
    """The communicator the functions use when no ``comm`` is given."""
    global _default
    with _default_lock:
        if _default is None or _default.broken is not None:
            _default = Communicator()
        return _default


def shrink(comm: Communicator | None = None, timeout: float | None = None) -> Communicator:
    """The survivors of ``comm`` (default: the default communicator, which the result
    then replaces) as a communicator of their own, after a rank failed; every survivor
    calls it (Communicator.shrink, docs/collectives.md "Errors")."""
    global _default
    if comm is not None:
        return comm.shrink(timeout)
    with _default_lock:
        old = _default
    if old is None:
        raise RuntimeError("no default communicator to shrink: no collective ran yet")
    new = old.shrink(timeout)
    with _default_lock:
        _default = new
    return new


def grow(comm: Communicator | None = None, ranks: list[int] | None = None,
         timeout: float | None = None) -> Communicator:
    """``comm`` (default: the default communicator, which the result then replaces,
    closed) with re-joined ranks back (default: every world rank not in it); every
    member calls it while the new processes call :func:`join` (Communicator.grow,
    docs/collectives.md "Errors")."""
    global _default
    if comm is not None:
        return comm.grow(ranks, timeout)
    with _default_lock:
        old = _default
    if old is None:
        raise RuntimeError("no default communicator to grow: no collective ran yet")
    new = old.grow(ranks, timeout)
    with _default_lock:
        _default = new
    old.close()
    return new


def join(timeout: float | None = None) -> Communicator:
    """On a process that re-joined a running job (``rdmamw.init()`` with a lost rank's
    launcher environment): the communicator the members' :func:`grow` makes, which
    becomes the default one."""
    global _default
    new = Communicator.join(timeout=timeout)
    with _default_lock:
        _default = new
    return new


def groups(comm: Communicator | None = None) -> list[int]:
    """Group id per rank of ``comm`` (ranks of a group share fast links: topology.py),
    resolved on first use, the same list on every rank."""
    comm = comm or default_comm()
    if comm.group_ids is None:
        comm.group_ids = topology.resolve(comm, comm.topology_spec, allgather)
    return comm.group_ids


def _input(array: np.ndarray) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy array, not {type(array).__name__}")
    check_dtype(array.dtype)
    return array


def _output(array: np.ndarray, out: np.ndarray | None, shape: tuple) -> np.ndarray:
    if out is None:
        return results.empty(shape, array.dtype)
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != array.dtype:
        raise ValueError(f"out must be a {array.dtype} array of shape {shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writeable")
    if out is not array and np.may_share_memory(out, array):
        raise ValueError("out overlaps the input without being it")
    return out


class Plan(NamedTuple):
    """One collective ready to run: checked arguments, the header every rank must
    agree on, the peers it needs and its body (a schedule, see comm.py). The blocking
    functions run it with :meth:`Communicator.call`, rdmamw.aio.collectives awaits it."""

    comm: Communicator
    header: list
    peers: list[int]
    body: Callable[[], Any]

    def call(self, async_op: bool, timeout: float | None = None) -> Any:
        return self.comm.call(self.header, self.peers, self.body, async_op, timeout)


def allreduce(array: np.ndarray, op: str = "sum", algorithm: str = "auto",
              out: np.ndarray | None = None, *, comm: Communicator | None = None,
              async_op: bool = False, timeout: float | None = None) -> Any:
    """Reduce ``array`` over all ranks with ``op`` (sum, prod, max, min; band, bor,
    bxor on integers) and return the result on every rank: in ``out`` if given (in
    place when ``out is array``), else in a new array.

    ``algorithm``: "auto" (the tuned cost model, see policy.py) or the name of a
    registered algorithm (rdmamw.collectives.algorithms: "ring", "rhd",
    "hierarchical" and any registered since). Every rank must call it with the same
    shape, dtype, op and algorithm; otherwise every rank raises :class:`CollectiveMismatch`."""
    comm = comm or default_comm()
    ids = groups(comm) if algorithms.needs_groups(algorithm) else None
    return plan_allreduce(comm, array, op, algorithm, out, ids).call(async_op, timeout)


def plan_allreduce(comm: Communicator, array: np.ndarray, op: str, algorithm: str,
                   out: np.ndarray | None, ids: list[int] | None) -> Plan:
    """``ids``: :func:`groups` (needed by "auto" and the algorithms that say so:
    ``algorithms.needs_groups``)."""
    a = _input(array)
    uf = ufunc(op, a.dtype)
    res = _output(a, out, a.shape)
    flat = res.reshape(-1)
    x = flat if res is a else np.ascontiguousarray(a).reshape(-1)
    members = list(range(comm.size))
    ids = [0] * comm.size if ids is None else ids
    alg = comm.choices.choose(x.nbytes, ids, comm.model, algorithm)
    run = algorithms.get(alg)
    peers = run.peers(comm, members, ids)

    def body() -> Steps:
        yield from run.run(comm, x, flat, uf, members, ids)
        return res
    return Plan(comm, ["allreduce", dtype_name(a.dtype), list(a.shape), op, -1, alg], peers, body)


def broadcast(array: np.ndarray, root: int = 0, *, comm: Communicator | None = None,
              async_op: bool = False, timeout: float | None = None) -> Any:
    """Overwrite ``array`` on every rank with ``root``'s (in place; returns it)."""
    return plan_broadcast(comm or default_comm(), array, root).call(async_op, timeout)


def plan_broadcast(comm: Communicator, array: np.ndarray, root: int) -> Plan:
    a = _input(array)
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError("broadcast needs a C-contiguous, writeable array")
    if not 0 <= root < comm.size:
        raise ValueError(f"root {root} is not a rank of a world of {comm.size}")
    members = list(range(comm.size))
    flat = a.reshape(-1)
    peers = tree.peers(members, root, comm.rank, flat.nbytes) if comm.size > 1 else []

    def body() -> Steps:
        yield from tree.broadcast(comm, flat, root, members)
        return a
    return Plan(comm, ["broadcast", dtype_name(a.dtype), list(a.shape), "", root, ""], peers, body)


def reduce_scatter(array: np.ndarray, op: str = "sum", out: np.ndarray | None = None, *,
                   comm: Communicator | None = None, async_op: bool = False,
                   timeout: float | None = None) -> Any:
    """Reduce ``array`` over all ranks and return this rank's part of the result.

    The flattened array is split into ``size`` contiguous parts, part ``i`` starting
    at element ``i * N // size``; with ``shape[0]`` divisible by ``size`` that is
    ``numpy.split(result, size)[rank]`` and keeps the trailing dimensions."""
    return plan_reduce_scatter(comm or default_comm(), array, op, out).call(async_op, timeout)


def plan_reduce_scatter(comm: Communicator, array: np.ndarray, op: str,
                        out: np.ndarray | None) -> Plan:
    a = _input(array)
    uf = ufunc(op, a.dtype)
    n, i = comm.size, comm.rank
    x = np.ascontiguousarray(a).reshape(-1)
    b = bounds(len(x), n)
    if a.ndim and a.shape[0] % n == 0:
        shape: tuple = (a.shape[0] // n, *a.shape[1:])
    else:
        shape = (b[i + 1] - b[i],)
    res = _output(a, out, shape)
    members = list(range(n))

    def body() -> Steps:
        if n > 1:
            scratch = results.empty(x.shape, x.dtype)
            yield from ring.reduce_scatter(comm, x, scratch, uf, members, shift=-1)
            np.copyto(res.reshape(-1), scratch[b[i]:b[i + 1]])
        else:
            np.copyto(res.reshape(-1), x)
        return res

    return Plan(comm, ["reduce_scatter", dtype_name(a.dtype), list(a.shape), op, -1, ""],
                ring.peers(comm, members), body)


def allgather(array: np.ndarray, out: np.ndarray | None = None, *,
              comm: Communicator | None = None, async_op: bool = False,
              timeout: float | None = None) -> Any:
    """Every rank's ``array`` stacked: shape ``(size, *array.shape)``, row r from rank r."""
    return plan_allgather(comm or default_comm(), array, out).call(async_op, timeout)


def plan_allgather(comm: Communicator, array: np.ndarray, out: np.ndarray | None) -> Plan:
    a = _input(array)
    n, i = comm.size, comm.rank
    res = _output(a, out, (n, *a.shape))
    flat = res.reshape(-1)
    N = a.size
    np.copyto(flat[i * N:(i + 1) * N], a.reshape(-1))
    members = list(range(n))
    bl = [k * N for k in range(n + 1)]

    def body() -> Steps:
        yield from ring.allgather(comm, flat, members, i, bl)
        return res
    return Plan(comm, ["allgather", dtype_name(a.dtype), list(a.shape), "", -1, ""],
                ring.peers(comm, members), body)


def barrier(*, comm: Communicator | None = None, async_op: bool = False,
timeout: float | None = None) -> Any:
    """Return once every rank has entered the barrier."""
    return plan_barrier(comm or default_comm()).call(async_op, timeout)


def plan_barrier(comm: Communicator) -> Plan:
    return Plan(comm, ["barrier", "-", [], "", -1, ""], [], lambda: None)
