"""The registration cache (rdmamw/memory/regcache.py): unit tests and a hypothesis
state machine against a simple model of which memory is alive."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from rdmamw.errors import ConfigError, RegistrationError
from rdmamw.memory import regcache
from rdmamw.memory.buffer import owner, span
from rdmamw.memory.regcache import RegCache


class FakeProvider:
    """register/deregister that remember what is registered, and refuse misuse."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int]] = {}
        self.next = 1
        self.calls = 0

    def register(self, addr: int, length: int) -> int:
        assert length > 0
        h, self.next = self.next, self.next + 1
        self.live[h] = (addr, length)
        self.calls += 1
        return h

    def deregister(self, h: int) -> None:
        assert h in self.live, f"deregistered {h} twice or never registered"
        del self.live[h]

    def bytes(self) -> int:
        return sum(n for _, n in self.live.values())


def cache(max_bytes: int = 1 << 20) -> tuple[RegCache, FakeProvider]:
    p = FakeProvider()
    return RegCache(p.register, p.deregister, max_bytes=max_bytes), p


def test_repeated_send_of_one_buffer_registers_once():
    c, p = cache()
    a = np.ones(1 << 16, np.float32)
    for _ in range(10):
        with c.acquire(a) as lease:
            assert p.live[lease.handle] == span(a)
    s = c.stats()
    assert (p.calls, s["registrations"], s["hits"], s["misses"]) == (1, 1, 9, 1)
    assert s["bytes_pinned"] == a.nbytes


def test_slices_and_views_hit_the_owner_registration():
    c, p = cache()
    a = np.zeros(4096, np.uint8)
    with c.acquire(a):
        pass
    for view in (a[100:200], memoryview(a)[7:], np.frombuffer(a, np.uint8)[1:],
                 a.reshape(64, 64)[10:20]):
        with c.acquire(view) as lease:
            assert lease.offset == span(view)[0] - span(a)[0]
            assert lease.length == span(view)[1]
    assert p.calls == 1 and c.stats()["hits"] == 4


def test_exact_registers_the_view_alone_and_hits_it_again():
    """A remote region on a device that does not check a window's bounds: its
    registration is what bounds a peer, so it is the view's range, not the owner's."""
    c, p = cache()
    a = np.zeros(4096, np.uint8)
    view = a[100:200]
    with c.acquire(view, exact=True) as lease:
        assert p.live[lease.handle] == span(view)
        assert (lease.offset, lease.length) == (0, 100)
    with c.acquire(view, exact=True) as lease:           # exposed to a second peer
        assert p.live[lease.handle] == span(view)
    with c.acquire(view) as lease:                       # not exact: the owner's
        assert p.live[lease.handle] == span(a)
    assert (p.calls, c.stats()["hits"]) == (2, 1)


def test_freed_numpy_buffer_is_deregistered_at_once_and_never_hit():
    c, p = cache()
    a = np.zeros(1 << 16, np.uint8)
    addr = span(a)[0]
    with c.acquire(a) as lease:
        h = lease.handle
    del a, lease
    assert h not in p.live and c.stats()["invalidations"] == 1
    assert c.find(addr, 1) is None and len(c) == 0
    b = np.zeros(1 << 16, np.uint8)     # often the same address again
    with c.acquire(b) as lease:
        assert lease.handle != h
    assert c.stats()["misses"] == 2


def test_buffer_in_use_stays_alive_and_registered():
    c, p = cache()
    a = np.zeros(1 << 16, np.uint8)
    ref = weakref.ref(a)
    lease = c.acquire(a[10:])
    del a
    gc.collect()
    assert ref() is not None and lease.handle in p.live      # the lease keeps it
    lease.release()
    assert ref() is None and lease.handle not in p.live and c.stats()["bytes_pinned"] == 0


def test_objects_without_weakrefs_are_held_until_evicted():
    c, p = cache(max_bytes=7000)
    b = bytearray(1000)
    with c.acquire(b):
        pass
    with pytest.raises(BufferError):        # held, not exported: resizing is allowed...
        with c.acquire(b):
            b.extend(b"x")                  # ...but not while a lease exports it
    b.extend(b"x" * 5000)                   # the memory moved
    with c.acquire(b) as lease:
        assert p.live[lease.handle] == span(b)
    s = c.stats()
    assert s["invalidations"] == 1 and s["registrations"] == 2 and len(p.live) == 1
    with c.acquire(bytes(1200)):            # needs room: b's idle entry is evicted
        pass
    assert c.stats()["evictions"] == 1 and p.bytes() <= 7000


