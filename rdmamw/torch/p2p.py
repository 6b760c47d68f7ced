"""send / recv between two ranks of a process group, on channels of their own (a
second World met through the same store): collectives own the group's other channels
and count on every message there being theirs.

Each message is a header (tag, dtype, shape) then the tensor's bytes, received
straight into the destination tensor (``recv_into``). Sends to a peer run in order on
one thread, receives from it on another, both started on first use: an isend and an
irecv between the same pair never wait on each other (batch_isend_irecv, rings)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch

from rdmamw.bootstrap import World
from rdmamw.channel import Channel
from rdmamw.collectives.progress import Handle, Progress
from rdmamw.errors import RdmamwError


class P2PMismatch(RdmamwError, ValueError):
    """A recv found a message of another tag, dtype or shape than it expected; the
    channel to that peer is closed (what followed is out of step)."""


class PointToPoint:
    def __init__(self, world: World, timeout: float) -> None:
        self.world, self.timeout = world, timeout
        self._chans: dict[int, Channel] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._threads: dict[tuple[int, str], Progress] = {}
        self._lock = threading.Lock()

    def _channel(self, peer: int) -> Channel:
        with self._lock:
            lock = self._locks.setdefault(peer, threading.Lock())
        with lock:                 # one open per peer; opens to different peers overlap
            ch = self._chans.get(peer)
            if ch is None:
                ch = Channel.open(peer, world=self.world, timeout=self.timeout)
                self._chans[peer] = ch
            return ch

    def _submit(self, peer: int, way: str, fn: Callable[[], Any]) -> Handle:
        with self._lock:
            p = self._threads.get((peer, way))
            if p is None:
                p = self._threads[(peer, way)] = Progress(f"rdmamw-p2p-{way}-{peer}")
        return p.submit(fn)

    def send(self, data: np.ndarray, dtype: torch.dtype, shape: tuple, peer: int,
             tag: int) -> Handle:
        """``data``: the tensor's bytes (C-contiguous uint8, kept until done)."""
        head = msgpack.packb([tag, str(dtype), list(shape)])

        def go() -> None:
            ch = self._channel(peer)
            ch.send_batch([head, data] if len(data) else [head], timeout=self.timeout).wait()

        return self._submit(peer, "send", go)

    def recv(self, into: np.ndarray, dtype: torch.dtype, shape: tuple, peer: int,
             tag: int) -> Handle:
        """``into``: the destination's bytes (C-contiguous, writable uint8)."""
        want = [tag, str(dtype), list(shape)]

        def go() -> None:
            ch = self._channel(peer)
            m = ch.recv(timeout=self.timeout)
            try:
                got = msgpack.unpackb(bytes(m))
            except Exception:  # noqa: BLE001 - anything malformed is the same error
                got = None
            finally:
                m.release()
            if got != want:
                self._drop(peer)
                raise P2PMismatch(f"recv from rank {peer} expected (tag, dtype, shape) "
                                  f"{want} but rank {peer} sent {got}")
            if len(into):
                n = ch.recv_into(into, timeout=self.timeout)
                if n != len(into):
                    self._drop(peer)
                    raise P2PMismatch(f"recv from rank {peer}: {n} bytes for {len(into)}")

        return self._submit(peer, "recv", go)

    def _drop(self, peer: int) -> None:
        ch = self._chans.pop(peer, None)
        if ch is not None:
            ch.close()

    def close(self) -> None:
        for p in self._threads.values():
            p.stop(1.0)
        self._threads.clear()
        for ch in self._chans.values():
            ch.close()
        self._chans.clear()
        self.world.close()
