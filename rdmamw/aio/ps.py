"""The parameter-server worker awaited: ``await worker.push_pull(keys, values)``.

:class:`KVWorker` runs the operations of :class:`rdmamw.ps.KVWorker` (``.sync``: the
same request encoding, reply decoding, metrics and model versions) and awaits their
waits on :class:`rdmamw.aio.Channel` wrappers of its channels: sending a batch awaits
free slots and its handle; a reply is awaited on every server at once (one server's
big reply never waits behind another's). The consistency model's waits (a BSP round,
an SSP staleness bound) are the servers holding a pull's reply back, so they are
awaits too: the loop runs other work, other workers included, meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from rdmamw.aio.channel import Channel
from rdmamw.bootstrap import ranklist
from rdmamw.errors import Timeout
from rdmamw.ps import worker as _sync
from rdmamw.steps import Driving, Steps

__all__ = ["KVWorker"]


class KVWorker:
    """One worker's view of the servers, awaited (the arguments of
    :class:`rdmamw.ps.KVWorker`; ``timeout`` bounds each reply). Requests on one worker
    run one at a time, in call order."""

    def __init__(self, channels: Sequence[Any], *, timeout: float | None = None,
                 chunk: int | None = None) -> None:
        chans = [c.sync if isinstance(c, Channel) else c for c in channels]
        #: the blocking worker whose operations this one awaits (metrics, shapes, clock)
        self.sync = _sync.KVWorker(chans, timeout=timeout, chunk=chunk)
        self.chans = [Channel(c) for c in chans]
        self._lock = asyncio.Lock()

    # -- the requests ---------------------------------------------------------------

    async def init(self, keys: Sequence[Hashable], values: Sequence[np.ndarray]) -> None:
        """:meth:`rdmamw.ps.KVWorker.init`, awaited."""
        await self.run(self.sync.init_steps(keys, values))

    async def pull_start(self, keys: Sequence[Hashable],
                         out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """:meth:`rdmamw.ps.KVWorker.pull_start` (a start barrier), awaited."""
        return await self.run(self.sync.pull_steps(keys, out, start=True))

    async def pull(self, keys: Sequence[Hashable],
                   out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """:meth:`rdmamw.ps.KVWorker.pull`, awaited (as long as the consistency model
        holds the read back)."""
        return await self.run(self.sync.pull_steps(keys, out))

    async def push(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
                   samples: int | None = None) -> None:
        """:meth:`rdmamw.ps.KVWorker.push`, awaited (until the arrays may be reused)."""
        await self.run(self.sync.push_steps(keys, values, samples))

    async def push_pull(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
                        out: Sequence[np.ndarray] | None = None,
                        samples: int | None = None) -> list[np.ndarray]:
        """:meth:`rdmamw.ps.KVWorker.push_pull`, awaited."""
        return await self.run(self.sync.push_pull_steps(keys, values, out, samples))

    async def done(self) -> None:
        """:meth:`rdmamw.ps.KVWorker.done`, awaited."""
        await self.run(self.sync.done_steps())

    async def close(self) -> None:
        """:meth:`done`, then close the channels."""
        await self.done()
        for ch in self.chans:
            ch.close()

    @property
    def metrics(self) -> Any:
        return self.sync.metrics

    # -- the driver -----------------------------------------------------------------

    async def run(self, steps: Steps) -> Any:
        """Await an operation of the blocking worker (``rdmamw.ps.worker.SEND`` /
        ``REPLIES`` steps); its result."""
        async with self._lock:
            run = Driving(steps)
            for step in run:
                try:
                    if step[0] == _sync.SEND:
                        await self._send(step[1])
                    else:
                        run.value = await self._replies(step[1], step[2])
                except BaseException as e:  # noqa: BLE001 - handed to the operation
                    run.exc = e
            return run.result

    async def _send(self, per: dict[int, list[Any]]) -> None:
        handles = [(s, await self.chans[s].post_batch(msgs)) for s, msgs in per.items()
                   if msgs]
        for s, h in handles:
            await self.chans[s].wait_handle(h)

    async def _replies(self, rids: dict[int, int],
                       dest: dict[Any, Any] | None) -> dict[int, dict[Any, Any]]:
        """:meth:`rdmamw.ps.KVWorker.receive_pull`, every server awaited at once."""
        hdr: dict[int, dict[Any, Any] | None] = dict.fromkeys(rids)
        done: set[int] = set()

        async def reply(s: int) -> dict[Any, Any]:
            while True:
                msgs = await self.chans[s].recv_batch()
                end = self.sync.take_batch(s, msgs, hdr, dest, rids[s])
                if end is not None:
                    done.add(s)
                    return end

        timeout = self.sync.timeout
        try:
            async with asyncio.timeout(timeout):
                if len(rids) == 1:
                    (s,) = rids
                    return {s: await reply(s)}
                tasks = {s: asyncio.ensure_future(reply(s)) for s in rids}
                try:
                    await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
                finally:            # a failure, or our own cancellation: stop the others
                    for t in tasks.values():
                        t.cancel()
                    await asyncio.gather(*tasks.values(), return_exceptions=True)
                for t in tasks.values():
                    if not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                return {s: t.result() for s, t in tasks.items()}
        except TimeoutError:
            raise Timeout(f"no reply from servers {ranklist.compact(set(rids) - done)} "
                          f"within {timeout:g} s") from None
