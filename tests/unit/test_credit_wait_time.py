"""The time senders spend waiting for the peer's free slots (``credit_wait_seconds`` in
``stats()``, ``rdmamw_credit_wait_seconds_total`` in the metrics): counted when a send
waits, blocking or awaited, and only then."""

from __future__ import annotations

import asyncio
import threading
import time

from rdmamw import aio, observe
from rdmamw.metrics import readings
from tests.support.helpers import make_pair

HOLD = 0.3          # the receiver reads nothing for this long
MSG = b"." * 600    # one 1 KiB slot each


def late_reader(b, n: int, ready: threading.Event) -> threading.Thread:
    """A thread that receives ``n`` messages on ``b`` once HOLD has passed after
    ``ready`` is set."""
    def run() -> None:
        ready.wait(10)
        time.sleep(HOLD)
        got = 0
        while got < n:
            for m in b.recv_batch(timeout=10):
                m.release()
                got += 1
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_send_that_waits_counts_its_time_and_one_that_does_not_counts_none(monkeypatch):
    monkeypatch.setattr(observe, "_open", {})
    monkeypatch.setattr(observe, "_closed", {})
    # the peers labelled so far in this process: past RDMAMW_METRICS_MAX_PEERS of them
    # (earlier tests' channels), this one would be summed under peer="other"
    monkeypatch.setattr(readings, "_labels", {})
    a, b, lst = make_pair(slots=2, slot_size=1024)
    try:
        a.send_batch([MSG]).wait()
        assert len(b.recv_batch(timeout=10)) == 1
        assert a.stats()["credit_wait_seconds"] == 0.0      # it fit: no wait, no time
        ready = threading.Event()
        reader = late_reader(b, 6, ready)
        t0 = time.perf_counter()
        ready.set()
        a.send_batch([MSG] * 6, timeout=10).wait(10)      # 2 fit, 4 wait for the reader
        took = time.perf_counter() - t0
        reader.join(10)
        s = a.stats()
        assert s["credit_waits"] >= 1
        assert HOLD * 0.8 <= s["credit_wait_seconds"] <= took
        assert b.stats()["credit_wait_seconds"] == 0.0      # it only received
        row = readings.read().channels[("shm", lst.address)]
        assert row["rdmamw_credit_wait_seconds_total"] == s["credit_wait_seconds"]
    finally:
        a.close()
        b.close()
        lst.close()


def test_an_awaited_send_counts_its_wait_too():
    a, b, lst = make_pair(slots=2, slot_size=1024)
    ready = threading.Event()
    reader = late_reader(b, 6, ready)

    async def send() -> float:
        ch = aio.Channel(a)
        t0 = time.perf_counter()
        ready.set()
        await ch.send_batch([MSG] * 6)
        return time.perf_counter() - t0

    try:
        took = asyncio.run(send())
        reader.join(10)
        s = a.stats()
        assert s["credit_waits"] >= 1
        assert HOLD * 0.8 <= s["credit_wait_seconds"] <= took
    finally:
        a.close()
        b.close()
        lst.close()
