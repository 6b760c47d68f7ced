"""The parameter server end to end: multi-process jobs on shm started by the local
launcher (tests/support/ps_job.py), small and fast. Consistency invariants are checked from
the servers' own counters; the pure rules are in test_ps_consistency.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "support", "ps_job.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

from tests.support.ps_job import shapes, targets  # noqa: E402


def clean_env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
            "RDMAMW_TOKEN", "RDMAMW_PROVIDER")
    return {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith(("RDMAMW_RANK", "RDMAMW_WORLD", "RDMAMW_MASTER",
                                                   "OMPI_", "PMI_", "SLURM_", "DMLC_"))}


def run_job(n: int, *args: str, ok: bool = True, **env: str
            ) -> tuple[list[dict], list[dict], str]:
    p = subprocess.run([sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", str(n), "--",
                        sys.executable, JOB, *args], cwd=ROOT, env={**clean_env(), **env},
                       capture_output=True, text=True, timeout=100)
    if ok:
        assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    servers = sorted((r for r in rows if r["role"] == "server"), key=lambda r: r["rank"])
    workers = sorted((r for r in rows if r["role"] == "worker"), key=lambda r: r["index"])
    return servers, workers, p.stderr


def bsp_reference(iters: int, big: int, lr: float = 0.2, mu: float = 0.5) -> list[np.ndarray]:
    """What BSP must produce for every key: every round's mean gradient is x - t."""
    out = []
    for (shape, _), t in zip(shapes(big), targets(big), strict=True):
        x, v = np.ones(shape), np.zeros(shape)
        for _ in range(iters):
            v = mu * v + (x - t.astype(np.float64))
            x = x - lr * v
        out.append(x)
    return out


def assert_whole_values(dump, index: int, ref: list[np.ndarray]) -> None:
    """Worker ``index``'s final value of every key equals ``ref``, every element."""
    with np.load(os.path.join(dump, f"worker{index}.npz")) as got:
        for i, r in enumerate(ref):
            x = got[f"arr_{i}"]
            assert x.shape == r.shape, (i, x.shape)
            np.testing.assert_allclose(x, r, rtol=1e-4, atol=1e-5, err_msg=f"key {i}")


def blocks_of(servers: list[dict], key: str) -> dict[str, int]:
    """Distinct blocks of ``key`` its server received (grad) and sent (val)."""
    return {k.split(":")[0]: n for s in servers for k, n in s["blocks"].items()
            if k.split(":", 1)[1] == key}


@pytest.mark.parametrize("how", [[], ["--push-pull"]])
def test_bsp_matches_the_sequential_result_and_applies_n_per_round(how, tmp_path):
    servers, workers, _ = run_job(5, "--servers", "2", "--iters", "12", "--dump", str(tmp_path),
                                  *how)
    assert len(servers) == 2 and len(workers) == 3
    ref = bsp_reference(12, 40000)
    per_push = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes(40000))
    for w in workers:
        assert_whole_values(tmp_path, w["index"], ref)
        assert w["pushes"] == w["clock"] == 12 and w["merged"] == 36   # 12 rounds of 3
        assert w["metrics"]["bytes_pushed"] == 12 * per_push
        assert w["metrics"]["bytes_pulled"] == 13 * per_push     # the first pull too
    for s in servers:
        assert s["round_sizes"] == [3] and s["version"] == 12 and s["applied"] == 36
        assert s["below_quorum"] == 0
        assert s["max_staleness"] == 0 and s["lost"] == []
    assert sum(s["keys"] for s in servers) == 4                  # sharded over both


def test_start_has_the_documented_defaults():
    import inspect

    from rdmamw import ps
    p = inspect.signature(ps.start).parameters
    assert (p["consistency"].default, p["lr"].default, p["momentum"].default) == ("bsp", 0.1, 0.9)


