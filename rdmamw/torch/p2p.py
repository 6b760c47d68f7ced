"""send / recv between two ranks of a process group, on channels of their own (a
second World met through the same store): collectives own the group's other channels
and count on every message there being theirs.

Each message is a header (tag, dtype, shape) then the tensor's bytes, received
straight into the destination tensor (``recv_into``). Sends to a peer run in order on
one thread, receives from it on another, both started on first use: an isend and an
irecv between the same pair never wait on each other (batch_isend_irecv, rings).

A receive from any source (``recv_any``) runs on a thread of its own, one at a time in
call order: it looks at each peer in turn, on that peer's receive thread (so it stays
in order with the receives named for that peer), without waiting: a header that
arrived is kept (``_heads``) until a receive takes it; the first peer whose next
header has the tag wanted gives the message. A peer whose channel is not open yet is
opened in the background (its first send opens it from its side)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch

from rdmamw.bootstrap import World, ranklist
from rdmamw.channel import Channel
from rdmamw.collectives.progress import Handle, Progress
from rdmamw.errors import RdmamwError, Timeout


class P2PMismatch(RdmamwError, ValueError):
    """A recv found a message of another tag, dtype or shape than it expected; the
    channel to that peer is closed (what followed is out of step)."""


class PointToPoint:
    def __init__(self, world: World, timeout: float, members: list[int] | None = None) -> None:
        self.world, self.timeout = world, timeout
        #: the group's rank -> the world's (a shrunk group's survivors); None: the same
        self.members = members
        self._chans: dict[int, Channel] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._threads: dict[tuple[int, str], Progress] = {}
        self._lock = threading.Lock()
        #: peer -> the header received from it that no receive took yet (read and
        #: written on that peer's receive thread only)
        self._heads: dict[int, list] = {}
        self._opening: set[int] = set()

    def _channel(self, peer: int) -> Channel:
        with self._lock:
            lock = self._locks.setdefault(peer, threading.Lock())
        with lock:                 # one open per peer; opens to different peers overlap
            ch = self._chans.get(peer)
            if ch is None:
                ch = Channel.open(peer if self.members is None else self.members[peer],
                                  world=self.world, timeout=self.timeout)
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
        return self.send_many(peer, [(data, dtype, shape, tag)])

    def send_many(self, peer: int, sends: list[tuple[np.ndarray, torch.dtype, tuple, int]]
                  ) -> Handle:
        """Several sends to ``peer`` (each ``(data, dtype, shape, tag)`` as for
        :meth:`send`) posted together: one ``send_batch`` of their headers and bytes,
        each message as :meth:`send` would have sent it (the receiver cannot tell)."""
        msgs: list = []
        for data, dtype, shape, tag in sends:
            msgs.append(msgpack.packb([tag, str(dtype), list(shape)]))
            if len(data):
                msgs.append(data)

        def go() -> None:
            self._channel(peer).send_batch(msgs, timeout=self.timeout).wait()

        return self._submit(peer, "send", go)

    def recv(self, into: np.ndarray, dtype: torch.dtype, shape: tuple, peer: int,
             tag: int) -> Handle:
        """``into``: the destination's bytes (C-contiguous, writable uint8)."""
        want = [tag, str(dtype), list(shape)]

        def go() -> None:
            got = self._head(peer, self.timeout)
            if got != want:
                self._drop(peer)
                raise P2PMismatch(f"recv from rank {peer} expected (tag, dtype, shape) "
                                  f"{want} but rank {peer} sent {got}")
            self._body(peer, into)

        return self._submit(peer, "recv", go)

    def recv_any(self, into: np.ndarray, dtype: torch.dtype, shape: tuple,
                 peers: list[int], tag: int) -> Handle:
        """The first message of tag ``tag`` from any of ``peers`` into ``into``; the
        handle's result is the sender's rank. A message of that tag whose dtype or
        shape differ is a P2PMismatch (as for ``recv``)."""
        want = [tag, str(dtype), list(shape)]

        def probe(peer: int) -> bool:
            got = self._head(peer, 0)
            if got is None or got[:1] != want[:1]:
                return False                    # nothing yet, or another tag's: kept
            if got != want:
                self._drop(peer)
                raise P2PMismatch(f"recv from any source expected (tag, dtype, shape) "
                                  f"{want} but rank {peer} sent {got}")
            self._body(peer, into)
            return True

        def go() -> int:
            end, pause = time.monotonic() + self.timeout, 0.00005
            while True:
                for peer in peers:
                    if peer not in self._chans:
                        self._open_later(peer)
                    elif self._busy(peer):
                        continue                # a receive named for it goes first
                    elif self._submit(peer, "recv", lambda p=peer: probe(p)).wait():
                        return peer
                if time.monotonic() >= end:
                    raise Timeout(f"recv from any source (tag {tag}): no message from "
                                  f"ranks {ranklist.compact(peers)} within "
                                  f"{self.timeout:g} s")
                time.sleep(pause)
                pause = min(0.002, pause * 2)

        return self._submit(-1, "any", go)

    def _busy(self, peer: int) -> bool:
        p = self._threads.get((peer, "recv"))
        return p is not None and p.busy()

    def _head(self, peer: int, timeout: float) -> list | None:
        """The next header from ``peer`` (kept, or received now), taken; None when
        none came within ``timeout`` (0: none there). On the peer's receive thread."""
        got = self._heads.pop(peer, None)
        if got is not None:
            if timeout == 0:
                self._heads[peer] = got         # a probe looks; the body takes it
            return got
        ch = self._channel(peer)
        try:
            m = ch.recv(timeout=timeout)
        except Timeout:
            if timeout == 0:
                return None
            raise
        try:
            got = msgpack.unpackb(bytes(m))
        except Exception:  # noqa: BLE001 - anything malformed is the same error
            got = ["?"]
        finally:
            m.release()
        if timeout == 0:
            self._heads[peer] = got
        return got

    def _body(self, peer: int, into: np.ndarray) -> None:
        """The message after the header just matched, into ``into``."""
        self._heads.pop(peer, None)
        if len(into):
            n = self._chans[peer].recv_into(into, timeout=self.timeout)
            if n != len(into):
                self._drop(peer)
                raise P2PMismatch(f"recv from rank {peer}: {n} bytes for {len(into)}")

    def _open_later(self, peer: int) -> None:
        """Open the channel to ``peer`` on its receive thread, not waiting: it opens
        when the peer opens it from its side (its first send to us)."""
        with self._lock:
            if peer in self._opening:
                return
            self._opening.add(peer)

        def go() -> None:
            try:
                self._channel(peer)
            except RdmamwError:
                pass                            # not now: a later receive tries again
            finally:
                with self._lock:
                    self._opening.discard(peer)

        self._submit(peer, "recv", go)

    def _drop(self, peer: int) -> None:
        self._heads.pop(peer, None)
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