def test_lru_bound_by_bytes_evicts_least_recently_used():
    c, p = cache(max_bytes=3 * 4096)
    bufs = [np.zeros(4096, np.uint8) for _ in range(4)]
    for b in bufs[:3]:
        c.acquire(b).release()
    c.acquire(bufs[0]).release()            # 0 is now most recent; 1 is the LRU
    c.acquire(bufs[3]).release()
    assert [a for a, _, _ in c.entries()] == [span(b)[0] for b in (bufs[2], bufs[0], bufs[3])]
    assert c.stats()["evictions"] == 1 and p.bytes() == 3 * 4096


def test_entries_in_use_are_not_evicted_and_bound_returns_after_release():
    c, p = cache(max_bytes=8192)
    bufs = [np.zeros(4096, np.uint8) for _ in range(3)]
    leases = [c.acquire(b) for b in bufs]
    assert all(lz.handle in p.live for lz in leases) and p.bytes() == 3 * 4096
    for lz in leases:
        lz.release()
    assert p.bytes() <= 8192


def test_larger_than_the_cache_is_registered_per_use():
    c, p = cache(max_bytes=1024)
    a = np.zeros(4096, np.uint8)
    for _ in range(2):
        with c.acquire(a) as lease:
            assert lease.handle in p.live
        assert not p.live
    assert c.stats()["uncached"] == 2 and len(c) == 0


def test_a_slice_of_an_owner_larger_than_the_cache_registers_only_the_slice():
    c, p = cache(max_bytes=1024)
    a = np.zeros(1 << 20, np.uint8)
    with c.acquire(a[4096:4096 + 512]) as lease:
        assert p.live[lease.handle] == (a.ctypes.data + 4096, 512)
        assert lease.offset == 0
    assert not p.live and len(c) == 0
    with c.acquire(a[:512]) as lease:                   # fits the cache, the owner does not
        assert p.live[lease.handle][1] == 512
    assert c.stats()["uncached"] == 2


def test_max_bytes_zero_disables_caching():
    c, p = cache(max_bytes=0)
    a = np.zeros(100, np.uint8)
    c.acquire(a).release()
    c.acquire(a).release()
    assert p.calls == 2 and not p.live


def test_explicit_invalidate_and_clear_and_close():
    c, p = cache()
    a, b = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
    c.acquire(a).release()
    c.acquire(b).release()
    assert c.invalidate(a[3:]) and not c.invalidate(a)
    assert len(p.live) == 1
    lease = c.acquire(a)
    c.close()
    assert list(p.live) == [lease.handle]   # in use: deregistered on release
    lease.release()
    assert not p.live
    with pytest.raises(RegistrationError, match="closed"):
        c.acquire(b)


def test_bad_buffers_and_double_release_are_typed_errors():
    c, p = cache()
    with pytest.raises(RegistrationError, match="contiguous"):
        c.acquire(np.zeros((10, 10))[:, 1])
    with pytest.raises(RegistrationError, match="empty"):
        c.acquire(b"")
    with pytest.raises(RegistrationError, match="buffer protocol"):
        c.acquire(12)
    lease = c.acquire(b"abc")
    lease.release()
    with pytest.raises(RegistrationError, match="twice"):
        lease.release()
    assert len(p.live) == 1 and len(c) == 1      # the bytes object stays cached


def test_register_failure_caches_nothing():
    def refuse(addr, length):
        raise OSError(12, "ibv_reg_mr failed")
    c = RegCache(refuse, lambda h: None, max_bytes=1 << 20)
    with pytest.raises(OSError):
        c.acquire(np.zeros(10))
    assert len(c) == 0 and c.stats()["bytes_pinned"] == 0


def test_max_bytes_from_the_environment(monkeypatch):
    monkeypatch.setenv(regcache.MAX_BYTES_ENV, "64M")
    assert RegCache(int, print).max_bytes == 64 << 20
    monkeypatch.setenv(regcache.MAX_BYTES_ENV, "lots")
    with pytest.raises(ConfigError, match=regcache.MAX_BYTES_ENV):
        RegCache(int, print)


