"""The memory pieces seen through a Channel: stats() keys, the pool behind recv_batch,
thresholds.lookup behind rendezvous="auto"."""

from __future__ import annotations

import numpy as np
import pytest

from rdmamw.memory import pool as poolmod
from rdmamw.memory import thresholds
from rdmamw.memory.regcache import RegCache
from tests.conftest import make_pair


@pytest.fixture
def fresh_pool(monkeypatch):
    p = poolmod.BufferPool(shards=1)
    monkeypatch.setattr(poolmod, "_default", p)
    return p


def test_large_messages_without_a_destination_come_from_the_pool(fresh_pool):
    a, b, lst = make_pair(slots=8, slot_size=4096, rendezvous="read")
    try:
        x = np.arange(100_000, dtype=np.uint8)
        for _ in range(5):
            h = a.send_batch([x])
            (m,) = b.recv_batch(timeout=10)
            assert np.array_equal(np.frombuffer(m, np.uint8), x)
            del m                                   # back to the pool
            h.wait(timeout=10)
        s = b.stats()
        assert s["pool_acquires"] == 5 and s["pool_reuses"] == 4
        assert s["pool_bytes"] == 256 << 10         # one buffer of the 256 KiB tier
    finally:
        a.close()
        b.close()
        lst.close()


def test_stats_merge_the_registration_cache_of_the_channel(fresh_pool):
    a, b, lst = make_pair(slots=8, slot_size=4096)
    try:
        assert a.stats()["registrations"] == 0 and a.stats()["bytes_pinned"] == 0
        log = []
        a.regcache = RegCache(lambda addr, n: log.append(n) or len(log), lambda h: None)
        buf = np.zeros(1 << 20, np.uint8)
        for _ in range(3):
            a.regcache.acquire(buf).release()
        s = a.stats()
        assert (s["registrations"], s["regcache_hits"], s["bytes_pinned"]) == (1, 2, 1 << 20)
        assert s["messages"] == 0                   # the engine's counters are still there
    finally:
        a.close()
        b.close()
        lst.close()


def test_auto_uses_the_tuned_threshold(tmp_path, monkeypatch):
    monkeypatch.setenv(thresholds.FILE_ENV, str(tmp_path / "t.json"))
    thresholds.save("shm", "read", 1000)
    a, b, lst = make_pair(slots=8, slot_size=4096, rendezvous="auto")
    try:
        assert (a.rendezvous, a.rndv_threshold) == ("read", 1000)
        h = a.send_batch([bytes(999), bytes(1001)])
        got = []
        while len(got) < 2:
            got += [len(m) for m in b.recv_batch(timeout=10)]
        h.wait(timeout=10)
        assert got == [999, 1001] and a.stats()["rndv_sends"] == 1
    finally:
        a.close()
        b.close()
        lst.close()
