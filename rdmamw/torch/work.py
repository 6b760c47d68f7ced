"""torch ``Work`` for rdmamw's non-blocking operations: done (or failed) when the
rdmamw handle is, after the backend's finishing step (copy back a non-contiguous or
widened tensor, divide for AVG) ran on the progress thread. ``wait()`` raises the
operation's own error (CollectiveMismatch, PeerLost, ...); ``get_future()`` is a
torch Future of the output tensors (what DDP's communication hooks chain on).

(torch's ``_create_work_from_future`` is not used: its wait() returns True even
when the future failed.)"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future as TorchFuture

from rdmamw import errors
from rdmamw.collectives.progress import Handle


class Timeout(errors.Timeout, dist.DistBackendError):
    """A wait of the torch backend past its timeout: rdmamw's Timeout (a
    TimeoutError) that is also torch's ``DistBackendError`` (a RuntimeError), the
    type gloo's and nccl's timeouts have, so code written for them catches it."""


def torch_error(e: BaseException) -> BaseException:
    """``e``, or for an rdmamw Timeout the same as this module's :class:`Timeout`."""
    if isinstance(e, errors.Timeout) and not isinstance(e, Timeout):
        t = Timeout(str(e))
        t.__cause__ = e
        return t
    return e


class Work(dist.Work):
    """Done when its torch future is (no Event: a blocking call's Work is made done,
    and an Event would be a third of the backend's per-call cost)."""

    def __init__(self) -> None:
        super().__init__()
        self._tf: TorchFuture = TorchFuture()
        self._chained: TorchFuture | None = None
        self._error = False
        self._source = -1

    def _source_rank(self) -> int:
        """The sender's group rank, for a receive from any source (what
        ``dist.recv(t)`` returns and ``dist.irecv(t).wait()`` then asks)."""
        self.wait()
        if self._source < 0:
            raise RuntimeError("_source_rank: only a receive from any source has one")
        return self._source

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Until the operation is done (its error raised); with a ``timeout``, a
        :class:`Timeout` once that passed, as gloo's "Operation timed out!": the
        operation goes on, a later wait can still see it done."""
        secs = timeout.total_seconds() if timeout else 0.0
        if secs > 0 and not self._tf.done():
            end, pause = time.monotonic() + secs, 0.0001
            while not self._tf.done():
                left = end - time.monotonic()
                if left <= 0:
                    raise Timeout(f"rdmamw: operation timed out: not done after {secs:g} s "
                                  f"(it goes on; wait again for it)")
                time.sleep(min(pause, left))
                pause = min(0.01, pause * 2)
        self._tf.wait()             # raises the operation's error
        return True

    def get_future(self) -> TorchFuture:
        # a future chained on ours: a failure reaches C++ callers (DDP's reducer) as a
        # C++ error (torch turns a callback's exception into one), where our own
        # future holds the exception as its *value* (Future.set_exception), which the
        # reducer took for tensors and crashed on (SIGSEGV, parseCppCommHookResult)
        if self._chained is None:
            self._chained = self._tf.then(_value)
        return self._chained

    def is_completed(self) -> bool:
        return self._tf.done()

    def is_success(self) -> bool:
        return self._tf.done() and not self._error

    def exception(self) -> BaseException | None:
        if not (self._tf.done() and self._error):
            return None
        try:
            self._tf.wait()
        except BaseException as e:  # noqa: BLE001 - it is the answer
            return e
        return None

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        if error is not None:
            self._error = True
            self._tf.set_exception(error)
        else:
            self._tf.set_result(value)


def _value(f: TorchFuture) -> Any:
    return f.value()         # raises the operation's error (in the chained future)


def work_after(h: Any, finish: Callable[[Any], Any], source: bool = False) -> Work:
    """A Work done once the collective is (``h``: its progress.Handle, or its result
    when it ran in this thread) and ``finish(result)`` ran; its future's value is what
    ``finish`` returns (a list of tensors). ``source``: the result is the sender's
    rank of a receive from any source (the Work's ``_source_rank()``)."""
    if not isinstance(h, Handle):
        return completed(finish(h))
    fut: Future = h.future
    w = Work()

    def done(f: Future) -> None:
        try:
            if source:
                w._source = f.result()
            value = finish(f.result())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            w._finish(error=torch_error(e))
            return
        w._finish(value)

    fut.add_done_callback(done)
    return w


class Done(Work):
    """A Work that is done already: what a blocking call returns. Its torch future is
    made only if asked for (``get_future()``): the future and its result were a third
    of the backend's own cost per blocking call (torch waits on the Work and drops it)."""

    def __init__(self, value: Any) -> None:
        dist.Work.__init__(self)        # not Work's: no future yet
        self._value = value
        self._tf: TorchFuture | None = None  # type: ignore[assignment]

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return True

    def get_future(self) -> TorchFuture:
        if self._tf is None:
            self._tf = TorchFuture()
            self._tf.set_result(self._value)
        return self._tf

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None


def completed(value: list[torch.Tensor]) -> Done:
    """A Work that is already done (nothing to communicate, or a blocking call)."""
    return Done(value)