def test_owner_follows_views_to_the_memory():
    a = np.zeros(10)
    assert owner(a[2:][1:]) is a and owner(memoryview(a)[1:]) is a
    b = bytearray(10)
    assert owner(np.frombuffer(b, np.uint8)[2:]) is b


def test_threads_share_one_cache():
    c, p = cache(max_bytes=64 * 1024)
    bufs = [np.zeros(4096, np.uint8) for _ in range(32)]
    errors = []

    def worker(k: int) -> None:
        try:
            for i in range(300):
                b = bufs[(i * 7 + k) % len(bufs)]
                with c.acquire(b[k:]) as lease:
                    assert p.live[lease.handle] == span(b)
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    s = c.stats()
    assert s["hits"] + s["misses"] == 1200 and p.bytes() == s["bytes_pinned"] <= 64 * 1024


# ---- the state machine ------------------------------------------------------------------

MAX = 48 * 1024


class CacheMachine(RuleBasedStateMachine):
    """Buffers come and go (numpy arrays freed, bytearrays grown), leases are taken
    on slices and released in any order. The model: which memory is alive now. The
    bundles hold tokens, so dropping a buffer from ``self.held`` really frees it."""

    buffers = Bundle("buffers")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.p = FakeProvider()
        self.c = RegCache(self._register, self.p.deregister, max_bytes=MAX)
        self.arrays: dict[int, weakref.ref] = {}     # handle -> the numpy owner registered
        self.held: dict[int, np.ndarray | bytearray] = {}
        self.tokens = 0

    def _register(self, addr: int, length: int) -> int:
        h = self.p.register(addr, length)
        for b in self.held.values():
            if isinstance(b, np.ndarray) and span(b) == (addr, length):
                self.arrays[h] = weakref.ref(b)
        return h

    @rule(target=buffers, n=st.integers(1, 24 * 1024), kind=st.sampled_from(["np", "ba"]))
    def allocate(self, n, kind):
        self.tokens += 1
        self.held[self.tokens] = np.full(n, 1, np.uint8) if kind == "np" else bytearray(n)
        return self.tokens

    @rule(target=leases, t=buffers, data=st.data())
    def acquire(self, t, data):
        b = self.held.get(t)
        if b is None:
            return None
        n = len(b)
        lo = data.draw(st.integers(0, n - 1))
        hi = data.draw(st.integers(lo + 1, n))
        view = memoryview(b)[lo:hi]
        part = span(view)
        lease = self.c.acquire(view)
        view.release()
        reg = self.p.live[lease.handle]
        # the owner's whole range, or for an owner larger than the cache only the part
        want = span(b) if span(b)[1] <= MAX else part
        assert reg == want, "handed out a registration that is not the owner's now"
        assert reg[0] <= lease.addr and lease.addr + lease.length <= reg[0] + reg[1]
        return lease

    @rule(lease=consumes(leases))
    def release(self, lease):
        if lease is not None:
            lease.release()

    @rule(t=consumes(buffers))
    def free(self, t):
        self.held.pop(t, None)

    @rule(t=buffers, extra=st.integers(1, 40000))
    def grow(self, t, extra):
        b = self.held.get(t)
        if isinstance(b, bytearray):
            try:
                b.extend(bytes(extra))      # moves the memory (refused while exported)
            except BufferError:
                pass

    @invariant()
    def provider_matches_counters(self):
        assert self.p.bytes() == self.c.stats()["bytes_pinned"]

    @invariant()
    def idle_bytes_within_the_bound(self):
        idle = sum(n for _, n, used in self.c.entries() if not used)
        assert idle <= MAX

    @invariant()
    def freed_arrays_are_not_registered(self):
        self.c.stats()                      # drains a callback that found the cache busy
        for h in self.p.live:
            ref = self.arrays.get(h)
            assert ref is None or ref() is not None, "a freed array is still registered"

    @invariant()
    def fresh_entries_never_overlap(self):
        self.c.stats()
        fresh = sorted((e.addr, e.length) for e in list(self.c._table.values())
                       if not e.dead and RegCache._fresh(e))
        for (a1, n1), (a2, _) in zip(fresh, fresh[1:], strict=False):
            assert a1 + n1 <= a2

    def teardown(self):
        self.held.clear()


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
test_cache_state_machine = CacheMachine.TestCase


