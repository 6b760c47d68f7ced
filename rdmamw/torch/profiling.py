"""rdmamw's operations in torch's profiler: while a ``torch.profiler.profile`` records,
each collective and point-to-point operation of the torch backend is a
``record_function`` span named ``rdmamw::<kind>`` (``rdmamw::allreduce``,
``rdmamw::send``, ...) on the thread that called it, from the call to the end of the
operation: an asynchronous one's span ends when its work does (torch's
``_call_end_callbacks_on_future``, as its own RPC's spans do), not on the progress
thread that ran it, whose events the profiler would not record.

Off (no profiler), the cost is one module attribute load per operation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import profiler

from rdmamw.collectives.progress import Handle

PREFIX = "rdmamw::"


def active() -> bool:
    """A torch profiler records now (torch sets this flag when one starts)."""
    return bool(profiler._is_profiler_enabled)


def span(kind: str, run: Callable[[], Any]) -> Any:
    """``run()`` under the span ``rdmamw::<kind>``; when it returns a progress.Handle
    (an asynchronous operation), the span ends when the handle's operation does."""
    rf = profiler.record_function(PREFIX + kind)
    rf.__enter__()
    try:
        out = run()
    except BaseException:
        rf.__exit__(None, None, None)
        raise
    if isinstance(out, Handle):
        ended: torch.futures.Future = torch.futures.Future()
        out.future.add_done_callback(lambda _: ended.set_result(None))
        rf._call_end_callbacks_on_future(ended)
    else:
        rf.__exit__(None, None, None)
    return out
