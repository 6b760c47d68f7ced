"""The spans of one process's timeline, kept in memory and written as Chrome
trace-event JSON (what Perfetto and chrome://tracing open): a list of tuples appended
by the hooks of rdmamw/observe.py (one ``list.append`` per span: atomic, no lock),
turned into JSON only when the file is written.

Times are ``time.perf_counter_ns()`` (the monotonic clock) in µs; the file records the
offset of that clock to the wall clock, measured when recording starts, so that
``rdmamw trace merge`` can put the ranks of a job on one timeline."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import numpy as np

from rdmamw.trace import records

#: the steps of a collective's schedule (rdmamw.collectives.waits: SEND, RECV, INTO,
#: WAIT) as their spans are named
STEP_NAMES = ("send", "recv", "recv into", "wait sent")
#: the file's format: otherData.rdmamw.version
VERSION = 1


def clock_offset_ns(tries: int = 5) -> int:
    """Wall clock minus monotonic clock (ns), from the tightest of ``tries`` readings
    (a wall reading between two monotonic ones, their midpoint)."""
    best = None
    for _ in range(tries):
        a = time.perf_counter_ns()
        w = time.time_ns()
        b = time.perf_counter_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    assert best is not None
    return best[1]


def nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else len(buf)


class Tracer:
    """One process's timeline, to be written to ``path`` (%r: the rank, %p: the pid);
    at most ``limit`` spans are kept, later ones only counted."""

    def __init__(self, path: str, limit: int) -> None:
        self.path, self.limit = path, limit
        self.clock = time.perf_counter_ns
        self.offset_ns = clock_offset_ns()
        self.started = self.clock()
        #: (name, category, start ns, end ns, thread, args)
        self.spans: list[tuple[str, str, int, int, int, Any]] = []
        #: the collectives' steps, kept raw (their args are made when the file is
        #: written): (step, peer, bytes, messages, seq, start ns, end ns, thread)
        self.steps: list[tuple[int, int, int, int, int, int, int, int]] = []
        self.dropped = 0
        self.threads: dict[int, str] = {}
        #: the channels' own records (rdmamw/trace/records.py), once recording stopped,
        #: and how many of them were not kept; the channels' names by their trace_id
        self.records = b""
        self.records_dropped = 0
        self.names: dict[int, str] = {}

    def channel(self, ch: Any) -> None:
        """Name a channel's tracks (rdmamw/observe.py: each channel as it opens, and
        those open when recording starts): its provider and peer."""
        rank = getattr(ch, "peer_rank", None)
        peer = f"rank {rank}" if rank is not None else str(getattr(ch, "peer", "?"))
        self.names[int(ch.trace_id)] = f"{getattr(ch, 'provider', '?')} to {peer}"

    def _room(self) -> int:
        """The calling thread's id, or 0 once ``limit`` spans are kept (one dropped)."""
        if len(self.spans) + len(self.steps) >= self.limit:
            self.dropped += 1
            return 0
        tid = threading.get_native_id()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        return tid

    def span(self, name: str, cat: str, t0: int, args: dict[str, Any]) -> None:
        """A span from ``t0`` (``self.clock()``) to now."""
        t1 = self.clock()
        tid = self._room()
        if tid:
            self.spans.append((name, cat, t0, t1, tid, args))

    def collective(self, header: list[Any], seq: int, peers: list[int], t0: int) -> None:
        """One collective (rdmamw.collectives.comm.Communicator.run): ``header`` is
        ``[kind, dtype, shape, op, root, algorithm]``; ``peers`` world ranks."""
        t1 = self.clock()
        tid = self._room()
        if tid:
            self.spans.append((header[0], "collective", t0, t1, tid, (header, seq, peers)))

    def step(self, kind: int, peer: int, arg: Any, out: Any, seq: int, t0: int) -> None:
        """One step of a collective's schedule, to or from world rank ``peer``: what it
        sent (a list of buffers), received (a list of messages, or a byte count)."""
        t1 = self.clock()
        tid = self._room()
        if not tid:
            return
        n = count = 0
        if kind == 0:
            for b in arg:
                n += b.nbytes if type(b) is np.ndarray else nbytes(b)
            count = len(arg)
        elif kind == 1:
            for m in out:
                n += len(m)
        elif kind == 2:
            n = out
        self.steps.append((kind, peer, n, count, seq, t0, t1, tid))

    # ---- the file --------------------------------------------------------------------

    def document(self, rank: int | None) -> dict[str, Any]:
        """The trace-event JSON object: pid is the rank (the process id without one)."""
        pid = os.getpid() if rank is None else rank
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": f"rank {rank}" if rank is not None else f"pid {pid}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
             "args": {"sort_index": pid}}]
        recs = records.parse(self.records)
        threads = dict(self.threads)
        named = {t.native_id: t.name for t in threading.enumerate()}
        for tid in records.thread_ids(recs):
            threads.setdefault(tid, named.get(tid, f"thread {tid}"))
        for tid, name in sorted(threads.items()):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": name}})
        events += records.events(recs, pid, self.names)
        for name, cat, t0, t1, tid, args in list(self.spans):
            if cat == "collective":
                args = _collective_args(*args)
            events.append({"name": name, "cat": cat, "ph": "X", "ts": t0 / 1000,
                           "dur": (t1 - t0) / 1000, "pid": pid, "tid": tid, "args": args})
        for kind, peer, n, count, seq, t0, t1, tid in list(self.steps):
            args = {"peer": peer, "seq": seq}
            if kind != 3:
                args["bytes"] = int(n)
            if kind == 0:
                args["messages"] = count
            events.append({"name": STEP_NAMES[kind], "cat": "step", "ph": "X",
                           "ts": t0 / 1000, "dur": (t1 - t0) / 1000, "pid": pid,
                           "tid": tid, "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"rdmamw": {
            "version": VERSION, "rank": rank, "pid": os.getpid(), "clock": "monotonic",
            "wall_minus_clock_ns": self.offset_ns, "dropped": self.dropped,
            "records_dropped": self.records_dropped}}}

    def write(self, rank: int | None) -> str:
        """Write the file (atomically: a reader never sees half of it); its path."""
        path = expand(self.path, rank)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.document(rank), f, separators=(",", ":"))
        os.replace(tmp, path)
        return path


def _collective_args(header: list[Any], seq: int, peers: list[int]) -> dict[str, Any]:
    kind, dtype, shape, op, root, alg = header
    args: dict[str, Any] = {"seq": seq, "dtype": dtype, "shape": list(shape),
                            "algorithm": alg, "peers": peers}
    if all(type(d) is int for d in shape):
        args["bytes"] = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if op:
        args["op"] = op
    if root >= 0:
        args["root"] = root
    return args


def expand(path: str, rank: int | None) -> str:
    """``path`` with %r (the rank, else ``pid<N>``), %p (the pid) and %% replaced."""
    out, i = [], 0
    while i < len(path):
        c = path[i]
        if c == "%" and i + 1 < len(path) and path[i + 1] in "rp%":
            nxt = path[i + 1]
            out.append("%" if nxt == "%" else str(os.getpid()) if nxt == "p"
                       else str(rank) if rank is not None else f"pid{os.getpid()}")
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)