def test_torch_tensors_hit_by_storage_and_are_held():
    torch = pytest.importorskip("torch")
    c, p = cache()
    t = torch.zeros(4096)
    for view in (t.numpy(), t.numpy()[100:], t[10:20].numpy()):
        with c.acquire(view) as lease:
            assert p.live[lease.handle] == (t.data_ptr(), t.numel() * 4)
    assert c.stats()["registrations"] == 1 and c.stats()["hits"] == 2
    ptr = t.data_ptr()
    del t, view
    gc.collect()
    assert c.find(ptr, 16) is not None      # the cache holds the storage: still valid
    c.clear()
    assert not p.live


def test_release_and_free_inside_the_cache_own_call_do_not_deadlock():
    """The garbage collector may run a lease's __del__ or a weakref callback while this
    thread is inside the cache (here: inside register): the work waits for the lock's
    release instead of deadlocking."""
    p = FakeProvider()
    held = {}

    def register(addr, length):
        if "lease" in held:
            held.pop("lease").release()     # as a collected lease would
            held.pop("array")               # its array is freed too
        return p.register(addr, length)

    c = RegCache(register, p.deregister, max_bytes=1 << 20)
    held["array"] = np.zeros(1000, np.uint8)
    held["lease"] = c.acquire(held["array"])
    first = next(iter(p.live))
    other = np.zeros(2000, np.uint8)
    with c.acquire(other):
        pass
    s = c.stats()
    assert first not in p.live and s["invalidations"] == 1 and s["bytes_pinned"] == 2000


# ---- a provider's pinned budget full: the cache's own idle entries go first ---------

def _budgeted(budget: int) -> tuple[RegCache, FakeProvider]:
    """A cache whose provider refuses past ``budget`` registered bytes (as verbs'
    RDMAMW_VERBS_PINNED_BYTES does), with a cache bound that does not stop it first."""
    p = FakeProvider()

    def register(addr: int, length: int) -> int:
        if p.bytes() + length > budget:
            raise RegistrationError("past the pinned budget")
        return p.register(addr, length)

    return RegCache(register, p.deregister, max_bytes=1 << 30), p


def test_a_refused_registration_lets_idle_entries_go_lru_first_and_is_tried_again():
    c, p = _budgeted(3 * 4096)
    bufs = [np.zeros(4096, np.uint8) for _ in range(3)]
    for b in bufs:
        c.acquire(b).release()
    held = c.acquire(bufs[0])               # in use (and now the most recent): stays
    new = np.zeros(4096, np.uint8)
    with c.acquire(new) as lease:
        assert p.live[lease.handle] == span(new)
    # only the least recently used idle entry (bufs[1]) went: 4096 bytes were enough
    assert [a for a, _, _ in c.entries()] == [span(b)[0] for b in (bufs[2], bufs[0], new)]
    assert c.stats()["evictions"] == 1 and p.bytes() == 3 * 4096
    # every entry in use: nothing to let go, the provider's error comes through, and
    # nothing cached changed
    leases = [c.acquire(b) for b in (bufs[2], new)]
    with pytest.raises(RegistrationError, match="past the pinned budget"):
        c.acquire(np.zeros(4096, np.uint8))
    assert [a for a, _, _ in c.entries()] == [span(b)[0] for b in (bufs[0], bufs[2], new)]
    assert c.stats()["evictions"] == 1 and p.bytes() == 3 * 4096
    held.release()
    for lease in leases:
        lease.release()


def test_a_cache_of_a_provider_with_a_pinned_budget_keeps_a_quarter_of_it(monkeypatch):
    from rdmamw.channel import channel
    from rdmamw.providers import provider

    monkeypatch.setenv("RDMAMW_REGCACHE_BYTES", "1G")
    fake = type("P", (), {"pinned_budget": staticmethod(lambda: 400 << 20)})()
    monkeypatch.setattr(channel, "provider", lambda scheme: fake)
    assert channel._cache_bytes("verbs") == 100 << 20
    monkeypatch.setenv("RDMAMW_REGCACHE_BYTES", "64M")      # the setting is smaller
    assert channel._cache_bytes("verbs") == 64 << 20
    monkeypatch.setattr(channel, "provider", provider)      # shm: no budget to keep
    assert channel._cache_bytes("shm") == 64 << 20