def test_a_pull_stream_hands_its_failure_to_the_caller():
    """The receiving thread's PeerLost reaches wait() and join(), not a stale value."""
    import rdmamw
    from rdmamw.ps.metrics import ComputeClock
    from rdmamw.ps.stream import PullStream

    class DeadServers:                  # the StreamWorker surface PullStream uses
        compute_clock = ComputeClock()

        def prepare_pull(self, keys, out):
            return out, {}, {0: (b"", 1)}

        def send_batches(self, per):
            pass

        def receive_pull(self, ids, dest, arrived=None):
            raise rdmamw.PeerLost("server 0 went away")

    stream = PullStream(DeadServers(), ["w"], [np.zeros(2)])
    with pytest.raises(rdmamw.PeerLost, match="went away"):
        stream.wait("w")
    with pytest.raises(rdmamw.PeerLost, match="went away"):
        stream.join()


def test_a_start_pull_waits_for_every_worker_and_gives_worker_0s_values():
    """pull_start is a barrier: held until every worker still connected asks (one that
    said done is not waited for); all get worker 0's values, though it declared last."""
    import threading

    from helpers import PSInProcess, wait_for
    job = PSInProcess(3, consistency="asp")
    try:
        for w in (2, 1, 0):
            job.workers[w].init(["k"], [np.full(5, float(w))])
        got: dict = {}
        threads = [threading.Thread(target=lambda w=w: got.update(
            {w: job.workers[w].pull_start(["k"])[0]}), daemon=True) for w in (0, 1)]
        for w, t in enumerate(threads):
            t.start()
            wait_for(lambda w=w: job.held(w), f"the server holds worker {w}'s start")
        assert got == {} and all(t.is_alive() for t in threads)   # worker 2 not asked
        job.workers[2].done()
        for t in threads:
            t.join(10)
        assert {w: v.tolist() for w, v in got.items()} == {0: [0.0] * 5, 1: [0.0] * 5}
        for w in (0, 1):
            job.workers[w].done()
    finally:
        job.close()


def test_a_header_comes_back_as_it_went():
    """Keys of str, bytes and int stay apart (a bytes key must not come back as str)."""
    from rdmamw.ps import wire
    h = {"keys": ["k", b"k", 7, b"\xff"], "id": 3, "dt": "<f4", "shape": [2, 5]}
    assert wire.unpack(wire.pack(wire.PULL, **h)) == {**h, "op": wire.PULL}


def test_a_workers_metrics_name_each_series():
    from rdmamw.ps.metrics import WorkerMetrics
    zero = {"n": 0, "mean": 0.0, "last": 0.0, "ema": 0.0, "max": 0.0}
    assert WorkerMetrics().as_dict() == {"compute_s": zero, "push_s": zero, "pull_s": zero,
                                         "bytes_pushed": 0, "bytes_pulled": 0}
    m = WorkerMetrics(bytes_pushed=5, bytes_pulled=7)
    m.compute.add(1.0)
    m.push.add(2.0)
    m.push.add(4.0)
    m.pull.add(3.0)
    assert m.as_dict() == {
        "compute_s": {"n": 1, "mean": 1.0, "last": 1.0, "ema": 1.0, "max": 1.0},
        "push_s": {"n": 2, "mean": 3.0, "last": 4.0, "ema": 0.7 * 2.0 + 0.3 * 4.0, "max": 4.0},
        "pull_s": {"n": 1, "mean": 3.0, "last": 3.0, "ema": 3.0, "max": 3.0},
        "bytes_pushed": 5, "bytes_pulled": 7}


def test_a_fresh_peer_has_counted_nothing():
    from rdmamw.ps.metrics import PeerMetrics
    d = PeerMetrics().as_dict()
    assert (d["gradients"], d["bytes_in"], d["bytes_out"]) == (0, 0, 0)


def test_asp_with_one_worker_matches_the_sequential_result(tmp_path):
    """ASP applies each block as it arrives (the server's direct path): with one worker
    the order is fixed, so the result is the sequential one, every element. (With a
    wait limit: the worker's deadline path.)"""
    servers, workers, _ = run_job(3, "--servers", "2", "--iters", "6", "--consistency", "asp",
                                  "--timeout", "60", "--dump", str(tmp_path))
    assert len(workers) == 1 and all(s["applied"] == 6 for s in servers)
    assert_whole_values(tmp_path, 0, bsp_reference(6, 40000))


