"""Awaitable collectives: ``await allreduce(array, comm=comm)`` on an event loop.

Each runs the plan of the blocking call (rdmamw.collectives: the same argument
checks, algorithm choice and schedule); the schedule yields its channel operations
(rdmamw/collectives/comm.py, ``SEND``...) and this driver awaits them on
:class:`rdmamw.aio.Channel` wrappers of the communicator's channels, so the loop runs
other work while a step waits. Results equal the blocking calls' bit for bit.

Cancellation (``task.cancel()``, ``asyncio.timeout``) takes effect at the await of the
step in flight: the ranks would disagree about the step if a collective stopped
midway and went on later, so the communicator is then broken and closed (as after a
lost peer), and the other ranks' calls raise PeerLost instead of hanging. Collectives
on one communicator run one at a time, in call order, on one loop."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np

from rdmamw import observe
from rdmamw.aio.channel import Channel
from rdmamw.collectives import algorithms, api, rooted
from rdmamw.collectives.alltoall import plan_alltoall
from rdmamw.collectives.comm import INTO, RECV, SEND, Communicator
from rdmamw.collectives.waits import WATCH
from rdmamw.errors import RdmamwError, Timeout
from rdmamw.steps import Driving, Steps

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "broadcast", "gather",
           "reduce", "reduce_scatter", "run", "scatter"]


class _Awaiting:
    """A communicator's state on the loop: the call-order lock and the aio wrappers
    of its channels."""

    __slots__ = ("lock", "chans")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.chans: dict[int, Channel] = {}

    def channel(self, comm: Communicator, peer: int) -> Channel:
        sync = comm.channel(peer)
        ch = self.chans.get(peer)
        if ch is None or ch.sync is not sync:
            ch = self.chans[peer] = Channel(sync)
        return ch


_state: weakref.WeakKeyDictionary[Communicator, _Awaiting] = weakref.WeakKeyDictionary()


async def run(plan: api.Plan, timeout: float | None = None) -> Any:
    """Await one planned collective (``api.plan_*``): what the blocking call returns."""
    comm = plan.comm
    st = _state.get(comm)
    if st is None:
        st = _state[comm] = _Awaiting()
    watch = observe.collective          # None unless rdmamw.metrics records
    t0 = time.perf_counter() if watch is not None else 0.0
    tr = observe.tracer                 # None unless rdmamw.trace records
    async with st.lock:
        with comm.exclusive(), comm.guard(plan.header):
            t1 = tr.clock() if tr is not None else 0
            comm.begin(timeout)
            missing = comm.missing(plan.peers)
            if missing:         # set-up only: the blocking handshakes off the loop
                await asyncio.get_running_loop().run_in_executor(None, comm.ensure,
                                                                 missing)
            comm.blocking = False
            try:
                return await _drive(comm, st, comm.steps(plan.header, plan.body))
            finally:
                comm.blocking = True
                comm.deadline = 0.0
                if watch is not None:
                    watch(plan.header[0], time.perf_counter() - t0)
                if tr is not None:
                    tr.collective(plan.header, comm.seq,
                                  [comm.members[p] for p in plan.peers], t1)


async def _drive(comm: Communicator, st: _Awaiting, steps: Steps) -> Any:
    """:meth:`Communicator.drive`, each step awaited by the collective's deadline; a
    failure named as the blocking calls name it (:meth:`Communicator.failure`, off the
    loop: it may wait for a revoke notice)."""
    run = Driving(steps)
    for kind, peer, arg in run:
        try:
            ch = st.channel(comm, peer)
            try:
                async with asyncio.timeout(comm.left()):
                    run.value = await _watched(comm, peer, _step(ch, kind, arg))
            except Timeout:     # (a TimeoutError too: one a notice named, kept as it is)
                raise
            except TimeoutError:
                raise Timeout(f"rank {peer}: no progress by the deadline") from None
        except RdmamwError as e:
            run.exc = await asyncio.get_running_loop().run_in_executor(
                None, comm.failure, e, peer)
        except BaseException as e:  # noqa: BLE001 - handed to the schedule
            run.exc = e
    return run.result


async def _watched(comm: Communicator, peer: int, step: Awaitable[Any]) -> Any:
    """``step`` (a wait on ``peer``), while every WATCH s the communicator's other
    channels are looked at (rdmamw.collectives.waits): a notice found there ends the
    wait with the error it means (as the blocking wait does)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    found: list[BaseException] = []
    timer: asyncio.TimerHandle | None = None

    def look() -> None:
        nonlocal timer
        try:
            comm.waits.watch(peer)
        except RdmamwError as e:
            found.append(e)
            if task is not None:
                task.cancel()
            return
        timer = loop.call_later(WATCH, look)

    timer = loop.call_later(WATCH, look)
    try:
        return await step
    except asyncio.CancelledError:
        if not found or task is None:
            raise
        task.uncancel()
        raise found[0] from None
    finally:
        if timer is not None:
            timer.cancel()


