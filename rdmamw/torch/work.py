"""torch ``Work`` for rdmamw's non-blocking operations: done (or failed) when the
rdmamw handle is, after the backend's finishing step (copy back a non-contiguous or
widened tensor, divide for AVG) ran on the progress thread. ``wait()`` raises the
operation's own error (CollectiveMismatch, PeerLost, ...); ``get_future()`` is a
torch Future of the output tensors (what DDP's communication hooks chain on).

(torch's ``_create_work_from_future`` is not used: its wait() returns True even
when the future failed.)"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future as TorchFuture

from rdmamw.collectives.progress import Handle
from rdmamw.errors import Timeout


class Work(dist.Work):
    def __init__(self) -> None:
        super().__init__()
        self._tf: TorchFuture = TorchFuture()
        self._done = threading.Event()

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        secs = timeout.total_seconds() if timeout else 0.0
        if not self._done.wait(secs if secs > 0 else None):
            raise Timeout(f"rdmamw: operation not done after {secs:g} s")
        self._tf.wait()             # raises the operation's error
        return True

    def get_future(self) -> TorchFuture:
        return self._tf

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and not self._failed()

    def exception(self) -> BaseException | None:
        if not self._failed():
            return None
        try:
            self._tf.wait()
        except BaseException as e:  # noqa: BLE001 - it is the answer
            return e
        return None

    def _failed(self) -> bool:
        return self._done.is_set() and self._tf.done() and self._error

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._error = error is not None
        if error is not None:
            self._tf.set_exception(error)
        else:
            self._tf.set_result(value)
        self._done.set()


def work_after(h: Any, finish: Callable[[Any], Any]) -> Work:
    """A Work done once the collective is (``h``: its progress.Handle, or its result
    when it ran in this thread) and ``finish(result)`` ran; its future's value is what
    ``finish`` returns (a list of tensors)."""
    if not isinstance(h, Handle):
        return completed(finish(h))
    fut: Future = h.future
    w = Work()

    def done(f: Future) -> None:
        try:
            value = finish(f.result())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            w._finish(error=e)
            return
        w._finish(value)

    fut.add_done_callback(done)
    return w


def completed(value: list[torch.Tensor]) -> Work:
    """A Work that is already done (nothing to communicate)."""
    w = Work()
    w._finish(value)
    return w
