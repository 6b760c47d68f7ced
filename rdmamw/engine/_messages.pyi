"""Stub of rdmamw/engine/_messages.pyx: what users hold (SendHandle, Message) and the
buffers lent to the channel (Dest). Checked against the compiled module by stubtest
(`make lint`, scripts/stubtest_allowlist.txt)."""

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal, Protocol, TypeAlias, final, type_check_only

import numpy.typing as npt
from _typeshed import ReadableBuffer, WriteableBuffer

@type_check_only
class _DLPack(Protocol):
    """A tensor without the buffer protocol (torch, a DLPack exporter): taken through
    the host view set_host_view installs when its memory is the host's."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

#: what a send takes: a buffer (bytes, memoryview, a numpy array, a Message ...) or a
#: host tensor; numpy arrays are named as numpy's stubs give them no __buffer__ before
#: Python 3.12
_Source: TypeAlias = ReadableBuffer | npt.NDArray[Any] | _DLPack
#: what a receive writes into (recv_into, post_recv)
_Destination: TypeAlias = WriteableBuffer | npt.NDArray[Any] | _DLPack

def time_batches(bounds: Sequence[float], on: bool) -> None:
    """Time the batches from now on (``on``) with these 23 ``bounds`` (seconds,
    ascending), or stop (rdmamw.metrics: rdmamw_batch_completion_seconds)."""

def batch_times() -> tuple[list[int], float]:
    """(the observations per bucket, 24: the last above every bound; their sum, s)."""

def forget_batch_times() -> None:
    """Start the histogram afresh (a fork child's)."""

class Endpoint:
    """The engine's base: what a SendHandle calls back (no Python-visible API)."""

@final
class SendHandle:
    """Completion of one batch: its source buffers may be reused once ``done()``."""

    @property
    def batch(self) -> int: ...
    @property
    def count(self) -> int: ...
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> None: ...

@final
class Message:
    """A received message: a zero-copy view of its bytes (buffer protocol) until
    ``release()``."""

    def __len__(self) -> int: ...
    # the buffer protocol (C-level on Python 3.11; __buffer__ for checkers, PEP 688)
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __bytes__(self) -> bytes: ...
    def tobytes(self) -> bytes: ...
    def release(self) -> None: ...
    @property
    def released(self) -> bool: ...
    def __enter__(self) -> Message: ...
    def __exit__(
        self,
        *exc: type[BaseException] | BaseException | TracebackType | None,
    ) -> Literal[False]: ...

@final
class Dest:
    """A buffer lent to the channel as a destination (recv_into, post_recv)."""

    @property
    def obj(self) -> Any: ...

def set_host_view(fn: Callable[[Any], Any] | None) -> None: ...
