"""Non-blocking collectives: ``async_op=True`` returns a :class:`Handle` at once and the
collective runs on its communicator's progress thread, so a training loop reduces one
layer's gradients while it computes the next.

One thread per communicator (started on the first asynchronous call), not one per
call: collectives on a communicator must run one at a time in call order anyway, so
a FIFO queue and a single thread keep that order for free. Its time goes to waits on
channels and numpy reductions, both of which release the GIL. A blocking call made
while asynchronous ones are still queued goes through the same queue (call order)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from rdmamw.errors import Timeout


class Handle:
    """The pending result of a non-blocking collective."""

    __slots__ = ("future",)

    def __init__(self, future: Future) -> None:
        #: a concurrent.futures.Future (add_done_callback, result, exception)
        self.future = future

    def wait(self, timeout: float | None = None) -> Any:
        """The collective's result (what the blocking call returns), or its error."""
        try:
            return self.future.result(timeout)
        except FutureTimeout:
            if self.future.done():      # its own Timeout (a TimeoutError, as FutureTimeout)
                raise
            raise Timeout(f"collective still running after {timeout:g} s") from None

    def done(self) -> bool:
        return self.future.done()


class Progress:
    """A daemon thread running submitted collectives in order."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Handle:
        fut: Future = Future()
        with self._lock:
            self._pending += 1
        self._q.put((fn, fut))
        return Handle(fut)

    def busy(self) -> bool:
        """Whether submitted work has not finished yet."""
        with self._lock:
            return self._pending > 0

    def stop(self, timeout: float = 5.0) -> None:
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as e:  # noqa: BLE001 - handed to the waiter
                    with self._lock:
                        self._pending -= 1
                    fut.set_exception(e)
                    continue
                with self._lock:
                    self._pending -= 1
                fut.set_result(result)
            else:
                with self._lock:
                    self._pending -= 1