async def _step(ch: Channel, kind: int, arg: Any) -> Any:
    if kind == SEND:
        return await ch.post_batch(arg)
    if kind == RECV:
        return await ch.recv_batch(1)
    if kind == INTO:
        return await ch.recv_into(arg)
    return await ch.wait_handle(arg)


async def _groups(comm: Communicator, algorithm: str) -> list[int] | None:
    """api.groups for the algorithms that need it; resolved off the loop the first
    time (a "probe" topology measures the links with blocking calls)."""
    if not algorithms.needs_groups(algorithm):
        return None
    if comm.group_ids is not None:
        return comm.group_ids
    return await asyncio.get_running_loop().run_in_executor(None, api.groups, comm)


async def allreduce(array: np.ndarray, op: str = "sum", algorithm: str = "auto",
                    out: np.ndarray | None = None, *,
                    comm: Communicator | None = None, timeout: float | None = None) -> np.ndarray:
    """:func:`rdmamw.collectives.allreduce`, awaited."""
    comm = comm or api.default_comm()
    ids = await _groups(comm, algorithm)
    return await run(api.plan_allreduce(comm, array, op, algorithm, out, ids), timeout)


async def broadcast(array: np.ndarray, root: int = 0, *,
                    comm: Communicator | None = None, timeout: float | None = None) -> np.ndarray:
    """:func:`rdmamw.collectives.broadcast`, awaited."""
    return await run(api.plan_broadcast(comm or api.default_comm(), array, root), timeout)


async def reduce_scatter(array: np.ndarray, op: str = "sum", out: np.ndarray | None = None,
                         *, comm: Communicator | None = None,
                         timeout: float | None = None) -> np.ndarray:
    """:func:`rdmamw.collectives.reduce_scatter`, awaited."""
    return await run(api.plan_reduce_scatter(comm or api.default_comm(), array, op, out), timeout)


async def allgather(array: np.ndarray, out: np.ndarray | None = None, *,
                    comm: Communicator | None = None, timeout: float | None = None) -> np.ndarray:
    """:func:`rdmamw.collectives.allgather`, awaited."""
    return await run(api.plan_allgather(comm or api.default_comm(), array, out), timeout)


async def barrier(*, comm: Communicator | None = None, timeout: float | None = None) -> None:
    """:func:`rdmamw.collectives.barrier`, awaited."""
    return await run(api.plan_barrier(comm or api.default_comm()), timeout)


async def gather(array: np.ndarray, root: int = 0, out: np.ndarray | None = None, *,
                 comm: Communicator | None = None,
                 timeout: float | None = None) -> np.ndarray | None:
    """:func:`rdmamw.collectives.gather`, awaited."""
    return await run(rooted.plan_gather(comm or api.default_comm(), array, root, out), timeout)


async def scatter(array: np.ndarray | None, root: int = 0, out: np.ndarray | None = None, *,
                  comm: Communicator | None = None, timeout: float | None = None) -> np.ndarray:
    """:func:`rdmamw.collectives.scatter`, awaited."""
    return await run(rooted.plan_scatter(comm or api.default_comm(), array, root, out), timeout)


async def reduce(array: np.ndarray, op: str = "sum", root: int = 0,
                 out: np.ndarray | None = None, *,
                 comm: Communicator | None = None,
                 timeout: float | None = None) -> np.ndarray | None:
    """:func:`rdmamw.collectives.reduce`, awaited."""
    return await run(rooted.plan_reduce(comm or api.default_comm(), array, op, root, out), timeout)


async def alltoall(array: np.ndarray, send_counts: Sequence[int] | None = None,
                   recv_counts: Sequence[int] | None = None, out: np.ndarray | None = None,
                   *, comm: Communicator | None = None, timeout: float | None = None) -> np.ndarray:
    """:func:`rdmamw.collectives.alltoall`, awaited."""
    return await run(plan_alltoall(comm or api.default_comm(), array, send_counts,
                                   recv_counts, out), timeout)
