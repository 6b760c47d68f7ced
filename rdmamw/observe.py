"""What this process's channels and collectives did, kept where rdmamw.metrics reads it:
the open channels (by weak reference: a channel is never kept alive for its counters),
the last counters of those that closed, hooks the collectives and the connects call
with each one's time, the timeline being recorded (rdmamw.trace), and the hooks that
run when the process first takes part in a job.

It sits at the bottom of the package, as rdmamw.errors does, so the channel and
collectives layers report into it without knowing the metrics package above them.
Nothing here is on a data path: a channel is registered when it opens and retired when
it closes (one dict operation each), and the collectives' and connects' hooks are None,
one load and one comparison per collective or connect, until metrics are enabled."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from rdmamw import _fork

#: (provider, peer): the peer's rank as text when the channel was opened by rank, else
#: its address
Key = tuple[str, str]

#: called with (the collective's kind, its seconds) after each blocking or awaited
#: collective, while rdmamw.metrics records them (None: nothing is measured)
collective: Callable[[str, float], None] | None = None
#: called with (the provider, the outcome: "opened", "accepted", "refused" or "failed",
#: its seconds) after each channel connect, opened or accepted, while rdmamw.metrics
#: records them (None: nothing is measured)
connect: Callable[[str, str, float], None] | None = None
#: the timeline being recorded (rdmamw.trace.recorder.Tracer), or None: the collectives,
#: their steps and the parameter server's rounds test it once each, a channel's opening
#: names its tracks in it
tracer: Any = None

#: the collectives' waits on one peer that outlasted their first slice, by thread:
#: (the peer's world rank, the time.monotonic() the wait began); what
#: rdmamw.metrics.health says a rank waits on (rdmamw/collectives/waits.py)
waits: dict[int, tuple[int, float]] = {}

_lock = threading.Lock()


class _Entry:
    """An open channel: a weak reference, its key, and its counters as last read (what
    counts for it if it is collected without a close)."""

    __slots__ = ("cid", "done", "key", "last", "ref")

    def __init__(self, ch: Any, key: Key) -> None:
        self.cid, self.key, self.done = id(ch), key, False
        self.last: dict[str, Any] = {}
        # the callback may run inside a garbage collection anywhere, even while this
        # module's lock is held: it only queues the entry (list.append is atomic)
        self.ref = weakref.ref(ch, lambda _ref: _dead.append(self))


_open: dict[int, _Entry] = {}           # id(channel) -> its entry
_dead: list[_Entry] = []                # entries of channels collected without a close
_closed: dict[Key, dict[str, float]] = {}  # the counters of closed channels, summed
_servers: weakref.WeakSet[Any] = weakref.WeakSet()     # parameter servers
_at_begin: list[Callable[[], None]] = []
_begun = False


def key_of(ch: Any) -> Key:
    rank = getattr(ch, "peer_rank", None)
    return (str(getattr(ch, "provider", "?")),
            str(rank) if rank is not None else str(getattr(ch, "peer", "?")))


def register(ch: Any) -> None:
    """A channel opened (rdmamw/channel/channel.py); a timeline being recorded names
    its tracks after it."""
    with _lock:
        _open[id(ch)] = _Entry(ch, key_of(ch))
    tr = tracer
    if tr is not None:
        tr.channel(ch)


def retire(ch: Any) -> None:
    """A channel closed: its final counters join the closed ones of its key (once)."""
    with _lock:
        entry = _open.get(id(ch))
        if entry is not None and id(entry.ref()) == entry.cid:
            del _open[entry.cid]
            entry.done = True
            _add(entry.key, ch.stats())


def _add(key: Key, counters: dict[str, Any]) -> None:
    into = _closed.setdefault(key, {})
    for k, v in counters.items():
        if type(v) is int or type(v) is float:
            into[k] = into.get(k, 0) + v


def read(fn: Callable[[Key, Any], dict[str, Any]]) -> dict[Key, dict[str, float]]:
    """``fn(key, channel)`` of each open channel (its counters: kept as its last
    reading) under the registry's lock, so no channel is counted both open and closed;
    returns the closed channels' sums (a copy). Channels collected without a close
    count with the counters of their last reading."""
    with _lock:
        while _dead:
            entry = _dead.pop()
            if _open.get(entry.cid) is entry:
                del _open[entry.cid]
            if not entry.done:
                entry.done = True
                _add(entry.key, entry.last)
        for entry in list(_open.values()):
            ch = entry.ref()
            if ch is not None:
                entry.last = fn(entry.key, ch)
        return {k: dict(v) for k, v in _closed.items()}


def channels() -> list[tuple[Key, Any]]:
    """The open channels with their keys (for a health answer: held while it is made)."""
    with _lock:
        found = [(e.key, e.ref()) for e in _open.values()]
    return [(key, ch) for key, ch in found if ch is not None]


def serving(server: Any) -> None:
    """A parameter server (rdmamw.ps.KVServer) was made: its ``stats()`` are read at each
    scrape while it lives (a weak reference)."""
    with _lock:
        _servers.add(server)


def servers() -> list[Any]:
    """The parameter servers of this process that are still alive."""
    with _lock:
        return list(_servers)


def at_begin(hook: Callable[[], None]) -> None:
    """Run ``hook()`` when the process first joins a job or opens a channel (the
    package's front door starts the metrics endpoint so, when RDMAMW_METRICS_PORT
    says to)."""
    _at_begin.append(hook)


def begin() -> None:
    """The process takes part in a job now (rdmamw.init, or a channel about to open):
    the :func:`at_begin` hooks run, until they all succeed once (a hook's error, such
    as a bad setting, fails the call that began)."""
    global _begun
    if _begun:
        return
    for hook in _at_begin:
        hook()
    _begun = True


@_fork.at_child
def _forget() -> None:
    """A fork child's channels are its parent's: it counts none of them."""
    global _lock
    _lock = threading.Lock()
    _open.clear()
    _dead.clear()
    _closed.clear()
    _servers.clear()
    waits.clear()
