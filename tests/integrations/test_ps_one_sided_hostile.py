"""The one-sided pull against a buggy or hostile peer (rdmamw/ps/onesided.py): forged or
malformed region references from the server, a shard header that never settles, a
worker that uses its references to write or on another channel. Every case is a typed
error or a counted fallback to the two-sided pull, whose values are compared whole
with the server's model; nothing outside the exposed memory is read (the owner's
provider refuses, named in the reason the reader kept), and no pull outlives the
worker's timeout. One process: the server's loop on a thread, shm and tcp."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from rdmamw.errors import AccessDenied, ForeignReference, ProtocolError, Timeout
from rdmamw.ps import KVServer, KVWorker
from rdmamw.ps.onesided import ExposedShard
from tests.support.helpers import make_pair

KEYS = ["w", "b", 7]


def values() -> list[np.ndarray]:
    rng = np.random.default_rng(9)
    return [rng.standard_normal((200, 300)).astype(np.float32), rng.standard_normal(1000),
            np.arange(12, dtype=np.int64)]


@pytest.fixture(params=["shm", "tcp"])
def job(request) -> Iterator[tuple[KVServer, list[KVWorker], object]]:
    """A one-sided ASP server, two workers (started, one push applied), and a third
    channel pair with a region of its own (another channel's references)."""
    pairs = [make_pair(slots=16, slot_size=1 << 20, provider=request.param) for _ in range(2)]
    other = make_pair(slots=16, slot_size=1 << 16, provider=request.param)
    srv = KVServer({i: p[1] for i, p in enumerate(pairs)}, consistency="asp", lr=0.5,
                   pull="one-sided")
    loop = threading.Thread(target=srv.serve, daemon=True)
    loop.start()
    workers = [KVWorker([p[0]], pull="one-sided", timeout=5) for p in pairs]
    starts = [threading.Thread(target=lambda w=w: (w.init(KEYS, values()),
                                                   w.pull_start(KEYS))) for w in workers]
    for t in starts:
        t.start()
    for t in starts:
        t.join(30)
    workers[1].push(KEYS[:2], [np.ones_like(v) for v in values()[:2]])
    workers[1].pull(KEYS)
    try:
        yield srv, workers, other
    finally:
        for w in workers:
            w.done()
        loop.join(10)
        for a, b, lst in [*pairs, other]:
            a.close(), b.close(), lst.close()


class Reads:
    """A worker's channel whose one-sided reads call ``before`` and ``after`` (a
    server that changes its header between any two looks, a slow peer)."""

    def __init__(self, ch: object, before: Callable[[], None] = lambda: None,
                 after: Callable[[], None] = lambda: None) -> None:
        self.ch, self.before, self.after = ch, before, after

    def __getattr__(self, name: str) -> object:
        return getattr(self.ch, name)

    def read(self, *a: object, **kw: object) -> object:
        self.before()
        done = self.ch.read(*a, **kw)  # type: ignore[attr-defined]
        self.after()
        return done


def model(srv: KVServer) -> list[np.ndarray]:
    return [srv.model[k].copy() for k in KEYS]


def assert_fallback(srv: KVServer, w: KVWorker, why: str, refused: int = 1) -> None:
    """The next pull goes two-sided, counted, and its values are the server's model."""
    expect = model(srv)
    got = w.pull(KEYS)
    for k, g, e in zip(KEYS, got, expect, strict=True):
        assert g.dtype == e.dtype and np.array_equal(g, e), k
    counts = w.pull_counts()
    assert (counts["one_sided"], counts["fallbacks"], counts["refused"]) == (0, 1, refused)
    assert why in (w.readers[0].why or ""), w.readers[0].why
    assert not w.readers[0].has(KEYS)               # that server's references given up
    w.pull(KEYS)
    assert w.pull_counts()["fallbacks"] == 2        # and stays two-sided


def forge(w: KVWorker, name: object, **fields: int) -> None:
    r = w.readers[0].refs[name]
    assert r is not None
    w.readers[0].refs[name] = dataclasses.replace(r, **fields)


def test_the_fixture_pulls_one_sided(job):
    srv, (w0, _), _ = job
    got = w0.pull(KEYS)
    for g, e in zip(got, model(srv), strict=True):
        assert np.array_equal(g, e)
    assert w0.pull_counts() == {"one_sided": 1, "fallbacks": 0, "torn": 0, "refused": 0}


def test_a_forged_region_key_is_refused_by_the_owner(job):
    srv, (w0, _), _ = job
    forge(w0, "b", key=w0.readers[0].refs["b"].key + 40)       # a slot never exposed
    assert_fallback(srv, w0, "RegionRevoked", refused=0)


def test_a_region_reaching_past_the_exposure_is_refused_by_the_owner(job):
    """The right length, moved 8 bytes on: its last word is outside what the owner
    exposed; the owner's provider refuses the whole chain."""
    srv, (w0, _), _ = job
    forge(w0, "b", base=w0.readers[0].refs["b"].base + 8)
    assert_fallback(srv, w0, "OutOfRange")


@pytest.mark.parametrize("length", [lambda n: n + 8, lambda n: n - 8, lambda n: 1 << 40])
def test_a_region_of_another_size_than_the_key_is_never_read(job, length):
    srv, (w0, _), _ = job
    forge(w0, "b", length=length(w0.readers[0].refs["b"].length))
    assert_fallback(srv, w0, "a region of")


def test_another_keys_region_for_a_key_is_never_read(job):
    """Key 7's reference replaced by the region of "b" (larger): reading its first 96
    bytes would be allowed by the owner, and silently wrong."""
    srv, (w0, _), _ = job
    w0.readers[0].refs[7] = w0.readers[0].refs["b"]
    assert_fallback(srv, w0, "a region of 8000 bytes for an array of 96")


def test_a_reply_naming_one_region_for_two_keys_is_a_protocol_error(job):
    _, (w0, _), _ = job
    r = w0.readers[0]
    before = (r.header, dict(r.refs))
    with pytest.raises(ProtocolError, match="names the region of key 'b'"):
        r.take([bytes(r.header), [[7, bytes(r.refs["b"])]]])
    with pytest.raises(ProtocolError, match="the header"):
        r.take([bytes(r.header), [["w", bytes(r.header)]]])
    assert (r.header, r.refs) == before             # nothing of either taken


def test_a_header_of_another_size_is_a_protocol_error(job):
    _, (w0, _), _ = job
    r = w0.readers[0]
    bad = dataclasses.replace(r.header, length=16)
    with pytest.raises(ProtocolError, match="header region of 16 bytes"):
        r.take([bytes(bad), []])


def test_a_region_of_another_channel_is_refused(job):
    """References the owner made for another channel (another worker's, or another
    job's): ForeignReference, nothing read, the pull two-sided."""
    srv, (w0, w1), (oa, ob, _) = job
    region = ob.expose(np.zeros(1000), access="r")      # same size as "b"
    w0.readers[0].refs["b"] = region.ref
    assert_fallback(srv, w0, "ForeignReference")
    # worker 1's whole set, on worker 0's channel: each reference is foreign there
    w0.readers[0].take([bytes(w1.readers[0].header),
                        [[k, bytes(w1.readers[0].refs[k])] for k in KEYS]])
    expect = model(srv)
    for g, e in zip(w0.pull(KEYS), expect, strict=True):
        assert np.array_equal(g, e)
    assert w0.pull_counts()["refused"] == 2 and "ForeignReference" in w0.readers[0].why


def test_garbage_where_a_reference_is_expected_is_a_protocol_error(job):
    srv, (w0, _), _ = job
    r = w0.readers[0]
    before = dict(r.refs)
    for junk in [b"\0" * 48, b"RMRF" + b"\1" * 44, b"x", bytes(r.header)[:-1] + b"!"]:
        with pytest.raises(ProtocolError, match="region reference"):
            r.take([bytes(r.header), [["b", bytes(r.refs["w"])], [7, junk]]])
    assert r.refs == before                 # not even the good first one was taken
    got = w0.pull(KEYS)                     # and the pull is still one-sided, right
    for g, e in zip(got, model(srv), strict=True):
        assert np.array_equal(g, e)
    assert w0.pull_counts()["one_sided"] == 1


@pytest.mark.parametrize("tries", [3, 10 ** 9])
def test_a_header_that_never_settles_ends_by_the_deadline(job, tries):
    """The seqlock word held odd (a change that never ends): a few tries then the
    two-sided pull; with tries past any deadline, Timeout at the worker's timeout."""
    srv, (w0, _), _ = job
    w0.tries, w0.timeout = tries, 1.0
    assert srv.shard is not None
    srv.shard.__enter__()
    t0 = time.monotonic()
    try:
        if tries == 3:
            expect = model(srv)
            got = w0.pull(KEYS)
        else:
            with pytest.raises(Timeout, match="no whole read"):
                w0.pull(KEYS)
    finally:
        srv.shard.__exit__(None, None, None)
    took = time.monotonic() - t0
    assert took < 1.0 + 0.5, took
    if tries == 3:
        for g, e in zip(got, expect, strict=True):
            assert np.array_equal(g, e)
        assert w0.pull_counts() == {"one_sided": 0, "fallbacks": 1, "torn": 3, "refused": 0}


def test_a_header_that_changes_under_every_read_ends_by_the_deadline(job):
    """Even, but another value at every look (a server whose counter moves between any
    two reads of it): every read torn; Timeout at the worker's timeout, not after its
    (endless) tries."""
    srv, (w0, _), _ = job
    w0.tries, w0.timeout = 10 ** 9, 1.0
    shard = srv.shard
    assert shard is not None
    reader = w0.readers[0]

    def move() -> None:
        shard.header[0] += 2

    reader.ch = Reads(reader.ch, after=move)
    t0 = time.monotonic()
    with pytest.raises(Timeout, match="no whole read"):
        w0.pull(KEYS)
    assert time.monotonic() - t0 < 1.5 and reader.torn > 0, reader.torn


def test_a_worker_cannot_write_or_reach_past_the_shard(job):
    """A hostile worker: a write with its read-only reference, a read past it, another
    worker's reference on its channel: each a typed error, the server's model byte for
    byte as it was, the channel usable afterwards."""
    srv, (w0, w1), _ = job
    ch, ref = w0.chans[0], w0.readers[0].refs["b"]
    before = model(srv)
    with pytest.raises(AccessDenied):
        ch.write(np.full(1000, 9.0), ref)
    with pytest.raises(IndexError):         # OutOfRange
        ch.read(ref, np.zeros(1001))
    with pytest.raises(ForeignReference):
        ch.read(w1.readers[0].refs["b"], np.zeros(1000))
    for b, a in zip(before, model(srv), strict=True):
        assert a.tobytes() == b.tobytes()
    got = w0.pull(KEYS)
    for g, e in zip(got, before, strict=True):
        assert np.array_equal(g, e)
    assert w0.pull_counts()["one_sided"] == 1


def test_the_shard_exposes_to_a_joining_channel():
    """ExposedShard.attach: a worker on a new channel gets the header and every key."""
    a, b, lst = make_pair(slots=16, slot_size=1 << 16)
    c, d, lst2 = make_pair(slots=16, slot_size=1 << 16)
    try:
        chans = {0: b}
        shard = ExposedShard(chans, lambda: (3, 4))
        arr = np.arange(50.0)
        shard.add("k", arr)
        chans[1] = d
        shard.attach(1, {"k": arr})
        rm = shard.offer(1)["rm"]
        from rdmamw.ps.onesided import ShardReader
        reader = ShardReader(c)
        reader.take(rm)
        with shard:
            pass
        out = {"k": np.zeros(50)}
        assert reader.read(["k"], out, 2) == {"version": 3, "merged": 4}
        assert np.array_equal(out["k"], arr)
    finally:
        for x in (a, b, lst, c, d, lst2):
            x.close()


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_a_joiner_pulls_one_sided_from_a_running_server(provider):
    """KVServer.admit on a one-sided server: the joiner's channel gets the header and
    every key exposed, the references ride on its first reply, its pulls are READs of
    the model as it is."""
    pairs = [make_pair(slots=16, slot_size=1 << 20, provider=provider) for _ in range(2)]
    srv = KVServer({0: pairs[0][1]}, consistency="asp", lr=0.5, pull="one-sided")
    loop = threading.Thread(target=srv.serve, daemon=True)
    loop.start()
    w0 = KVWorker([pairs[0][0]], pull="one-sided", timeout=20)
    try:
        w0.init(KEYS, values())
        w0.pull_start(KEYS)
        w0.push(KEYS[:2], [np.ones_like(v) for v in values()[:2]])
        w0.pull(KEYS)
        srv.admit(1, pairs[1][1])
        w1 = KVWorker([pairs[1][0]], pull="one-sided", timeout=20)
        w1.init(KEYS, [np.zeros_like(v) for v in values()])
        first = w1.pull_start(KEYS)
        at_join = model(srv)                    # nothing changes it meanwhile
        w0.push(KEYS[:2], [np.ones_like(v) for v in values()[:2]])
        w0.pull(KEYS)                           # the push is in the model now
        got = w1.pull(KEYS)
        for k, f, j, g, m in zip(KEYS, first, at_join, got, model(srv), strict=True):
            assert np.array_equal(f, j) and np.array_equal(g, m), k
            assert np.array_equal(f, m) == (k == 7), k      # 7 is never pushed
        assert w1.pull_counts() == {"one_sided": 1, "fallbacks": 0, "torn": 0, "refused": 0}
        assert w1.base == [srv.policy.version] == [2]
        w0.done(), w1.done()
    finally:
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()
        loop.join(10)


def test_a_fallback_has_only_what_is_left_of_the_timeout(job):
    """Slow one-sided tries (a header that never settles, each look slow) use most of
    the timeout; the two-sided pull after them (a server that does not answer) ends at
    the same deadline, not a whole timeout later."""
    srv, (w0, _), _ = job
    w0.tries, w0.timeout = 2, 1.0
    shard = srv.shard
    assert shard is not None
    reader = w0.readers[0]

    answer = srv._answer_reads
    reader.ch = Reads(reader.ch, before=lambda: time.sleep(0.35))
    srv._answer_reads = lambda: None            # type: ignore[method-assign]
    shard.__enter__()
    t0 = time.monotonic()
    try:
        with pytest.raises(Timeout):
            w0.pull(KEYS)
    finally:
        shard.__exit__(None, None, None)
        srv._answer_reads = answer              # type: ignore[method-assign]
    took = time.monotonic() - t0
    assert 0.9 < took < 1.35, took
    assert w0.pull_counts()["fallbacks"] == 1 and reader.torn == 2
