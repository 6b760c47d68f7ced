"""A hostile shm peer (issue 13, findings 1-2): it maps our block read-write, so it can
forge the mirror of our exposure table and rewrite the claim word of its own assist
job while we help with it. Neither may make us read or write anything outside what we
exposed to it. The test hooks (tests/support/hooks.py) write the shared records exactly as
the peer process can."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.providers import test_shm_assist
from tests.providers.test_shm_assist import CHUNK, MiB, _addr
from tests.support import hooks

pair = test_shm_assist.pair     # the fixture: two connected shm transports

RW = 3          # RM_XACC_READ | RM_XACC_WRITE


def test_a_forged_entry_in_our_table_mirror_reads_nothing_of_ours(pair):
    """b writes an entry 'everything, read+write' into a's table (the mirror in a's
    block) and asks a to help with a READ of a's secret: a copies nothing."""
    a, b = pair
    secret = np.full(MiB, 0x5E, np.uint8)
    dst = np.zeros(MiB, np.uint8)
    key = (1 << 8) | 7
    hooks.forge_peer_xtab(b, 7, 0, (1 << 64) - 1, key, RW)
    hooks.offer_job(b, _addr(secret), _addr(dst), MiB, CHUNK, key, 4)
    assert hooks.assist_now(a) == 0
    assert not dst.any()
    assert hooks.job_state(b) == (0, 0)


def test_a_forged_entry_in_our_table_mirror_writes_nothing_of_ours(pair):
    a, b = pair
    victim = np.full(MiB, 0x11, np.uint8)
    src = np.full(MiB, 0xEE, np.uint8)
    key = (1 << 8) | 9
    hooks.forge_peer_xtab(b, 9, 0, (1 << 64) - 1, key, RW)
    hooks.offer_job(b, _addr(victim), _addr(src), MiB, CHUNK, key, 4, write=True)
    assert hooks.assist_now(a) == 0
    assert (victim == 0x11).all()


def test_a_forged_entry_cannot_widen_a_real_exposure(pair):
    """The key of a real 1 MiB exposure, rewritten in the mirror to cover 3 MiB: a job
    on the first MiB is helped, a job reaching past it is not."""
    a, b = pair
    mem = np.full(3 * MiB, 9, np.uint8)
    mem[:MiB] = 5
    key = hooks.expose_range(a, _addr(mem), MiB)
    hooks.forge_peer_xtab(b, key & 0xFF, _addr(mem), 3 * MiB, key, RW)
    dst = np.zeros(2 * MiB, np.uint8)
    hooks.offer_job(b, _addr(mem), _addr(dst), 2 * MiB, 2 * CHUNK, key, 4)
    assert hooks.assist_now(a) == 0
    assert not dst.any()
    hooks.offer_job(b, _addr(mem), _addr(dst), MiB, CHUNK, key, 4)
    assert hooks.assist_now(a) == 4
    assert (dst[:MiB] == 5).all() and not dst[MiB:].any()


def _hostile_claims(a, b, write: bool, n_bad: int, next_bad: int, seconds: float = 0.4):
    """a exposes the middle MiB of `mem` (value 5; the rest is 9); b offers honest
    4-chunk jobs on it and, while a helps, rewrites the claim word to (n_bad, next_bad)
    over and over. Returns (mem, other): b's side of the copies."""
    mem = np.full(4 * MiB, 9, np.uint8)
    exposed = mem[MiB:2 * MiB]
    exposed[:] = 5
    other = np.full(16 * MiB, 3 if write else 0, np.uint8)
    key = hooks.expose_range(a, _addr(exposed), MiB, writable=write)
    end = time.monotonic() + seconds
    jobs = 0
    while time.monotonic() < end:
        seq = hooks.offer_job(b, _addr(exposed), _addr(other), MiB, CHUNK, key, 4, write=write)
        t = threading.Thread(target=hooks.hammer_job, args=(b, seq, 4, n_bad, next_bad, 2000))
        t.start()
        while t.is_alive():
            hooks.assist_now(a)
        t.join()
        jobs += 1
    assert jobs > 3
    return mem, other


@pytest.mark.parametrize("n_bad,next_bad", [(255, 3), (8, 5), (64, 4), (4, 0)])
def test_a_rewritten_claim_word_never_reads_past_the_exposure(pair, n_bad, next_bad):
    """Finding 2: the chunk count is read once. A READ job whose word is rewritten to
    more chunks (or reset to chunk 0) makes a copy nothing but exposed bytes, and only
    into the job's own MiB of b's buffer."""
    a, b = pair
    _mem, other = _hostile_claims(a, b, write=False, n_bad=n_bad, next_bad=next_bad)
    assert not (other == 9).any(), "bytes a never exposed reached the peer"
    assert not other[MiB:].any(), "a wrote past the job's length"
    assert set(np.unique(other[:MiB])) <= {0, 5}


@pytest.mark.parametrize("n_bad,next_bad", [(255, 3), (8, 5), (64, 4)])
def test_a_rewritten_claim_word_never_writes_past_the_exposure(pair, n_bad, next_bad):
    a, b = pair
    mem, _other = _hostile_claims(a, b, write=True, n_bad=n_bad, next_bad=next_bad)
    assert (mem[:MiB] == 9).all() and (mem[2 * MiB:] == 9).all(), \
        "a wrote its own memory outside the exposed MiB"


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_ok=st.sampled_from([2, 3, 4, 63, 64]), n_bad=st.integers(0, 255),
       next_bad=st.integers(0, 255), write=st.booleans(),
       shift=st.sampled_from([0, 1, -1]))
def test_fuzzed_jobs_with_concurrently_rewritten_claims_stay_inside(pair, n_ok, n_bad,
                                                                    next_bad, write, shift):
    """Random honest geometries (n_ok chunks, a length at the limit of n_ok chunks
    +-1 byte) under random concurrent rewrites of the claim word: nothing outside the
    exposed MiB is read (READ) or written (WRITE)."""
    a, b = pair
    mem = np.full(4 * MiB, 9, np.uint8)
    exposed = mem[MiB:2 * MiB]
    exposed[:] = 5
    other = np.full(4 * MiB, 3 if write else 0, np.uint8)
    chunk = MiB // n_ok // 65536 * 65536 or 65536
    length = min(MiB, max(1, n_ok * chunk + shift))
    key = hooks.expose_range(a, _addr(exposed), MiB, writable=write)
    seq = hooks.offer_job(b, _addr(exposed), _addr(other), length, chunk, key, n_ok, write=write)
    t = threading.Thread(target=hooks.hammer_job, args=(b, seq, n_ok, n_bad, next_bad, 500))
    t.start()
    while t.is_alive():
        hooks.assist_now(a)
    t.join()
    hooks.assist_now(a)
    hooks.unexpose_range(a, key)
    if write:
        assert (mem[:MiB] == 9).all() and (mem[2 * MiB:] == 9).all()
    else:
        assert not (other == 9).any()
        assert not other[MiB:].any()