@pytest.mark.parametrize("how", [[], ["--push-pull"]])
def test_tensors_larger_than_the_rings_go_through_in_blocks(how, tmp_path):
    """8 slots of 4 KiB: each 160 KB push and reply is 40 blocks through a 32 KiB ring,
    from two servers at once (push_pull: the pull request queued behind them)."""
    servers, workers, _ = run_job(4, "--servers", "2", "--iters", "5", "--dump", str(tmp_path),
                                  *how, RDMAMW_SLOTS="8", RDMAMW_SLOT_SIZE="4096")
    assert len(workers) == 2 and all(s["version"] == 5 for s in servers)
    # counted from the headers the server saw: no block can exceed a 4 KiB slot
    assert blocks_of(servers, "big")["grad"] >= 40000 * 4 // 4096
    assert blocks_of(servers, "big")["val"] >= 40000 * 4 // 4096
    ref = bsp_reference(5, 40000)
    for w in workers:
        assert_whole_values(tmp_path, w["index"], ref)


@pytest.mark.parametrize("mode, check", [
    ("asp", lambda s: s["applied"] == 3 * 15),
    ("ssp:1", lambda s: s["max_gap"] <= 1),
    ("ssp:0", lambda s: s["max_gap"] == 0),
    ("lsp:2:1", lambda s: s["max_staleness"] <= 1 and s["below_quorum"] == 0),
    ("alsp:2", lambda s: s["max_staleness"] <= 2 and s["below_quorum"] == 0),
    # the slow worker's gradients are stale while the fast pair syncs: applied at once,
    # delay-compensated, never dropped
    ("hybrid:2:dc0.05", lambda s: s["async"] >= 1 and s["dropped"] == 0
     and s["applied"] == 3 * 15),
    ("asp:dc0.05", lambda s: s["applied"] == 3 * 15),
])
def test_consistency_models_converge_and_keep_their_invariant(mode, check):
    """16 KiB slots: the 80 KB key goes in blocks, so the error bound covers every block."""
    servers, workers, _ = run_job(5, "--servers", "2", "--iters", "15", "--consistency", mode,
                                  "--slow", "0.01", "--big", "20000", RDMAMW_SLOT_SIZE="16384")
    assert len(workers) == 3
    assert blocks_of(servers, "big")["grad"] >= 20000 * 4 // 16384
    for s in servers:
        assert s["mode"] == mode.split(":")[0] and check(s), s
        assert s["reported_times"] == [15, 15, 15]     # one compute time per push
    for w in workers:
        assert w["error_norm"] < 1.0          # started at |1 - t| up to ~4


@pytest.mark.parametrize("bad, match", [
    ("shape", "key 'b'"),
    ("unknown", "'nope'"),
    ("init", "key 'c' initialised as float32 (5, 2) but the server holds float32 (2, 5)"),
])
def test_errors_name_the_key(bad, match):
    _, workers, _ = run_job(3, "--servers", "1", "--iters", "2", "--bad", bad)
    assert all(match in w["error"] for w in workers), workers


def test_a_request_after_bye_is_dropped_and_logged():
    """Nothing may follow a BYE: the pull in the same batch is not served (no value
    leaves the server), the worker is gone (said goodbye), not lost, and the log says
    how many messages were dropped."""
    servers, workers, err = run_job(3, "--servers", "1", "--bad", "after-bye")
    assert [w["index"] for w in workers] == [0, 1]
    assert servers[0]["bytes_out"] == 0 and servers[0]["lost"] == []
    for w in (0, 1):
        assert f":rdmamw.ps: worker {w} sent 1 messages after bye; dropped\n" in err  # whole


