"""A timeline of what a job did (docs/trace.md): each collective (kind, bytes,
algorithm, peers) and each of its steps (send, receive, wait, per peer), the parameter
server's rounds, and the channels' batches, doorbells, completions, waits and
rendezvous phases, written per process as Chrome trace-event JSON that Perfetto
opens; ``rdmamw trace merge`` puts the ranks' files on one timeline.

Off by default. ``RDMAMW_TRACE=trace-%r.json`` records from ``rdmamw.init()`` (or the
first channel) to the process's exit; :func:`record` records a block of code. While
off, the hooks cost one module attribute load and a None test per collective, step
and round, and on a channel's compiled path one load and a predictable branch each
(rdmamw/include/rm_trace.h). This module (its settings) is imported when a process
joins a job, to read RDMAMW_TRACE; the recorder only when it is set."""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rdmamw import _fork, config, observe
from rdmamw.errors import RdmamwError
from rdmamw.trace import settings as settings

if TYPE_CHECKING:
    from rdmamw.trace.recorder import Tracer

log = logging.getLogger("rdmamw.trace")
_lock = threading.Lock()
_exit_hooked = False


def start(path: str | None = None) -> Tracer:
    """Record from now on into ``path`` (default RDMAMW_TRACE), written by :func:`stop`
    (or at exit); one timeline per process at a time (RdmamwError while one records)."""
    global _exit_hooked
    path = config.get("RDMAMW_TRACE") if path is None else path
    if not path:
        raise ValueError("no path: pass one or set RDMAMW_TRACE")
    with _lock:
        if observe.tracer is not None:
            raise RdmamwError(f"a timeline is recorded already (into "
                              f"{observe.tracer.path!r}); one per process")
        from rdmamw.engine import _engine
        from rdmamw.trace.recorder import Tracer
        tr = Tracer(str(path), config.get("RDMAMW_TRACE_MAX_EVENTS"))
        _engine.trace_start(config.get("RDMAMW_TRACE_MAX_RECORDS"))
        observe.tracer = tr
        for _, ch in observe.channels():    # (those opened from now on: observe.register)
            tr.channel(ch)
        if not _exit_hooked:
            atexit.register(_at_exit)
            _exit_hooked = True
        return tr


def stop() -> str | None:
    """Stop recording and write the file; its path (None if nothing was recorded)."""
    with _lock:
        tr, observe.tracer = observe.tracer, None
    if tr is None:
        return None
    from rdmamw.engine import _engine
    tr.records, tr.records_dropped = _engine.trace_stop()
    path: str = tr.write(rank())
    log.info("timeline written to %s (%d spans and %d channel records, %d and %d "
             "dropped)", path, len(tr.spans) + len(tr.steps),
             len(tr.records) // _engine.TRACE_RECORD_BYTES, tr.dropped, tr.records_dropped)
    return path


@contextlib.contextmanager
def record(path: str) -> Iterator[Tracer]:
    """``with rdmamw.trace.record("trace-%r.json"): ...``: the block's timeline, written
    when it ends (%r: the rank, %p: the pid)."""
    tr = start(path)
    try:
        yield tr
    finally:
        if observe.tracer is tr:
            stop()


def rank() -> int | None:
    """This process's rank in the job of rdmamw.init(), None before it."""
    from rdmamw import bootstrap
    try:
        return int(bootstrap.world().rank)
    except RdmamwError:
        return None


def from_environment() -> None:
    """:func:`start` if RDMAMW_TRACE is set and nothing records yet (rdmamw/observe.py
    runs this when the process joins a job or opens its first channel)."""
    if config.get("RDMAMW_TRACE") and observe.tracer is None:
        start()


def _at_exit() -> None:
    try:
        stop()
    except OSError as e:
        log.warning("timeline: cannot write it: %s", e)


@_fork.at_child
def _forget() -> None:
    """A fork child records nothing of its parent's (and writes no file for it)."""
    global _lock
    _lock = threading.Lock()
    if observe.tracer is not None:
        from rdmamw.engine import _engine
        _engine.trace_stop()            # (the parent's records: not the child's)
    observe.tracer = None


__all__ = ["from_environment", "rank", "record", "start", "stop"]
