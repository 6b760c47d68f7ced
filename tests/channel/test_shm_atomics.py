"""Atomics on shm (docs/remote-memory.md, "shm atomics"): a region in memory from
rdmamw.memory.shared() is mapped by the peer, whose fetch_add / compare_swap are CPU
atomics on the owner's words; any other buffer is refused; a revoke ends them. The
atomics tests every provider shares are in test_remote_memory.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import rdmamw
import rdmamw.memory
from rdmamw.errors import ProviderUnavailable, RegionRevoked
from tests.support.helpers import LISTEN_ADDRESS, make_pair
from tests.support.regions import ROOT, WITH

#: a peer process (argv: address, n): takes the reference, waits for "go" (so both
#: peers run at once), runs n fetch_adds on word 0 and n compare_swap increments on
#: word 1, and sends back the old values it got
PEER = textwrap.dedent("""
    import sys, numpy as np, rdmamw
    ch = rdmamw.Channel.open(sys.argv[1], timeout=30)
    ref = bytes(ch.recv(timeout=30))
    ch.recv(timeout=60)
    n = int(sys.argv[2])
    adds = [ch.fetch_add(ref, 0, 1).wait() for _ in range(n)]
    swaps = []
    for _ in range(n):
        seen = ch.fetch_add(ref, 8, 0).wait()
        while (got := ch.compare_swap(ref, 8, seen, seen + 1).wait()) != seen:
            seen = got
        swaps.append(seen)
    ch.send(np.array(adds + swaps, np.uint64).tobytes())
    ch.recv(timeout=60)         # stay until the owner has looked
""")


def test_a_storm_from_two_processes_gives_the_exact_total():
    """Two peer processes update the same two words of the owner's shared memory at
    once: every old value handed out once, both words at the exact total, the word
    between them untouched (the region starts 64 bytes into its memfd)."""
    n = 50000
    addr = LISTEN_ADDRESS["shm"]()
    lst = rdmamw.listen(addr)
    procs = [subprocess.Popen([sys.executable, "-c", PEER, lst.address, str(n)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT}) for _ in range(2)]
    chans = []
    try:
        mem = rdmamw.memory.shared(4096).view(np.uint64)
        words = mem[8:11]
        words[:] = [0, 0, 0xABCDEF]
        for _ in procs:
            ch = lst.accept(timeout=60)
            chans.append(ch)
            ch.send(bytes(ch.expose(words[:2], "atomic").ref))
        for ch in chans:
            ch.send(b"go")
        olds = [np.frombuffer(bytes(ch.recv(timeout=120)), np.uint64) for ch in chans]
        assert list(words) == [2 * n, 2 * n, 0xABCDEF]
        assert sorted(np.concatenate([o[:n] for o in olds]).tolist()) == list(range(2 * n))
        assert sorted(np.concatenate([o[n:] for o in olds]).tolist()) == list(range(2 * n))
        assert not mem[:8].any() and not mem[11:].any()
        for ch in chans:
            ch.send(b"bye")
        for p in procs:
            assert p.wait(60) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for ch in chans:
            ch.close()
        lst.close()


@pytest.mark.parametrize("buf", ["numpy", "bytearray", "copy", "past"])
def test_memory_the_peer_cannot_map_is_refused(buf):
    """An "atomic" exposure on shm of private memory (a numpy array, a bytearray, a
    copy of shared memory) or of a range reaching past its shared segment is
    ProviderUnavailable saying why, and nothing is exposed; "rw" of it works."""
    owner, peer, lst = make_pair("batched", provider="shm")
    try:
        shared = rdmamw.memory.shared(4096)
        obj = {"numpy": lambda: np.zeros(64, np.uint64),
               "bytearray": lambda: bytearray(64),
               "copy": lambda: shared.copy(),
               # the segment and the page after it (never touched)
               "past": lambda: np.lib.stride_tricks.as_strided(shared, shape=(8192,),
                                                                strides=(1,))}[buf]()
        with pytest.raises(ProviderUnavailable, match=r"private memory .*"
                           r"rdmamw\.memory\.shared"):
            owner.expose(obj, "atomic")
        assert owner.stats()["rmem_exposed"] == 0
        if buf != "past":
            with owner.expose(obj, "rw") as reg:
                out = np.ones(8, np.uint8)
                peer.read(reg.ref, out)
                assert not out.any()
        with owner.expose(shared[64:128], "atomic") as reg:
            assert peer.fetch_add(reg.ref, 8, 3).wait() == 0
        assert shared.view(np.uint64)[9] == 3
    finally:
        owner.close()
        peer.close()
        lst.close()


@pytest.mark.parametrize("provider", [p for p in WITH if p.values[0] in ("shm", "tcp")])
def test_no_atomic_lands_after_revoke_returns(provider):
    """A peer thread runs fetch_adds while the owner revokes: the word stops changing
    when revoke() returns, the peer's next atomic is RegionRevoked, and the word is the
    count of the atomics that returned (none lost, none after the revoke)."""
    owner, peer, lst = make_pair("batched", provider=provider)
    try:
        words = rdmamw.memory.shared(64).view(np.uint64)
        reg = owner.expose(words, "atomic")
        done = [0]
        errors: list[BaseException] = []
        started = threading.Event()

        def hammer() -> None:
            try:
                while True:
                    peer.fetch_add(reg.ref, 0, 1).wait()
                    done[0] += 1
                    if done[0] == 200:
                        started.set()
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)
                started.set()

        t = threading.Thread(target=hammer)
        t.start()
        assert started.wait(60)
        reg.revoke()
        after = int(words[0])
        t.join(60)
        assert not t.is_alive()
        assert [type(e) for e in errors] == [RegionRevoked]
        assert int(words[0]) == after == done[0] >= 200
        assert not words[1:].any()
    finally:
        owner.close()
        peer.close()
        lst.close()


def test_awaited_atomics_on_shm():
    """rdmamw.aio: fetch_add and compare_swap awaited on shm give the old value, and
    the owner's words change as they should."""
    import asyncio

    import rdmamw.aio as aio
    a, b, lst = make_pair("batched", provider="shm")
    try:
        owner, peer = aio.Channel(a), aio.Channel(b)
        words = rdmamw.memory.shared(16).view(np.uint64)
        words[:] = [40, 9]
        reg = owner.expose(words, "atomic")

        async def main() -> list[int]:
            return [(await peer.fetch_add(reg.ref, 0, 2)).value,
                    (await peer.compare_swap(reg.ref, 8, 9, 1)).value,
                    (await peer.compare_swap(reg.ref, 8, 9, 5)).value]

        assert asyncio.run(main()) == [40, 9, 1]
        assert list(words) == [42, 1]
    finally:
        a.close()
        b.close()
        lst.close()