def test_one_pass_drops_what_follows_a_bye_in_its_batch():
    """The same in one serve_once (the job above may take the batch in idle()'s wait
    instead): the pass reports work done, the pull is dropped, nothing is sent."""
    import rdmamw
    from rdmamw.ps import KVServer, wire

    class OneBatch:                     # the Channel surface the server's receive uses
        def __init__(self):
            self.batches = [[wire.pack(wire.BYE), wire.pack(wire.PULL, keys=["b"], id=0)]]
            self.sent: list = []

        def recv_batch(self, timeout):
            if not self.batches:
                raise rdmamw.Timeout("nothing more")
            return [memoryview(m) for m in self.batches.pop()]

        def send_batch(self, msgs, timeout=None):
            self.sent.append(msgs)

    ch = OneBatch()
    node = KVServer({0: ch})
    assert node.serve_once() is True
    assert (node.bye, node.reads, ch.sent, node.finished) == ({0}, {}, [], True)
    assert node.serve_once() is False


def test_a_read_waits_for_the_initial_values_still_arriving():
    """Worker 0's initial values (which win) arrive in blocks; worker 1 declares its own
    and reads the key between two of worker 0's blocks. The read waits for the rest:
    answering it ended the lowest-index rule, and the blocks after it were dropped,
    leaving the zeros the key was made with (test_ps's block test, 1 run in 3)."""
    from helpers import make_pair

    from rdmamw.ps import wire
    from rdmamw.ps.server import KVServer

    pairs = [make_pair(slots=16, slot_size=1 << 16) for _ in range(2)]
    try:
        srv = KVServer({w: p[1] for w, p in enumerate(pairs)})

        def init_frames(value: float) -> list:
            flat = np.full(4000, value, np.float32)
            frames = []
            for o, b in wire.blocks(flat, 4096):
                frames += [wire.pack(wire.INIT, k="w", o=o, shape=[4000], dt="<f4",
                                     last=o + b.size >= flat.size), b]
            return frames

        def serve() -> None:
            for _ in range(20):
                srv.serve_once()

        w0 = init_frames(1.0)
        assert len(w0) == 8                  # 4 blocks
        pairs[0][0].send_batch(w0[:4]).wait(5)
        serve()
        pairs[1][0].send_batch(init_frames(2.0) + [wire.pack(wire.PULL, keys=["w"], id=1)]
                               ).wait(5)
        serve()
        assert 1 in srv.reads                # held: two of worker 0's blocks are missing
        pairs[0][0].send_batch(w0[4:]).wait(5)
        serve()
        assert srv.reads == {}
        np.testing.assert_array_equal(srv.model["w"], np.full(4000, 1.0, np.float32))
    finally:
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()


def test_a_read_is_refused_when_initial_values_stop_half_way(monkeypatch):
    """Worker 0 (whose values win) sends 2 of its 4 blocks and stops, alive. Worker 1's
    read waits, then past RDMAMW_PS_INIT_TIMEOUT is refused with an error naming the
    key and worker 0 instead of waiting for ever; the rest, when it comes, is taken and
    a new read is answered with worker 0's values, whole."""
    import time

    from helpers import make_pair

    from rdmamw.ps import wire
    from rdmamw.ps.server import KVServer

    monkeypatch.setenv("RDMAMW_PS_INIT_TIMEOUT", "0.3")
    pairs = [make_pair(slots=16, slot_size=1 << 16) for _ in range(2)]
    try:
        srv = KVServer({w: p[1] for w, p in enumerate(pairs)})
        assert srv.init_timeout == 0.3

        def serve(n: int = 20) -> None:
            for _ in range(n):
                srv.serve_once()

        flat = np.arange(4000, dtype=np.float32)
        w0 = []
        for o, b in wire.blocks(flat, 4096):
            w0 += [wire.pack(wire.INIT, k="w", o=o, shape=[4000], dt="<f4",
                             last=o + b.size >= flat.size), b]
        assert len(w0) == 8                     # 4 blocks
        pairs[0][0].send_batch(w0[:4]).wait(5)
        serve()
        pull = wire.pack(wire.PULL, keys=["w"], id=1)
        pairs[1][0].send_batch([pull]).wait(5)
        t0 = time.monotonic()
        serve()
        assert 1 in srv.reads                   # held: two blocks are missing
        while 1 in srv.reads and time.monotonic() - t0 < 5:
            serve(1)
            time.sleep(0.01)
        assert 1 not in srv.reads and time.monotonic() - t0 >= 0.3
        got = wire.unpack(pairs[1][0].recv(timeout=5))
        assert got["op"] == wire.ERR and got["k"] == "w"
        assert "worker 0 sent part of its initial values" in got["msg"]
        assert "RDMAMW_PS_INIT_TIMEOUT" in got["msg"]
        pairs[0][0].send_batch(w0[4:]).wait(5)      # the rest after all
        serve()
        assert srv._init_rest == {} and srv._init_since == {}
        pairs[1][0].send_batch([pull]).wait(5)
        serve()
        assert srv.reads == {}
        np.testing.assert_array_equal(srv.model["w"], flat)
    finally:
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()


