"""The one-sided pull (rdmamw/ps/onesided.py): a worker READs the server's exposed shard
and keeps only a whole one. In one process: the server's loop on a thread, workers on
channel pairs (shm, and tcp where the owner's progress thread serves the READs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from rdmamw.errors import ProtocolError
from rdmamw.ps import KVServer, KVWorker, wire
from rdmamw.ps.onesided import ExposedShard, ShardReader
from tests.support.helpers import make_pair

KEYS = ["w", "b", 7, "empty"]


def values() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.standard_normal((300, 700)).astype(np.float32),      # 820 KiB: pieces
            rng.standard_normal(1000), np.arange(12, dtype=np.int64).reshape(3, 4),
            np.zeros((0, 3), np.float32)]


@pytest.fixture(params=["shm", "tcp"])
def job(request) -> Iterator[tuple[KVServer, list[KVWorker]]]:
    """A one-sided ASP server serving two workers (pull_start done) on a thread."""
    pairs = [make_pair(slots=16, slot_size=1 << 20, provider=request.param) for _ in range(2)]
    srv = KVServer({i: p[1] for i, p in enumerate(pairs)}, consistency="asp", lr=0.5,
                   pull="one-sided")
    loop = threading.Thread(target=srv.serve, daemon=True)
    loop.start()
    workers = [KVWorker([p[0]], pull="one-sided", timeout=20) for p in pairs]

    def start(w: KVWorker) -> None:
        w.init(KEYS, values())
        w.pull_start(KEYS)

    starts = [threading.Thread(target=start, args=(w,)) for w in workers]
    for t in starts:
        t.start()
    for t in starts:
        t.join(30)
    try:
        yield srv, workers
    finally:
        for w in workers:
            w.done()
        loop.join(10)
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()


def test_a_one_sided_pull_equals_the_two_sided_pull(job):
    srv, (w0, w1) = job
    rng = np.random.default_rng(1)
    for step in range(3):
        grads = [rng.standard_normal(v.shape).astype(v.dtype) for v in values()[:2]]
        w1.push(KEYS[:2], grads)
        w1.pull_mode = "two-sided"
        two_sided = w1.pull(KEYS)           # answered after the push (the ring's order)
        w0.pull_mode = "two-sided"
        reference = w0.pull(KEYS)
        w0.pull_mode = "one-sided"
        got = w0.pull(KEYS)
        for k, g, r, t in zip(KEYS, got, reference, two_sided, strict=True):
            assert g.dtype == r.dtype and g.shape == r.shape, k
            assert np.array_equal(g, r) and np.array_equal(g, t), (step, k)
        assert w0.base == [srv.policy.version] == [step + 1]
    assert w0.pull_counts() == {"one_sided": 3, "fallbacks": 0, "torn": 0, "refused": 0}
    assert w0.merged == srv.policy.merged == 3
    assert srv.stats()["pull"] == "one-sided"


def test_a_shard_changed_for_every_try_falls_back_to_the_two_sided_pull(job):
    """The header held odd (a change that never ends): ``tries`` reads thrown away,
    then the two-sided pull, which the server answers with the whole model."""
    srv, (w0, _) = job
    w0.tries = 3
    expect = [v.copy() for v in srv.model.values()]
    srv.shard.__enter__()                   # nothing else changes the model now
    try:
        got = w0.pull(KEYS)
    finally:
        srv.shard.__exit__(None, None, None)
    assert w0.pull_counts() == {"one_sided": 0, "fallbacks": 1, "torn": 3, "refused": 0}
    for g, e in zip(got, expect, strict=True):
        assert np.array_equal(g, e)


def test_a_worker_let_go_pulls_two_sided():
    """Its regions revoked (the server forgot it): RegionRevoked is a fallback, not an
    error, and the pull is answered two-sided."""
    a, b, lst = make_pair(slots=16, slot_size=1 << 20)
    try:
        shard = ExposedShard({0: b}, lambda: (0, 0))
        arr = np.full(1000, 3.0)
        shard.add("k", arr)
        reader = ShardReader(a)
        reader.take(shard.offer(0)["rm"])
        out = {"k": np.zeros(1000)}
        assert reader.read(["k"], out, 2) == {"version": 0, "merged": 0}
        assert np.array_equal(out["k"], arr)
        shard.forget(0)
        assert reader.read(["k"], out, 2) is None and not reader.has(["k"])
    finally:
        a.close(), b.close(), lst.close()


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_a_torn_shard_is_never_returned(provider):
    """Updates hammered while reading: every shard read is one version's whole state
    (each element of version v is v, as the header's version says), and some reads
    did overlap an update (so the check had something to catch)."""
    a, b, lst = make_pair(slots=16, slot_size=1 << 16, provider=provider)
    arr = np.zeros(1 << 17)                 # 1 MiB, four READs of 256 KiB
    version = [0]
    shard = ExposedShard({0: b}, lambda: (version[0], version[0]))
    shard.add("k", arr)
    reader = ShardReader(a)
    reader.take(shard.offer(0)["rm"])
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            with shard:
                version[0] += 1
                arr[:arr.size // 2] = version[0]     # a torn read sees two values
                arr[arr.size // 2:] = version[0]
            # a server also does other things: short gaps, and every 16th a long one, so
            # a read slower than the short gaps (tcp beside CI's other work: 26 reads,
            # none whole, in 20 s) still finds whole states to return
            time.sleep(0.05 if version[0] % 16 == 0 else 0.0003)

    t = threading.Thread(target=hammer, daemon=True)
    t.start()
    out = np.zeros_like(arr)
    reads = whole = 0
    deadline = time.monotonic() + 20
    try:
        while (reads < 300 or reader.torn < 20) and time.monotonic() < deadline:
            h = reader.read(["k"], {"k": out}, 1000)
            reads += 1
            if h is not None:
                whole += 1
                assert (out == h["version"]).all(), \
                    f"torn: {np.unique(out)[:4]} at version {h['version']}"
    finally:
        stop.set()
        t.join(10)
        a.close(), b.close(), lst.close()
    assert whole > 0 and reader.torn > 0, (reads, whole, reader.torn)


@pytest.mark.parametrize("model", ["bsp", "ssp:2", "lsp:1", "alsp", "hybrid", "asp:dc0.1"])
def test_a_model_that_decides_when_a_worker_reads_refuses_the_one_sided_pull(model):
    with pytest.raises(ValueError, match="one-sided"):
        KVServer({}, consistency=model, pull="one-sided")
    assert KVServer({}, consistency=model, pull="two-sided").shard is None
    assert KVServer({}, consistency="asp", pull="one-sided").shard is not None


def test_a_scheduled_server_refuses_the_one_sided_pull():
    """DSANA's plan reaches the workers in the pull replies: none with READs."""
    from rdmamw.sched import Dsana

    with pytest.raises(ValueError, match="DSANA"):
        KVServer({}, consistency="asp", pull="one-sided", scheduler=Dsana([0], 64))


def test_an_unknown_pull_is_refused():
    with pytest.raises(ValueError, match="pull must be one of"):
        KVServer({}, consistency="asp", pull="sideways")
    with pytest.raises(ValueError, match="pull must be one of"):
        KVWorker([], pull="sideways")
    with pytest.raises(ValueError, match="tries"):
        KVWorker([], pull="one-sided", tries=0)


@pytest.mark.parametrize("rm", [7, [b"x"], ["x", []], [b"x", [[[], b"y"]]], [b"x", [["k", 5]]],
                                [b"x", [["k"]]], [b"x", "k"]])
def test_a_reply_with_malformed_region_references_is_a_protocol_error(rm):
    with pytest.raises(ProtocolError):
        wire.reply(wire.pack(wire.END, id=1, version=0, merged=0, rm=rm))


def test_a_reference_that_does_not_decode_is_a_protocol_error():
    a, b, lst = make_pair()
    try:
        with pytest.raises(ProtocolError, match="region reference"):
            ShardReader(a).take([b"\0" * 48, []])
    finally:
        a.close(), b.close(), lst.close()


def test_pulls_during_a_stream_of_pushes_each_see_one_whole_model():
    """End to end: a worker pushes all the time, the other pulls one-sided; every
    element changes alike in each step, so a pulled key with two values is torn."""
    pairs = [make_pair(slots=16, slot_size=1 << 20) for _ in range(2)]
    srv = KVServer({i: p[1] for i, p in enumerate(pairs)}, consistency="asp", lr=0.01,
                   momentum=0.0, pull="one-sided")
    loop = threading.Thread(target=srv.serve, daemon=True)
    loop.start()
    n = 1 << 16                             # 512 KiB: one block, one change per push
    workers = [KVWorker([p[0]], pull="one-sided", timeout=20, tries=1000) for p in pairs]
    starts = [threading.Thread(target=lambda w=w: (w.init(["x"], [np.ones(n)]),
                                                   w.pull_start(["x"]))) for w in workers]
    for t in starts:
        t.start()
    for t in starts:
        t.join(30)
    stop = threading.Event()

    def pushes() -> None:
        while not stop.is_set():
            workers[1].push(["x"], [np.ones(n)])

    pusher = threading.Thread(target=pushes, daemon=True)
    pusher.start()
    out = [np.empty(n)]
    seen = set()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            x = workers[0].pull(["x"], out)[0]
            assert (x == x[0]).all(), f"torn: {np.unique(x)[:4]}"
            seen.add(float(x[0]))
    finally:
        stop.set()
        pusher.join(10)
        for w in workers:
            w.done()
        loop.join(10)
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()
    assert len(seen) > 10 and workers[0].pull_counts()["fallbacks"] == 0


def test_a_job_pulls_one_sided_by_the_setting():
    """RDMAMW_PS_PULL=one-sided for every rank of a launched ASP job (2 servers, 2
    workers, processes): every pull after the start is one-sided (or, after torn reads
    while the other worker pushes, a counted fallback), and training converges as with
    the two-sided pull; with BSP the servers refuse."""
    from tests.integrations.test_ps import run_job

    servers, workers, _ = run_job(4, "--servers", "2", "--iters", "40", "--consistency", "asp",
                                  RDMAMW_PS_PULL="one-sided")
    assert [s["pull"] for s in servers] == ["one-sided"] * 2
    assert all(s["applied"] == 2 * 40 and s["one_sided_refused"] == 0 for s in servers)
    for w in workers:
        counts = w["pull_counts"]
        assert counts["one_sided"] + counts["fallbacks"] == 41 and counts["one_sided"] > 20, w
        assert w["error_norm"] < 0.1, w        # started at |1 - t| up to ~4
    _, _, err = run_job(3, "--servers", "1", "--iters", "2", ok=False, RDMAMW_PS_PULL="one-sided")
    assert "pull='one-sided' (RDMAMW_PS_PULL): consistency 'bsp' decides" in err
