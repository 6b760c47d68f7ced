"""Channels and listeners for asyncio: the event loop watches each channel's
``fileno()``; no thread per channel.

Every wait is check, arm, check (``Channel.arm`` in rdmamw/engine/_engine.pyx): a
receive looks for messages, arms the descriptor (the peer is asked to wake this side)
and looks again before it awaits readiness, so a message that lands while it arms is
never missed; a spurious wake-up costs one look. A receive takes messages only after
its last ``await``, so cancelling it (``asyncio.timeout``, ``task.cancel()``) loses
nothing and leaves the channel usable. Set-up (``Channel.open``) runs the blocking
handshake in the loop's default executor; ``accept`` waits for the listener's
notification."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from functools import partial
from typing import Any, TypeVar

import numpy as np

from rdmamw import channel as _sync
from rdmamw import config
from rdmamw.aio.remote import AioRemoteMemory
from rdmamw.engine import Message, SendHandle
from rdmamw.errors import BufferTooSmall, ChannelClosed, Timeout, WrongLoop

_T = TypeVar("_T")

#: channels waiting on each loop's descriptors now (a one-item list a bound channel
#: holds): a receive spins (RDMAMW_AIO_SPIN_US) only when it is the loop's only waiter,
#: so a loop serving many channels never spins
_waiting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[int]] = \
    weakref.WeakKeyDictionary()
_running = asyncio.get_running_loop


def _rest(data: Any, sizes: Any, size: int | None, sent: int) -> tuple[Any, Any]:
    """What a send_many that sent ``sent`` messages has left: (data, sizes) after them."""
    if size is not None:
        return memoryview(data).cast("B")[sent * size:], None
    lens = np.asarray(sizes)
    return memoryview(data).cast("B")[int(lens[:sent].sum()):], lens[sent:]


class Channel(AioRemoteMemory):
    """An rdmamw channel whose waits are awaited: ``await ch.send_batch(...)``,
    ``await ch.recv_batch()``, ``async for m in ch``, ``async with ch``; remote memory
    (``expose``, ``await ch.read(...)``, ...: rdmamw/aio/remote.py).

    It wraps a blocking :class:`rdmamw.Channel` (``.sync``), bound to the event loop
    that first awaits it; awaiting it from another loop while that one is open raises
    :class:`WrongLoop`."""

    def __init__(self, channel: _sync.Channel) -> None:
        #: the blocking channel underneath (stats, diagnostics, attributes)
        self.sync = channel
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._watching = False
        self._waiters: set[asyncio.Future[None]] = set()
        self._kept: deque[Message] = deque()   # taken by iteration, not yet handed out
        self._spin_us: float = config.get("RDMAMW_AIO_SPIN_US")
        self._busy = [0]                       # the bound loop's count in _waiting

    @classmethod
    async def open(cls, peer: str | int, **options: Any) -> Channel:
        """:meth:`rdmamw.Channel.open` (same arguments), its handshake run in the
        loop's default executor."""
        loop = asyncio.get_running_loop()
        return cls(await loop.run_in_executor(None, partial(_sync.Channel.open, peer,
                                                            **options)))

    # ---- the descriptor ----------------------------------------------------------------
    def _bind(self) -> None:
        """Bind to the running loop (the hot paths call this only when it is not the
        one bound already)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise WrongLoop(f"channel to {self.peer} is used by another event loop; open "
                            f"a channel per loop (or close that loop first)")
        self._fd = self.sync.fileno()        # ChannelClosed after close()
        self._loop, self._watching = loop, False
        self._busy = _waiting.setdefault(loop, [0])
        self._waiters.clear()

    def _readable(self) -> None:
        # wake every waiter; they look and arm again (the reader is re-added then), so
        # a descriptor that stays readable (the peer hung up) cannot spin the loop
        self._unwatch()
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            assert self._loop is not None
            self._loop.remove_reader(self._fd)

    async def _readiness(self) -> None:
        """Await the descriptor once (the caller armed it)."""
        loop = self._loop
        assert loop is not None
        fut = loop.create_future()
        if not self._watching:
            loop.add_reader(self._fd, self._readable)
            self._watching = True
        self._waiters.add(fut)
        interval = self.sync.poll_interval
        timer = loop.call_later(interval, _wake, fut) if interval else None
        busy = self._busy
        busy[0] += 1
        try:
            await fut
        finally:
            busy[0] -= 1
            self._waiters.discard(fut)
            if timer is not None:
                timer.cancel()
            if not self._waiters:
                self._unwatch()
                self.sync.disarm()

    # ---- receiving -----------------------------------------------------------------------
    async def _receive(self, take: Callable[..., _T], *args: Any) -> _T:
        """``take(*args, timeout=0)`` (a receive of the blocking channel) once there
        is something to take: check, arm, check, then await the descriptor. A receive
        spins RDMAMW_AIO_SPIN_US first when it is its loop's only waiter."""
        ch = self.sync
        while True:
            if ch.arm(False, None, 0.0 if self._busy[0] else self._spin_us):
                try:
                    return take(*args, timeout=0)
                except Timeout:     # a rendezvous READ in flight: look again soon
                    await asyncio.sleep(0)
                    continue
            await self._readiness()

    async def recv_batch(self, max_messages: int | None = None) -> list[Message]:
        """The messages that have arrived (at least one, as
        :meth:`rdmamw.Channel.recv_batch`), awaiting the first. ChannelClosed / PeerLost
        once the peer is gone and everything it sent was received."""
        if _running() is not self._loop:
            self._bind()
        if self._kept:
            n = len(self._kept) if max_messages is None else min(max_messages, len(self._kept))
            return [self._kept.popleft() for _ in range(n)]
        ch = self.sync
        if ch.arm(False, None, 0.0 if self._busy[0] else self._spin_us):
            try:                    # the common case: no trip through the loop
                return ch.recv_batch(max_messages, timeout=0)
            except Timeout:
                pass
        return await self._receive(ch.recv_batch, max_messages)

    async def recv(self) -> Message:
        """One message (see :meth:`recv_batch`)."""
        if _running() is not self._loop:
            self._bind()
        if self._kept:
            return self._kept.popleft()
        ch = self.sync
        if ch.arm(False, None, 0.0 if self._busy[0] else self._spin_us):
            try:
                return ch.recv(timeout=0)
            except Timeout:
                pass
        return await self._receive(ch.recv)

    async def recv_into(self, buffer: Any) -> int:
        """The next message copied (or READ) into ``buffer``; its length
        (:meth:`rdmamw.Channel.recv_into`; BufferTooSmall leaves it receivable)."""
        if _running() is not self._loop:
            self._bind()
        if self._kept:
            m = self._kept.popleft()
            n = len(m)
            if n > memoryview(buffer).nbytes:
                self._kept.appendleft(m)
                raise BufferTooSmall(f"the next message is {n} bytes", needed=n)
            memoryview(buffer).cast("B")[:n] = memoryview(m).cast("B")
            m.release()
            return n
        return await self._receive(self.sync.recv_into, buffer)

    async def recv_many_into(self, buffer: Any, lengths: Any) -> int:
        """The messages that have arrived copied into ``buffer``, back to back, their
        lengths into ``lengths``; how many, awaiting the first
        (:meth:`rdmamw.Channel.recv_many_into`). Messages an ``async for`` kept come
        one per call."""
        if _running() is not self._loop:
            self._bind()
        if self._kept:
            n = await self.recv_into(buffer)
            lengths[0] = n
            return 1
        return await self._receive(self.sync.recv_many_into, buffer, lengths)

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        """Every incoming message until the peer closes the channel cleanly. A batch
        is kept on the channel while its messages are handed out one by one, so
        leaving the loop early loses none (the next receive returns them first)."""
        while True:
            if not self._kept:
                try:
                    self._kept.extend(await self.recv_batch())
                except ChannelClosed:
                    return
            yield self._kept.popleft()

    # ---- sending ---------------------------------------------------------------------
    async def send_batch(self, msgs: Iterable[Any]) -> SendHandle:
        """Send ``msgs`` in order (as :meth:`rdmamw.Channel.send_batch`), awaiting free
        slots while the peer's ring is full; returns once the handle is done (the
        buffers may be reused). Cancelled while waiting for slots, the messages before
        the cancellation were sent and the rest were not."""
        h, rest = self._send_now(msgs)
        if h is None:
            h = await self._post(rest)
        if not h.done():
            await self._until_done(h)
        return h

    async def send(self, msg: Any) -> SendHandle:
        """Send one message (see :meth:`send_batch`)."""
        if _running() is not self._loop:
            self._bind()
        try:
            h = self.sync.send_batch((msg,), timeout=0)
        except Timeout:
            h = await self._post((msg,))
        if not h.done():
            await self._until_done(h)
        return h

    async def send_many(self, data: Any, sizes: Any = None, *,
                        size: int | None = None) -> SendHandle:
        """Send ``data`` cut into messages by ``sizes`` (or all of ``size`` bytes), as
        :meth:`rdmamw.Channel.send_many`, awaiting free slots while the peer's ring is
        full; returns once the handle is done. Cancelled while waiting for slots, the
        messages before the cancellation were sent and the rest were not."""
        if _running() is not self._loop:
            self._bind()
        ch = self.sync
        while True:
            try:
                h = ch.send_many(data, sizes, size=size, timeout=0)
                break
            except Timeout as e:
                data, sizes = _rest(data, sizes, size, e.sent)
            if not ch.arm(True):
                await self._credit_wait()
        if not h.done():
            await self._until_done(h)
        return h

    async def post_batch(self, msgs: Iterable[Any]) -> SendHandle:
        """:meth:`send_batch` without awaiting the handle: returns once every message
        has a slot (a rendezvous message is done only when the peer has READ it; await
        :meth:`wait_handle` before reusing its buffer)."""
        h, rest = self._send_now(msgs)
        return h if h is not None else await self._post(rest)

    def _send_now(self, msgs: Iterable[Any]) -> tuple[SendHandle | None, tuple[Any, ...]]:
        """Send what fits now: (its handle, ()) or (None, the messages that did not fit)."""
        if _running() is not self._loop:
            self._bind()
        if isinstance(msgs, (bytes, bytearray, memoryview, str)):
            raise TypeError("send_batch takes an iterable of messages; use send() for one")
        batch = msgs if type(msgs) is tuple else tuple(msgs)
        try:
            return self.sync.send_batch(batch, timeout=0), ()
        except Timeout as e:
            return None, batch[e.sent:]

    async def _post(self, batch: tuple[Any, ...]) -> SendHandle:
        """Send what did not fit (``batch``) as slots free up; the last handle (a
        channel's sends complete in order, so it covers the earlier ones)."""
        ch = self.sync
        while True:
            if not ch.arm(True):
                await self._credit_wait()
            try:
                return ch.send_batch(batch, timeout=0)
            except Timeout as e:
                batch = batch[e.sent:]

    async def wait_handle(self, h: SendHandle) -> None:
        """Await a handle of this channel's sends until it is done."""
        if _running() is not self._loop:
            self._bind()
        if not h.done():
            await self._until_done(h)

    async def _until_done(self, h: SendHandle) -> None:
        ch = self.sync
        while not h.done():
            if ch.arm(True, h):
                # ready: done, or the peer lost or this side closed (the wait raises
                # that: done() alone stays False, and the loop spun forever), or a
                # completion the NIC reports without an event (verbs: poll again)
                try:
                    h.wait(0)
                    return
                except Timeout:
                    await asyncio.sleep(0)
            else:
                await self._credit_wait()

    async def _credit_wait(self) -> None:
        """A sender awaits the descriptor (armed for slots or done bits); its time
        counts in the channel's ``credit_wait_seconds``, as a blocking send's does."""
        t0 = time.perf_counter()
        try:
            await self._readiness()
        finally:
            self.sync._credit_waited(time.perf_counter() - t0)

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Close the channel; receives awaiting it raise ChannelClosed. Never blocks
        the loop: while the peer has not yet read a large message of ours, the close's
        bounded wait for that READ (docs/protocol.md, "Closing") runs on a thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:        # closed from plain code (no loop running)
                running = None
            if running is not None and running is not loop:
                raise WrongLoop(f"channel to {self.peer} belongs to another event loop")
            self._unwatch()
        if self.sync.rndv_pending and not self.sync.closed:
            threading.Thread(target=self.sync.close, name="rdmamw-aio-close",
                             daemon=True).start()
            until = time.monotonic() + 1.0      # its first step (no call goes on) is at
            while not self.sync.closed and time.monotonic() < until:    # once
                time.sleep(0.0002)
        else:
            self.sync.close()
        for m in self._kept:
            m.release()
        self._kept.clear()
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    @property
    def closed(self) -> bool:
        return self.sync.closed

    @property
    def peer(self) -> str:
        return getattr(self.sync, "peer", "?")

    def fileno(self) -> int:
        return self.sync.fileno()

    def stats(self) -> dict[str, Any]:
        return self.sync.stats()

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<aio.Channel {self.peer} {'closed' if self.closed else 'open'}>"


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    try:
        loop.call_soon_threadsafe(_wake, fut)
    except RuntimeError:        # the loop is closed
        pass