def test_initial_values_that_keep_coming_are_waited_for(monkeypatch):
    """The limit counts from the last block, not the first: 4 blocks 0.15 s apart
    (0.45 s in all) under a 0.3 s RDMAMW_PS_INIT_TIMEOUT, a read in between is answered
    with the whole values, not refused."""
    import time

    from helpers import make_pair

    from rdmamw.ps import wire
    from rdmamw.ps.server import KVServer

    monkeypatch.setenv("RDMAMW_PS_INIT_TIMEOUT", "0.3")
    pairs = [make_pair(slots=16, slot_size=1 << 16) for _ in range(2)]
    try:
        srv = KVServer({w: p[1] for w, p in enumerate(pairs)})
        flat = np.arange(4000, dtype=np.float32)
        blocks = [[wire.pack(wire.INIT, k="w", o=o, shape=[4000], dt="<f4",
                             last=o + b.size >= flat.size), b]
                  for o, b in wire.blocks(flat, 4096)]
        assert len(blocks) == 4
        for i, frames in enumerate(blocks):
            pairs[0][0].send_batch(frames).wait(5)
            if i == 0:
                pairs[1][0].send_batch([wire.pack(wire.PULL, keys=["w"], id=1)]).wait(5)
            end = time.monotonic() + 0.15
            while time.monotonic() < end:
                srv.serve_once()
                time.sleep(0.005)
        assert srv.reads == {}
        got = wire.unpack(pairs[1][0].recv(timeout=5))
        assert got["op"] == wire.VAL, got
        np.testing.assert_array_equal(srv.model["w"], flat)
    finally:
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()


def test_a_dead_worker_does_not_stop_bsp():
    servers, workers, err = run_job(4, "--servers", "1", "--iters", "10", "--die", "1:3")
    assert [w["index"] for w in workers] == [0, 2]
    assert all(w["pushes"] == 10 for w in workers)
    assert servers[0]["lost"] == [1]
    assert "worker 1 lost" in err


def test_a_hung_worker_times_out_of_the_round():
    servers, workers, err = run_job(4, "--servers", "1", "--iters", "6", "--hang", "1:2:3",
                                    "--round-timeout", "0.3")
    assert len(workers) == 3
    assert servers[0]["timeouts"] >= 1 and "closed after" in err
    assert servers[0]["max_staleness"] == 0       # its late gradient was dropped, not applied
    assert servers[0]["dropped"] >= 1


def test_a_workers_wait_limit_ends_a_pull_the_round_keeps_open():
    """Worker 1 hangs 5 s; BSP keeps the round open (10 s round timeout), so the others'
    pulls outlast their 1 s wait limit: Timeout, not an endless wait."""
    _, workers, _ = run_job(4, "--servers", "1", "--iters", "4", "--hang", "1:1:5",
                            "--timeout", "1", ok=False)
    by = {w["index"]: w for w in workers}      # (the hung one may not get to report)
    assert "timeout" in by[0] and "timeout" in by[2], workers


def test_a_dead_server_raises_peer_lost_on_the_workers():
    _, workers, _ = run_job(4, "--servers", "2", "--iters", "50", "--kill-server", "3",
                            ok=False)
    assert len(workers) == 2
    assert all("peer_lost" in w for w in workers), workers
