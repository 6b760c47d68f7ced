"""Overlapped transfers. Pulls: the blocks of a pull are copied in by a thread while
the caller computes, and the caller waits per key (the first layer's parameters are
needed long before the last's). Pushes: a sender thread copies each part out as
soon as backward hands it over. The copies release the GIL (numpy, the channel's
engine), so on another core they run alongside the caller's computation."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import numpy as np

from rdmamw.ps.metrics import ComputeClock


class StreamWorker(Protocol):
    """What a stream needs of its worker (rdmamw.ps.worker.KVWorker has it): check a
    pull and build its requests, send batches, receive replies into their arrays,
    record a completed pull, send gradient parts; and the worker's compute clock,
    which time blocked in a stream counts against."""

    compute_clock: ComputeClock

    def prepare_pull(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None
                     ) -> tuple[list[np.ndarray], dict, dict[int, tuple[bytes, int]]]: ...

    def send_batches(self, per: dict[int, list]) -> None: ...

    def receive_pull(self, rids: dict[int, int], dest: dict | None,
                     arrived: Callable[[Hashable], None] | None = None
                     ) -> dict[int, dict]: ...

    def complete_pull(self, replies: dict[int, dict], t0: float,
                      restart_clock: bool = True) -> None: ...

    def send_parts(self, keys: list, values: list) -> list: ...


class PullStream:
    """One pull in flight (see :meth:`KVWorker.pull_stream`). Time the caller spends
    blocked in :meth:`wait` / :meth:`join` counts as communication, not compute, in
    the worker's metrics."""

    def __init__(self, worker: StreamWorker, keys: list[Hashable], out: Sequence[np.ndarray],
                 first: dict[int, list] | None = None) -> None:
        """``first``: messages per server to send in the same batch, before the pull
        request (a push's clock)."""
        self.w, self.keys = worker, keys
        self.t0 = time.monotonic()
        self.out, dest, reqs = worker.prepare_pull(keys, out)
        self._index = {k: i for i, k in enumerate(keys)}
        self._ready = {k: threading.Event() for k in keys}
        self._error: BaseException | None = None
        self._heads: dict[int, dict] = {}
        per = first if first is not None else {}
        for s, (m, _) in reqs.items():
            per.setdefault(s, []).append(m)
        worker.send_batches(per)
        # the caller computes from here on; waits in wait() / join() are comms
        worker.compute_clock.restart(time.monotonic())
        ids = {s: rid for s, (_, rid) in reqs.items()}
        self._thread = threading.Thread(target=self._run, args=(ids, dest),
                                        name="rdmamw-pull", daemon=True)
        self._thread.start()

    def _run(self, ids: dict[int, int], dest: dict) -> None:
        try:
            self._heads = self.w.receive_pull(ids, dest,
                                              arrived=lambda k: self._ready[k].set())
        except BaseException as e:      # handed to the caller by wait() / join()
            self._error = e
        finally:
            for ev in self._ready.values():
                ev.set()

    def wait(self, key: Hashable) -> np.ndarray:
        """Block until ``key``'s value is complete in its ``out`` array; return it."""
        t = time.monotonic()
        self._ready[key].wait()
        self.w.compute_clock.add_comm(time.monotonic() - t)
        if self._error is not None:
            raise self._error
        return self.out[self._index[key]]

    def join(self) -> list[np.ndarray]:
        """Block until everything arrived; the pull is then complete (model versions
        and DSANA's assignment updated) and the stream may be dropped."""
        t = time.monotonic()
        self._thread.join()
        blocked = time.monotonic() - t
        if self._error is not None:
            raise self._error
        self.w.compute_clock.add_comm(blocked)
        self.w.complete_pull(self._heads, self.t0, restart_clock=False)  # the caller computes on
        return self.out


class PushQueue:
    """The sender thread behind :meth:`KVWorker.push_part`: parts go out in the order
    given; :meth:`drain` waits until all are sent and re-raises a send's error."""

    def __init__(self, worker: StreamWorker) -> None:
        self.w = worker
        self._q: queue.Queue = queue.Queue()
        self._handles: list = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rdmamw-push", daemon=True)
        self._thread.start()

    def put(self, keys: list[Hashable], values: list[np.ndarray]) -> None:
        self._q.put((keys, values))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:                # stop()
                self._q.task_done()
                return
            keys, values = item
            try:
                if self._error is None:
                    self._handles += self.w.send_parts(keys, values)
            except BaseException as e:    # handed to the caller by drain()
                self._error = e
            finally:
                self._q.task_done()

    def stop(self) -> None:
        """End the thread once what is queued is sent."""
        self._q.put(None)
        self._thread.join()

    def drain(self) -> list:
        """Wait until every part is sent; return their handles (or raise the error)."""
        self._q.join()
        handles, self._handles = self._handles, []
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        return handles
