"""Buffer pools (rdmamw/memory/pool.py): tiers, shards, bounds, counters, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rdmamw.errors import ConfigError, RegistrationError
from rdmamw.memory import pool as poolmod
from rdmamw.memory.pool import BufferPool

KiB = 1024


class Provider:
    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int]] = {}
        self.n = 0
        self.lock = threading.Lock()

    def register(self, addr: int, length: int) -> int:
        with self.lock:
            self.n += 1
            self.live[self.n] = (addr, length)
            return self.n

    def deregister(self, h: int) -> None:
        with self.lock:
            del self.live[h]


def make(max_bytes=1 << 20, shards=1, tiers=(4 * KiB, 16 * KiB, 64 * KiB)):
    p = Provider()
    return BufferPool(tiers, max_bytes=max_bytes, shards=shards, register=p.register,
                      deregister=p.deregister), p


def test_smallest_tier_registered_once_and_reused():
    pool, p = make()
    with pool.acquire(5000) as b:
        assert len(b) == 5000 and b.capacity == 16 * KiB and b.address % 4096 == 0
        assert p.live[b.handle] == (b.address, 16 * KiB)
        b.view[:] = 7
        first = b.handle
    for n in (4097, 16 * KiB, 9000):
        with pool.acquire(n) as b:
            assert b.handle == first and len(b.view) == n
    s = pool.stats()
    assert (s["acquires"], s["allocations"], s["reuses"], p.n) == (4, 1, 3, 1)
    assert s["bytes_pooled"] == s["bytes_idle"] == 16 * KiB


def test_concurrent_buffers_are_distinct_and_writable():
    pool, _ = make()
    bufs = [pool.acquire(3000) for _ in range(5)]
    for i, b in enumerate(bufs):
        b.view[:] = i
    assert [int(b.view[0]) for b in bufs] == [0, 1, 2, 3, 4]
    assert len({b.address for b in bufs}) == 5
    for b in bufs:
        b.release()
    assert pool.stats()["bytes_idle"] == 5 * 4 * KiB


def test_bound_frees_idle_buffers_of_other_tiers_then_overflows():
    pool, p = make(max_bytes=80 * KiB)
    pool.acquire(16 * KiB).release()
    pool.acquire(4 * KiB).release()             # 20 KiB pooled, all idle
    big = pool.acquire(64 * KiB)                # needs 64: frees the idle 16 KiB one
    assert pool.stats()["evictions"] == 1 and pool.stats()["bytes_pooled"] == 68 * KiB
    over = pool.acquire(64 * KiB)               # no room left: a one-off buffer
    assert pool.stats()["overflows"] == 1
    n_live = len(p.live)
    over.release()
    assert len(p.live) == n_live - 1            # freed at once, not pooled
    big.release()
    assert pool.stats()["bytes_pooled"] <= 80 * KiB


def test_larger_than_every_tier_is_a_one_off():
    pool, p = make()
    with pool.acquire(100 * KiB) as b:
        assert len(b) == 100 * KiB and b.handle in p.live
    assert not p.live and pool.stats()["overflows"] == 1


def test_double_release_and_bad_sizes_are_typed_errors(monkeypatch):
    pool, _ = make()
    b = pool.acquire(10)
    b.release()
    with pytest.raises(RegistrationError, match="twice"):
        b.release()
    with pytest.raises(RegistrationError):
        pool.acquire(-1)
    with pytest.raises(ConfigError):
        BufferPool((4096, 1024))
    monkeypatch.setenv(poolmod.POOL_SHARDS_ENV, "many")
    with pytest.raises(ConfigError, match=poolmod.POOL_SHARDS_ENV):
        BufferPool()
    monkeypatch.setenv(poolmod.POOL_SHARDS_ENV, "3")
    monkeypatch.setenv(poolmod.POOL_BYTES_ENV, "12M")
    s = BufferPool().stats()
    assert (s["shards"], s["max_bytes"]) == (3, 12 << 20)


def test_trim_and_close_deregister_everything():
    pool, p = make()
    out = pool.acquire(100)
    pool.acquire(20 * KiB).release()
    assert pool.trim() == 64 * KiB and len(p.live) == 1
    pool.close()
    out.release()
    assert not p.live and pool.stats()["bytes_pooled"] == 0
    with pytest.raises(RegistrationError, match="closed"):
        pool.acquire(1)


def test_threads_get_their_own_shards_and_never_share_a_buffer():
    pool, p = make(max_bytes=4 << 20, shards=4)
    errors, used = [], []

    def worker(k: int) -> None:
        try:
            mine = set()
            for i in range(400):
                with pool.acquire(1000 + (i * 997) % 60000) as b:
                    b.view[:] = k
                    mine.add(b.handle)
                    assert np.all(b.view == k)          # nobody else wrote into it
            used.append(mine)
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for i in range(4):                                  # one shard per thread
        for j in range(i + 1, 4):
            assert not used[i] & used[j]
    s = pool.stats()
    assert s["acquires"] == 1600 and s["allocations"] <= 12 and s["overflows"] == 0
    assert s["registrations"] - s["deregistrations"] == len(p.live)


def test_release_from_another_thread_goes_back_to_its_shard():
    pool, _ = make(shards=2)
    b = pool.acquire(100)
    h = b.handle
    t = threading.Thread(target=b.release)
    t.start()
    t.join()
    with pool.acquire(100) as again:
        assert again.handle == h


def test_allocate_returns_to_the_default_pool_when_collected(monkeypatch):
    monkeypatch.setattr(poolmod, "_default", BufferPool(shards=1))
    a = poolmod.allocate(5000)
    assert a.nbytes == 5000 and a.flags.writeable
    a[:] = 3
    addr = a.__array_interface__["data"][0]
    view = a[10:]                           # a view keeps the memory out of the pool
    del a
    b = poolmod.allocate(5000)
    assert b.__array_interface__["data"][0] != addr
    del b
    c = poolmod.allocate(6000)              # same tier: b's buffer again
    assert c.__array_interface__["data"][0] != addr
    del c, view
    d = poolmod.allocate(7000)              # the view is gone: the first buffer is free
    assert d.__array_interface__["data"][0] == addr
    assert poolmod.default_pool().stats()["reuses"] == 2


def test_channel_stats_merges_cache_and_pool():
    from rdmamw.memory.counters import channel_stats
    from rdmamw.memory.regcache import RegCache
    pool, _ = make()
    p = Provider()
    cache = RegCache(p.register, p.deregister, max_bytes=1 << 20)
    a = np.zeros(1000, np.uint8)
    cache.acquire(a).release()
    cache.acquire(a).release()
    pool.acquire(100).release()
    s = channel_stats(cache, pool)
    assert s["registrations"] == 2 and s["regcache_hits"] == 1 and s["regcache_misses"] == 1
    assert s["bytes_pinned"] == 1000 + 4 * KiB and s["pool_acquires"] == 1
    default = poolmod._default.stats()["registrations"] if poolmod._default else 0
    assert channel_stats(None, None)["registrations"] == default   # the process-wide pool's


def test_a_buffer_returned_inside_the_pool_own_call_does_not_deadlock():
    """allocate()'s finalizer may run (garbage collector) while this thread is inside
    the pool: the return must not wait for a lock this thread holds."""
    held = {}
    p = Provider()

    def register(addr, length):
        if "buf" in held:
            held.pop("buf").release()
        return p.register(addr, length)

    pool = BufferPool((4 * KiB, 16 * KiB), max_bytes=1 << 20, shards=1,
                      register=register, deregister=p.deregister)
    held["buf"] = pool.acquire(100)
    with pool.acquire(10 * KiB):            # a new block: register runs under the lock
        pass
    s = pool.stats()
    assert s["bytes_idle"] == 20 * KiB and s["allocations"] == 2


def test_a_pool_without_registration_counts_none():
    from rdmamw.memory.counters import channel_stats
    pool = BufferPool((4 * KiB,), max_bytes=1 << 20, shards=1)
    pool.acquire(100).release()
    s = pool.stats()
    assert not pool.registering and s["registrations"] == 0 and s["allocations"] == 1
    assert channel_stats(None, pool)["bytes_pinned"] == 0
    assert channel_stats(None, pool)["pool_bytes"] == 4 * KiB
