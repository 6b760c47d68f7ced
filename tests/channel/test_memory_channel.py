"""The memory pieces seen through a Channel: stats() keys, the pool behind recv_batch,
thresholds.lookup behind rendezvous="auto"."""

from __future__ import annotations

import numpy as np
import pytest

from rdmamw.memory import pool as poolmod
from rdmamw.memory import thresholds
from rdmamw.memory.regcache import RegCache
from tests.support.helpers import NO_DEVICE, VERBS_OK, make_pair


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


# ---- verbs: the registration caches on the rendezvous path (soft-RoCE VM) ----------

verbs = pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE)
MiB = 1 << 20


@pytest.fixture
def own_caches(monkeypatch):
    """Channels that register for themselves (RDMAMW_VERBS_WINDOWS=0: a protection
    domain per channel, so caches per channel, closed with it): the counts below are
    one channel's. The process-wide caches of windowed channels are tested after."""
    monkeypatch.setenv("RDMAMW_VERBS_WINDOWS", "0")


def _verbs_pair(strategy="read"):
    return make_pair(slots=8, slot_size=4096, provider="verbs", rendezvous=strategy)


@pytest.mark.device
@verbs
@pytest.mark.parametrize("strategy", ["read", "write"])
def test_verbs_repeated_send_of_one_buffer_registers_it_once(fresh_pool, own_caches, strategy):
    """The issue's check: the same 4 MiB buffer sent n times is registered once (one
    MR, kept: the same rkey every time), each later send is a cache hit; so is the
    buffer the receiver READs into ("read"). With "write" the sender WRITEs from the
    cached MR into the buffer the receiver posted (exposed for that message only: a
    cached remote-write registration would leave it writable by the peer)."""
    n = 6
    a, b, lst = _verbs_pair(strategy)
    try:
        src = np.arange(4 * MiB // 8, dtype=np.uint64).view(np.uint8)
        dst = np.zeros(4 * MiB, np.uint8)
        for k in range(n):
            src[:8] = k                             # read at each send, not at registration
            if strategy == "write":
                b.post_recv(dst)
            h = a.send(src)
            if strategy == "write":
                b.recv(timeout=60).release()
            else:
                assert b.recv_into(dst, timeout=60) == src.nbytes
            h.wait(timeout=60)
            assert np.array_equal(dst, src)
        s, r = a.stats(), b.stats()
        assert (s["registrations"], s["regcache_misses"], s["regcache_hits"]) == (1, 1, n - 1)
        assert s["bytes_pinned"] == 4 * MiB and s["deregistrations"] == 0
        assert a.regcache.entries() == [(src.ctypes.data, 4 * MiB, False)]   # idle, kept
        assert s["rndv_sends"] == n
        if strategy == "write":
            assert s["rndv_writes"] == n and r["registrations"] == 0
        else:
            assert r["rndv_reads"] == n
            assert (r["registrations"], r["regcache_hits"]) == (1, n - 1)
    finally:
        a.close(), b.close(), lst.close()
    assert a.stats()["deregistrations"] == 1 and a.stats()["bytes_pinned"] == 0


@pytest.mark.device
@verbs
def test_verbs_cached_mr_outlives_clear_while_the_read_is_pending(fresh_pool, own_caches):
    """A source is leased until its done bit: dropping the cache's entries meanwhile
    (eviction, clear) leaves its MR registered, so the peer's READ still works; it is
    deregistered once the send completes."""
    a, b, lst = _verbs_pair()
    try:
        src = np.full(2 * MiB, 7, np.uint8)
        h = a.send(src)
        assert a.regcache.entries() == [(src.ctypes.data, 2 * MiB, True)]
        a.regcache.clear()                          # nothing idle to drop: still leased
        assert a.stats()["deregistrations"] == 0 and a.stats()["bytes_pinned"] == 2 * MiB
        a.regcache.invalidate(src)                  # marked dead, still not deregistered
        assert a.stats()["deregistrations"] == 0
        m = b.recv(timeout=60)
        assert np.array_equal(np.frombuffer(m, np.uint8), src)
        h.wait(timeout=60)
        assert a.stats()["deregistrations"] == 1 and a.stats()["bytes_pinned"] == 0
    finally:
        a.close(), b.close(), lst.close()


@pytest.mark.device
@verbs
def test_verbs_freed_buffer_drops_its_mr_and_a_new_one_is_registered(fresh_pool, own_caches):
    """A buffer the user frees takes its MR with it (weak reference): the next buffer,
    maybe at the same address, gets a registration of its own, never the stale one."""
    a, b, lst = _verbs_pair()
    try:
        for k in range(3):
            src = np.full(2 * MiB, k + 1, np.uint8)
            h = a.send(src)
            m = b.recv(timeout=60)
            assert np.array_equal(np.frombuffer(m, np.uint8), src)
            del m
            h.wait(timeout=60)
            del src, h                              # freed: the entry goes at once
            s = a.stats()
            assert s["registrations"] == k + 1 and s["deregistrations"] == k + 1
            assert s["regcache_invalidations"] == k + 1 and s["bytes_pinned"] == 0
        assert a.stats()["regcache_hits"] == 0
    finally:
        a.close(), b.close(), lst.close()


@pytest.mark.device
@verbs
def test_verbs_cache_off_registers_per_send(fresh_pool, own_caches, monkeypatch):
    """RDMAMW_REGCACHE_BYTES=0: every send registers and deregisters (the old way)."""
    monkeypatch.setenv("RDMAMW_REGCACHE_BYTES", "0")
    a, b, lst = _verbs_pair()
    try:
        src = np.ones(2 * MiB, np.uint8)
        for _ in range(3):
            h = a.send(src)
            b.recv(timeout=60)
            h.wait(timeout=60)
        s = a.stats()
        assert (s["registrations"], s["deregistrations"], s["regcache_hits"]) == (3, 3, 0)
    finally:
        a.close(), b.close(), lst.close()



@pytest.mark.device
@verbs
def test_verbs_one_buffer_sent_to_several_peers_is_registered_once(fresh_pool):
    """With memory windows (the default) every channel of the process is on one
    protection domain and shares its registration caches: a 4 MiB array sent to four
    peers is registered once (one MR; each peer READs it through a window of its own,
    bound to its queue pair for that message only), and stays registered after the
    channels close (the caches live as long as the process)."""
    pairs = [_verbs_pair() for _ in range(4)]
    src = np.arange(4 * MiB // 8, dtype=np.uint64).view(np.uint8)
    cache = pairs[0][0].regcache
    try:
        assert all(a.regcache is cache and b.regcache is cache for a, b, _ in pairs)
        before = cache.stats()
        for a, b, _ in pairs:
            h = a.send(src)
            m = b.recv(timeout=60)
            assert np.array_equal(np.frombuffer(m, np.uint8), src)
            h.wait(timeout=60)
        after = cache.stats()
        assert after["registrations"] - before["registrations"] == 1
        assert after["hits"] - before["hits"] == 3
        assert (src.ctypes.data, 4 * MiB, False) in cache.entries()
    finally:
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()
    assert (src.ctypes.data, 4 * MiB, False) in cache.entries()
    del src                         # freed: its MR goes with it
    assert cache.stats()["deregistrations"] - before["deregistrations"] == 1
