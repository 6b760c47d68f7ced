"""A collective's send that blocks on a full ring (rdmamw/collectives/waits.py,
``Waits.now(SEND, ...)``) goes in slices of WATCH seconds, the other channels watched
between them, each slice going on from where the last one's Timeout stopped
(``.sent``): the peer gets every message once, in order, and the handle returned
covers every part (its ``wait`` returns only once the receiver took the last one).

The peer is a thread of this process that starts receiving only after several slices
(a rank that is slow, or blocked in turn), then takes them in bursts."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rdmamw.collectives.waits import SEND, WATCH, Waits
from tests.support.helpers import make_pair

SLOTS, SLOT = 4, 4096
#: the receiver's start, in slices of the send
LATE = 4
#: (messages, bytes each, messages the receiver takes at a time, a slice and a half
#: apart); eager: one a slot, 24 on 4 slots; rendezvous: 16 KiB ones, more than the 64
#: entries a direction has
BATCH = {"eager": (24, 3000, 4), "rendezvous": (100, 16 << 10, 20)}


class Watching(Waits):
    """Waits that counts its looks at the other channels."""

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self.looks = 0

    def watch(self, peer: int) -> None:
        self.looks += 1
        super().watch(peer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(BATCH))
def test_a_blocked_send_goes_in_watched_slices_and_its_handle_covers_them(provider, kind):
    n, size, burst = BATCH[kind]
    msgs = [np.full(size, i, np.uint8) for i in range(n)]
    a, b, lst = make_pair(slots=SLOTS, slot_size=SLOT, provider=provider)
    got: list[bytes] = []
    last = threading.Event()        # set as the receiver starts taking the last message

    def receive() -> None:
        time.sleep(LATE * WATCH)
        while len(got) < n:
            if len(got) % burst == 0:       # in bursts: slices end with part of the
                time.sleep(1.5 * WATCH)         # rest sent (the next goes on from there)
            if len(got) == n - 1:
                time.sleep(2 * WATCH)       # the last one late: the handle must wait
                last.set()
            for m in b.recv_batch(1, timeout=10):
                got.append(bytes(m))
                m.release()

    t = threading.Thread(target=receive)
    t.start()
    try:
        comm = SimpleNamespace(timeout=10.0, _chans={1: a}, _queues={1: []}, rank=0,
                               size=2, seq=1, members=[0, 1])
        waits = Watching(comm)
        waits.begin(10.0)
        h = waits.now(SEND, 1, list(msgs))
        h.wait(10)
        if kind == "rendezvous":
            assert last.is_set(), "the handle was done before the last part was taken"
    finally:
        t.join(10)
        a.close()
        b.close()
        lst.close()
    assert got == [m.tobytes() for m in msgs]
    assert waits.looks >= LATE - 1, waits.looks
