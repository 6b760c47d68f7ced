"""Remote memory awaited (docs/remote-memory.md, "From an event loop"): ``await
ch.read(...)`` / ``write`` / ``readv`` / ``writev`` / ``gather`` / ``scatter`` /
``batch().post()`` (its atomics' old values in the handle's ``values``) /
``fetch_add`` / ``compare_swap`` on an :class:`rdmamw.aio.Channel`, with the blocking
channel's arguments and errors.

A provider that moves the bytes inside the call (shm: a copy, the owner never waited
for) runs it on the loop, as a send that fits runs. One whose operations wait for the
owner's answer (tcp: its RDONE) runs the call on the loop's default executor, so the
loop goes on meanwhile. Cancelled while it runs, the await still ends only once the
call has (within its ``timeout``): a read's destination is never written after the
await is over, whichever way it ends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from rdmamw.channel.remote import Batch, Done, Fetched, Posted, Region

if TYPE_CHECKING:
    from rdmamw.channel import Channel as SyncChannel

_T = TypeVar("_T")


async def _run(sync: Any, call: Callable[[], _T]) -> _T:
    """``call()`` on the loop when the provider finishes inside it, else on the default
    executor; a cancellation waits for the call's end (its timeout bounds it)."""
    if not getattr(sync._transport, "async_read", True):
        return call()
    fut = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        try:
            await fut
        except BaseException:   # noqa: BLE001 - the call's own error: cancelled anyway
            pass
        raise


class AioBatch:
    """``ch.batch()`` of an aio channel: add with ``read`` / ``write`` / ``readv`` /
    ``writev`` / ``gather`` / ``scatter`` / ``fetch_add`` / ``compare_swap`` as on
    :class:`rdmamw.channel.remote.Batch`, then ``await post()``."""

    def __init__(self, sync: Any) -> None:
        self._sync = sync
        self._batch: Batch = sync.batch()

    def read(self, ref: Any, into: Any, offset: int = 0) -> AioBatch:
        self._batch.read(ref, into, offset)
        return self

    def write(self, src: Any, ref: Any, offset: int = 0, notify: Any = None) -> AioBatch:
        self._batch.write(src, ref, offset, notify)
        return self

    def readv(self, ranges: Iterable[tuple[Any, Any, int]]) -> AioBatch:
        self._batch.readv(ranges)
        return self

    def writev(self, ranges: Iterable[tuple[Any, Any, int]]) -> AioBatch:
        self._batch.writev(ranges)
        return self

    def gather(self, into: Any, ref: Any, offsets: Any, size: Any = None) -> AioBatch:
        self._batch.gather(into, ref, offsets, size)
        return self

    def scatter(self, src: Any, ref: Any, offsets: Any, size: Any = None,
                notify: Any = None) -> AioBatch:
        self._batch.scatter(src, ref, offsets, size, notify)
        return self

    def fetch_add(self, ref: Any, offset: int, value: int) -> AioBatch:
        self._batch.fetch_add(ref, offset, value)
        return self

    def compare_swap(self, ref: Any, offset: int, expected: int,
                     desired: int) -> AioBatch:
        self._batch.compare_swap(ref, offset, expected, desired)
        return self

    def __len__(self) -> int:
        return len(self._batch)

    async def post(self, timeout: float | None = None) -> Posted:
        """The batch as one chain (:meth:`rdmamw.channel.remote.Batch.post`), awaited."""
        return await _run(self._sync, lambda: self._batch.post(timeout))


class AioRemoteMemory:
    """The remote-memory methods of :class:`rdmamw.aio.Channel` (``.sync`` is the
    blocking channel underneath)."""

    sync: SyncChannel

    def expose(self, buffer: Any, access: str = "rw") -> Region:
        """:meth:`rdmamw.Channel.expose` (it never waits)."""
        return self.sync.expose(buffer, access)

    def batch(self) -> AioBatch:
        return AioBatch(self.sync)

    async def read(self, ref: Any, into: Any, offset: int = 0,
                   timeout: float | None = None) -> Done:
        """:meth:`rdmamw.Channel.read`, awaited."""
        return await _run(self.sync, lambda: self.sync.read(ref, into, offset, timeout))

    async def write(self, src: Any, ref: Any, offset: int = 0, notify: Any = None,
                    timeout: float | None = None) -> Done:
        """:meth:`rdmamw.Channel.write`, awaited."""
        return await _run(self.sync,
                          lambda: self.sync.write(src, ref, offset, notify, timeout))

    async def readv(self, ranges: Iterable[tuple[Any, Any, int]],
                    timeout: float | None = None) -> Posted:
        """:meth:`rdmamw.Channel.readv`, awaited."""
        return await self.batch().readv(ranges).post(timeout)

    async def writev(self, ranges: Iterable[tuple[Any, Any, int]],
                     timeout: float | None = None) -> Posted:
        """:meth:`rdmamw.Channel.writev`, awaited."""
        return await self.batch().writev(ranges).post(timeout)

    async def gather(self, into: Any, ref: Any, offsets: Any, size: Any = None,
                     timeout: float | None = None) -> Posted:
        """:meth:`rdmamw.Channel.gather`, awaited."""
        return await self.batch().gather(into, ref, offsets, size).post(timeout)

    async def scatter(self, src: Any, ref: Any, offsets: Any, size: Any = None,
                      notify: Any = None, timeout: float | None = None) -> Posted:
        """:meth:`rdmamw.Channel.scatter`, awaited."""
        return await self.batch().scatter(src, ref, offsets, size, notify).post(timeout)

    async def fetch_add(self, ref: Any, offset: int, value: int,
                        timeout: float | None = None) -> Fetched:
        """:meth:`rdmamw.Channel.fetch_add`, awaited."""
        return await _run(self.sync,
                          lambda: self.sync.fetch_add(ref, offset, value, timeout))

    async def compare_swap(self, ref: Any, offset: int, expected: int, desired: int,
                           timeout: float | None = None) -> Fetched:
        """:meth:`rdmamw.Channel.compare_swap`, awaited."""
        return await _run(self.sync, lambda: self.sync.compare_swap(
            ref, offset, expected, desired, timeout))
