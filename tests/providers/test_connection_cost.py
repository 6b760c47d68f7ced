"""What a channel costs a process (issue 14). shm: with CMA both ways (the usual case) a
channel maps its own block and the peer's, and no staging area; the staging areas (1 GiB
of virtual size each) exist only where one side cannot CMA the other. tcp: the ring a
peer writes into is committed as frames land, so an idle channel costs no resident
ring."""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import rdmamw
from tests.support.helpers import make_pair, unique_name

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")


def _vm_kib(key: str = "VmSize") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key}")


def _accessible_mib() -> float:
    """Virtual size of the mappings that can be used (malloc's reserved, inaccessible
    arena space of a new thread, 64 MiB a time, is not a channel's cost)."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms[:3] != "---":
            lo, hi = (int(x, 16) for x in span.split("-"))
            total += hi - lo
    return total / (1 << 20)


def _staging_maps() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines()
            if "rdmamw-stage-" in line]


def test_a_channel_with_cma_maps_no_staging_area(monkeypatch):
    """Five channels to one listener, opened from one thread and accepted by one
    other (so no new thread's stack or malloc arena is counted): the last four add
    less than 2 x 32 MiB each (both endpoints live in this process)."""
    monkeypatch.delenv("RDMAMW_SHM_CMA", raising=False)
    name = f"shm://{unique_name('cost')}"
    pairs = []
    with rdmamw.listen(name) as lst, ThreadPoolExecutor(1) as pool:   # the default ring
        def pair():
            accepted = pool.submit(lst.accept, 10)
            pairs.append((rdmamw.Channel.open(name, timeout=10), accepted.result(10)))
        try:
            pair()
            before = _accessible_mib()
            for _ in range(4):
                pair()
            per_pair_mib = (_accessible_mib() - before) / 4
            assert _staging_maps() == []
            # each endpoint maps its block and the peer's (8 MiB rings) and keeps a
            # staging copy of the peer's ring
            assert per_pair_mib < 2 * 32, f"a channel pair costs {per_pair_mib:.0f} MiB"
            a, b = pairs[-1]
            x = np.arange(1 << 20, dtype=np.uint8)          # rendezvous still works (CMA)
            a.send(x)
            assert np.array_equal(np.frombuffer(b.recv(timeout=10), np.uint8), x)
        finally:
            for a, b in pairs:
                a.close(), b.close()


def test_without_cma_the_staging_areas_are_mapped_and_used(monkeypatch):
    monkeypatch.setenv("RDMAMW_SHM_CMA", "0")
    monkeypatch.setenv("RDMAMW_SHM_STAGING", "64M")
    a, b, lst = make_pair(slots=8, slot_size=4096)
    with lst, a, b:
        maps = _staging_maps()
        # each side stages for the other, and maps the other's read-only
        assert len(maps) == 4, maps
        x = np.arange(3 << 20, dtype=np.uint8)
        a.send(x)
        assert np.array_equal(np.frombuffer(b.recv(timeout=10), np.uint8), x)
    del a, b
    gc.collect()
    assert _staging_maps() == []


def test_an_idle_tcp_channel_keeps_no_resident_ring():
    """Four tcp channel pairs with the default 8 MiB rings (after one to warm up): the
    process's resident memory grows by far less than the rings (it used to be 16 MiB a
    pair: every ring was zeroed by hand)."""
    name = "tcp://127.0.0.1:0"
    pairs = []
    with rdmamw.listen(name) as lst, ThreadPoolExecutor(1) as pool:
        def pair():
            accepted = pool.submit(lst.accept, 10)
            pairs.append((rdmamw.Channel.open(lst.address, timeout=10), accepted.result(10)))
        try:
            pair()
            before = _vm_kib("VmRSS")
            for _ in range(4):
                pair()
            per_pair_mib = (_vm_kib("VmRSS") - before) / 1024 / 4
            assert per_pair_mib < 4, f"a tcp pair holds {per_pair_mib:.1f} MiB resident"
            a, b = pairs[-1]
            a.send(b"still works")
            assert bytes(b.recv(timeout=10)) == b"still works"
        finally:
            for a, b in pairs:
                a.close(), b.close()