class Listener:
    """Accepts :class:`Channel` s on an event loop (see :func:`listen`)."""

    def __init__(self, listener: _sync.Listener) -> None:
        self.sync = listener
        self.address: str = listener.address

    async def accept(self) -> Channel:
        """The next peer whose handshake finished (the listener's threads run the
        handshakes); use ``asyncio.timeout`` for a deadline."""
        loop = asyncio.get_running_loop()
        while True:
            fut: asyncio.Future[None] = loop.create_future()
            unwatch = self.sync.watch(partial(_wake_threadsafe, loop, fut))
            try:
                try:
                    return Channel(self.sync.accept(timeout=0))
                except Timeout:
                    pass
                await fut
            finally:
                unwatch()

    def close(self) -> None:
        self.sync.close()

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<aio.Listener {self.address}>"


async def listen(address: str, **ring: Any) -> Listener:
    """:func:`rdmamw.listen` (same arguments) for an event loop."""
    return Listener(_sync.listen(address, **ring))


async def open_channel(address: str | int, timeout: float | None = None,
                       **options: Any) -> Channel:
    """:meth:`rdmamw.Channel.open` (same arguments) in the loop's default executor,
    safe to cancel: a channel whose handshake ends after the caller gave up (its task
    cancelled, a ``wait_for`` passed) is closed, not leaked, since the executor's
    thread cannot be stopped half-way. ``timeout``: the open's own (None: its default)."""
    loop = asyncio.get_running_loop()
    if timeout is not None:
        options["timeout"] = timeout
    fut = loop.run_in_executor(None, partial(_sync.Channel.open, address, **options))
    try:
        return Channel(await asyncio.shield(fut))
    except asyncio.CancelledError:
        fut.add_done_callback(_close_late)
        raise


def _close_late(fut: asyncio.Future[Any]) -> None:
    """Close the channel an abandoned :func:`open_channel` got in the end."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()
