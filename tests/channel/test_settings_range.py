"""Every setting has the range its users can take (issue 29, finding 10): each numeric
setting of the table (rdmamw/config.py) has a finite maximum, and set to its table
minimum and to its maximum the path that uses it runs: it honours the value, or
refuses it with a typed error (an RdmamwError such as a peer refusing a ring larger
than it holds), never a raw ValueError / OverflowError, a dead thread or a hang.
Garbage RDMAMW_COLL_CONFIG and RDMAMW_COLL_TOPOLOGY are ConfigErrors."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import rdmamw
from rdmamw import config
from rdmamw.errors import ConfigError, RdmamwError
from tests.support.helpers import unique_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMERIC = [s for s in config.declared().values() if s.kind in ("int", "float", "bytes", "seconds")]
BIG = 2 << 20           # a message above every eager slot: rendezvous, assisted on shm


def _text(s: config.Setting, v: float) -> str:
    return str(int(v)) if s.kind in ("int", "bytes") else repr(float(v))


def _roundtrip(provider: str, **ring: int) -> None:
    """A channel pair with every setting from the environment (and ``ring``), a small
    and a large message each way."""
    addr = f"shm://{unique_name('range')}" if provider == "shm" else "tcp://127.0.0.1:0"
    with rdmamw.listen(addr, **ring) as lst, ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(lst.accept, timeout=10)
        try:
            a = rdmamw.Channel.open(lst.address, timeout=10, **ring)
        except RdmamwError:
            lst.close()                 # ends the accept too
            raise
        b = accepted.result(15)
        try:
            big = np.arange(BIG, dtype=np.uint8)
            for x, y in ((a, b), (b, a)):
                x.send(b"ping", timeout=10)
                with y.recv(timeout=10) as m:
                    assert bytes(m) == b"ping"
                h = x.send(big, timeout=10)
                with y.recv(timeout=10) as m:
                    assert len(m) == BIG and bytes(memoryview(m)[:5]) == bytes(big[:5])
                h.wait(10)
        finally:
            a.close(), b.close()


def _both() -> None:
    _roundtrip("shm")
    _roundtrip("tcp")


def _shm_staged() -> None:
    os.environ["RDMAMW_SHM_CMA"] = "0"
    try:
        _roundtrip("shm")
    finally:
        del os.environ["RDMAMW_SHM_CMA"]


def _aio() -> None:
    from rdmamw.providers.shm import provider as shm  # noqa: F401 - the provider the pair uses
    from tests.support.helpers import make_pair

    a, b, lst = make_pair()
    try:
        from rdmamw import aio

        ab = aio.Channel(b)
        assert ab._spin_us == config.get("RDMAMW_AIO_SPIN_US")
        a.send(b"x")

        async def take() -> bytes:
            m = await ab.recv()
            with m:
                return bytes(m)

        assert asyncio.run(asyncio.wait_for(take(), 10)) == b"x"
    finally:
        a.close(), b.close(), lst.close()


def _regcache() -> None:
    from rdmamw.memory.regcache import RegCache

    rc = RegCache(lambda addr, n: (addr, n), lambda h: None)
    assert rc.max_bytes == config.get("RDMAMW_REGCACHE_BYTES")


def _pinned_budget() -> None:
    from rdmamw.providers.verbs import probe as verbs_device

    set_to = config.get("RDMAMW_VERBS_PINNED_BYTES")
    assert verbs_device.pinned_budget() == set_to or (set_to == 0
                                                       and verbs_device.pinned_budget() > 0)


def _pool() -> None:
    from rdmamw.memory.pool import BufferPool

    p = BufferPool()
    buf = p.acquire(4096)
    buf.release()
    p.close()


def _threshold() -> None:
    from rdmamw.memory import thresholds

    assert thresholds.lookup("shm")["threshold"] == config.get("RDMAMW_RNDV_THRESHOLD")
    _roundtrip("shm")


def _comm() -> None:
    from rdmamw.bootstrap import World
    from rdmamw.collectives import allreduce
    from rdmamw.collectives.comm import Communicator

    w = World(0, 1, "test", "solo", {0: {"host": "h", "hostname": "h"}})
    c = Communicator(w)
    for n in (1, 1000, 1 << 20):
        assert c.chunk_elems(4, n) >= 1
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(allreduce(x, comm=c), x)
    c.close()


def _coll_timeout() -> None:
    from rdmamw.bootstrap import World
    from rdmamw.collectives import allreduce
    from rdmamw.collectives.comm import Communicator

    c = Communicator(World(0, 1, "test", "solo", {0: {"host": "h", "hostname": "h"}}))
    assert c.timeout == config.get("RDMAMW_COLL_TIMEOUT")
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(allreduce(x, comm=c), x)      # a deadline that far holds
    c.close()


def _results() -> None:
    from rdmamw.collectives import results

    results._pool = None
    try:
        a = results.empty((1 << 16,), np.dtype(np.float32))
        assert a.shape == (1 << 16,)
        assert results.pool().max_bytes == config.get("RDMAMW_COLL_RESULT_BYTES")
    finally:
        results._pool = None


def _ps_ring() -> None:
    from rdmamw.ps.job import ps_ring

    slots, slot_size = ps_ring()
    _roundtrip("shm", slots=slots, slot_size=slot_size)


def _ps_init_timeout() -> None:
    from rdmamw.ps.server import KVServer

    assert KVServer({}).init_timeout == config.get("RDMAMW_PS_INIT_TIMEOUT")


def _ps_reply_timeout() -> None:
    """A reply sent under the bound: delivered (a worker that reads is never dropped)."""
    from rdmamw.ps import wire
    from rdmamw.ps.server import KVServer
    from tests.support.helpers import make_pair

    a, b, lst = make_pair(slots=4, slot_size=4096)
    try:
        srv = KVServer({0: b})
        assert srv.reply_timeout == config.get("RDMAMW_PS_REPLY_TIMEOUT")
        a.send(wire.pack(wire.SYNC, id=1))
        while not srv.serve_once():
            pass
        assert wire.unpack(a.recv(timeout=5))["op"] == wire.OK and not srv.lost
    finally:
        a.close(), b.close(), lst.close()


def _ps_pull_tries() -> None:
    """A one-sided pull with that many tries: whole (a shard nobody changes needs one)."""
    from rdmamw.ps.onesided import ExposedShard, ShardReader
    from rdmamw.ps.worker import KVWorker
    from tests.support.helpers import make_pair

    a, b, lst = make_pair(slots=4, slot_size=4096)
    try:
        tries = KVWorker([a], pull="one-sided").tries
        assert tries == config.get("RDMAMW_PS_PULL_TRIES")
        shard = ExposedShard({0: b}, lambda: (3, 5))
        arr = np.arange(1000.0)
        shard.add("k", arr)
        with shard:
            pass
        reader = ShardReader(a)
        reader.take(shard.offer(0)["rm"])
        out = {"k": np.zeros(1000)}
        assert reader.read(["k"], out, tries) == {"version": 3, "merged": 5}
        assert np.array_equal(out["k"], arr) and reader.torn == 0
    finally:
        a.close(), b.close(), lst.close()


def _launcher(name: str, value: int) -> Callable[[], None]:
    """detect() with ``name`` = ``value`` and the variables it goes with."""
    from rdmamw.bootstrap import env as benv

    rank_of = {"RDMAMW_WORLD_SIZE": "RDMAMW_RANK", "WORLD_SIZE": "RANK",
               "OMPI_COMM_WORLD_SIZE": "OMPI_COMM_WORLD_RANK", "PMI_SIZE": "PMI_RANK",
               "SLURM_NTASKS": "SLURM_PROCID"}
    size_of = {v: k for k, v in rank_of.items()}
    local = {"LOCAL_WORLD_SIZE": "WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE": "OMPI_COMM_WORLD_SIZE",
             "MPI_LOCALNRANKS": "PMI_SIZE", "SLURM_NTASKS_PER_NODE": "SLURM_NTASKS",
             "LOCAL_RANK": "WORLD_SIZE"}
    v = str(value)
    base = {"MASTER_ADDR": "127.0.0.1"}
    if name in rank_of:
        e = {name: v, rank_of[name]: "0"}
    elif name in size_of:
        e = {name: v, size_of[name]: str(value + 1)}
    elif name in local:
        e = {name: v, local[name]: str(max(value, 1)),
             rank_of.get(local[name], "RANK"): "0"}
    elif name in ("RDMAMW_MASTER_PORT", "MASTER_PORT", "DMLC_PS_ROOT_PORT"):
        e = {"RDMAMW_RANK": "0", "RDMAMW_WORLD_SIZE": "2", name: v}
    elif name == "SLURM_JOB_ID":
        e = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", name: v}
    elif name in ("DMLC_NUM_SERVER", "DMLC_NUM_WORKER"):
        e = {"DMLC_ROLE": "scheduler", "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1",
             name: v}
    else:                       # DMLC_SERVER_ID / DMLC_WORKER_ID
        role = "server" if name == "DMLC_SERVER_ID" else "worker"
        count = "DMLC_NUM_SERVER" if role == "server" else "DMLC_NUM_WORKER"
        e = {"DMLC_ROLE": role, "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1",
             count: str(value + 1), name: v}

    def run() -> None:
        info = benv.detect({**base, **e})
        assert 0 < info.master_port < 65536 and info.world_size >= 1
        if name in rank_of or name in size_of:
            assert (info.rank if name in size_of else info.world_size) == value
    return run


def _metrics_port() -> None:
    """The endpoint of RDMAMW_METRICS_PORT (+ local rank 0) serves a scrape (or, on a
    port this user may not bind, is logged and left out), then stops."""
    import urllib.request

    import rdmamw.metrics as metrics
    pytest.importorskip("prometheus_client")
    metrics.from_environment()
    try:
        if metrics._endpoint is not None:
            url = f"http://127.0.0.1:{metrics._endpoint.port}/metrics"
            assert b"rdmamw_sent_bytes_total" in urllib.request.urlopen(url, timeout=10).read()
    finally:
        metrics.stop()


def _metrics_host_port() -> None:
    """The host's endpoint of RDMAMW_METRICS_HOST_PORT, with this process alone in it,
    serves its series (or, on a port this user may not bind, is logged and left out),
    then stops: the port is free again and the process's file gone."""
    import urllib.request

    import rdmamw.metrics as metrics
    from rdmamw.metrics import members
    pytest.importorskip("prometheus_client")
    port = config.get("RDMAMW_METRICS_HOST_PORT")
    metrics.from_environment()
    try:
        host = metrics._host
        assert host is not None
        end = time.monotonic() + 5
        while not host.serving and host.thread.is_alive() and time.monotonic() < end:
            time.sleep(0.01)            # (the thread ends if it cannot bind the port)
        if host.serving:
            url = f"http://127.0.0.1:{port}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read()
            assert f"rdmamw_host_endpoint_pid {os.getpid()}.0".encode() in text
            assert b"rdmamw_host_rank_up{" in text and b"rdmamw_sent_bytes_total" in text
    finally:
        metrics.stop()
    # this process left the host's endpoint (another process of the run, at this port
    # before, may still be listed: the dead are kept GONE_KEEP s; a CI run met one)
    assert os.getpid() not in [m.pid for m in members.members(port)]


def _metrics_http() -> None:
    """An endpoint's server with RDMAMW_METRICS_TIMEOUT and _MAX_CONNECTIONS as set
    answers a scrape, then stops."""
    import urllib.request

    from rdmamw.metrics.http import Server
    s = Server("127.0.0.1", 0, {}, lambda _accept: (200, "text/plain", b"ok")).start()
    try:
        assert urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics",
                                      timeout=10).read() == b"ok"
    finally:
        s.close()


def _metrics_peers() -> None:
    """A reading with channels to 2 peers: at most RDMAMW_METRICS_MAX_PEERS of their own."""
    from rdmamw import observe
    from rdmamw.metrics import readings

    class Fake:
        provider, peer = "fake", "fake://"

        def __init__(self, rank: int) -> None:
            self.peer_rank = rank

        def stats(self) -> dict:
            return {"bytes": 1}

    saved = observe._open, observe._closed, readings._labels
    observe._open, observe._closed, readings._labels = {}, {}, {}   # no labels given yet
    chans = [Fake(1), Fake(2)]
    try:
        for ch in chans:
            observe.register(ch)
        got = sorted(v["rdmamw_sent_bytes_total"] for v in readings.read().channels.values())
        own = min(2, config.get("RDMAMW_METRICS_MAX_PEERS"))
        assert got == {0: [2], 1: [1, 1], 2: [1, 1]}[own]
    finally:
        for ch in chans:
            observe.retire(ch)
        observe._open, observe._closed, readings._labels = saved


def _trace_limit() -> None:
    """A timeline keeps RDMAMW_TRACE_MAX_EVENTS spans and counts the others dropped."""
    import rdmamw.trace as trace
    limit = config.get("RDMAMW_TRACE_MAX_EVENTS")
    with tempfile.TemporaryDirectory() as d, trace.record(os.path.join(d, "t.json")) as tr:
        n = min(limit, 3) + 2
        for _ in range(n):
            tr.span("x", "test", tr.clock(), {})
        assert (len(tr.spans), tr.dropped) == (min(limit, n), n - min(limit, n))


def _trace_records() -> None:
    """The channels' timeline keeps RDMAMW_TRACE_MAX_RECORDS records and counts the
    others dropped (each shm send of one message writes one: test_trace_batches)."""
    import rdmamw.trace as trace
    from rdmamw.engine import _engine
    from tests.support.helpers import make_pair
    limit = config.get("RDMAMW_TRACE_MAX_RECORDS")
    a, b, lst = make_pair(provider="shm")
    try:
        with tempfile.TemporaryDirectory() as d:
            with trace.record(os.path.join(d, "t.json")) as tr:
                for i in range(4):
                    a.send(b"m%d" % i)
                    b.recv(timeout=10).release()
            kept = len(tr.records) // _engine.TRACE_RECORD_BYTES
    finally:
        a.close(), b.close(), lst.close()
    assert (kept, tr.records_dropped) == (min(limit, 4), 4 - min(limit, 4))


def _local_rank(name: str) -> Callable[[], None]:
    def run() -> None:
        from rdmamw.metrics import local_rank
        assert local_rank() == config.get(name)
    return run


#: setting -> the path that uses it
PATHS: dict[str, Callable[[], None]] = {
    **{n: _both for n in ("RDMAMW_SLOTS", "RDMAMW_SLOT_SIZE", "RDMAMW_SPIN_US",
                          "RDMAMW_OPEN_TIMEOUT", "RDMAMW_MAX_MESSAGE_SIZE",
                          "RDMAMW_MAX_PEER_RING", "RDMAMW_HANDSHAKE_TIMEOUT",
                          "RDMAMW_LISTEN_BACKLOG", "RDMAMW_PROOF_TIMEOUT",
                          "RDMAMW_UNPROVEN_PER_SOURCE", "RDMAMW_UNPROVEN_GRACE",
                          "RDMAMW_UNPROVEN_MAX")},
    **{n: lambda: _roundtrip("shm") for n in ("RDMAMW_SHM_ASSIST", "RDMAMW_SHM_ASSIST_CHUNK",
                                              "RDMAMW_SHM_ASSIST_STALL")},
    "RDMAMW_SHM_STAGING": _shm_staged,
    "RDMAMW_VERBS_PINNED_BYTES": _pinned_budget,
    **{n: lambda: _roundtrip("tcp") for n in ("RDMAMW_TCP_HEARTBEAT",
                                              "RDMAMW_TCP_PEER_TIMEOUT",
                                              "RDMAMW_TCP_HOST_TIMEOUT")},
    "RDMAMW_AIO_SPIN_US": _aio,
    "RDMAMW_REGCACHE_BYTES": _regcache,
    "RDMAMW_POOL_BYTES": _pool, "RDMAMW_POOL_SHARDS": _pool,
    "RDMAMW_RNDV_THRESHOLD": _threshold,
    **{n: _comm for n in ("RDMAMW_COLL_SLOTS", "RDMAMW_COLL_SLOT_SIZE", "RDMAMW_COLL_MIN_CHUNK",
                          "RDMAMW_COLL_CHUNK", "RDMAMW_COLL_SPIN_US", "RDMAMW_COLL_PIECES")},
    "RDMAMW_COLL_RESULT_BYTES": _results,
    "RDMAMW_COLL_TIMEOUT": _coll_timeout,
    "RDMAMW_PS_SLOTS": _ps_ring, "RDMAMW_PS_SLOT_SIZE": _ps_ring,
    "RDMAMW_PS_INIT_TIMEOUT": _ps_init_timeout,
    "RDMAMW_PS_REPLY_TIMEOUT": _ps_reply_timeout,
    "RDMAMW_PS_PULL_TRIES": _ps_pull_tries,
    "RDMAMW_METRICS_PORT": _metrics_port,
    "RDMAMW_METRICS_HOST_PORT": _metrics_host_port,
    "RDMAMW_METRICS_MAX_PEERS": _metrics_peers,
    "RDMAMW_METRICS_TIMEOUT": _metrics_http, "RDMAMW_METRICS_MAX_CONNECTIONS": _metrics_http,
    "RDMAMW_TRACE_MAX_EVENTS": _trace_limit, "RDMAMW_TRACE_MAX_RECORDS": _trace_records,
    **{n: _local_rank(n) for n in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                   "SLURM_LOCALID")},
}
LAUNCH = ("RDMAMW_RANK", "RDMAMW_WORLD_SIZE", "RDMAMW_MASTER_PORT", "RANK", "WORLD_SIZE",
          "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
          "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
          "MPI_LOCALNRANKS", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
          "SLURM_JOB_ID", "DMLC_NUM_SERVER", "DMLC_NUM_WORKER", "DMLC_SERVER_ID",
          "DMLC_WORKER_ID", "DMLC_PS_ROOT_PORT")
#: run in their own tests below (a job's init) or only on a device
ELSEWHERE = {
    "RDMAMW_INIT_TIMEOUT": "test_init_timeout_at_its_bounds",
    **{n: "the verbs provider's (a device; tests/providers/test_verbs.py in the VM)"
       for n in ("RDMAMW_VERBS_PORT", "RDMAMW_VERBS_GID_INDEX", "RDMAMW_VERBS_SQ_DEPTH",
                 "RDMAMW_VERBS_RQ_DEPTH", "RDMAMW_VERBS_INLINE", "RDMAMW_VERBS_EVENT",
                 "RDMAMW_VERBS_POLL_MS", "RDMAMW_VERBS_TIMEOUT", "RDMAMW_VERBS_RING_START",
                 "RDMAMW_VERBS_WINDOWS", "RDMAMW_VERBS_READ_CHUNK")},
}
#: (setting, end) whose path may refuse the value with a typed error, and why
MAY_REFUSE = {
    ("RDMAMW_SLOTS", "max"): "a ring of 2^20 slots is more than RDMAMW_MAX_PEER_RING lets "
                             "the peer hold",
    ("RDMAMW_SLOT_SIZE", "max"): "the same: 128 slots of 1 GiB",
    ("RDMAMW_PS_SLOTS", "max"): "the same", ("RDMAMW_PS_SLOT_SIZE", "max"): "the same",
    ("RDMAMW_MAX_PEER_RING", "min"): "0: the peer holds no ring at all",
    ("RDMAMW_MAX_MESSAGE_SIZE", "min"): "1 byte: the 4-byte message is too large",
    ("RDMAMW_OPEN_TIMEOUT", "min"): "1 ms may be too short for the handshake",
    ("RDMAMW_HANDSHAKE_TIMEOUT", "min"): "the same",
    ("RDMAMW_PROOF_TIMEOUT", "min"): "the same: 1 ms for the token proof",
    ("RDMAMW_TCP_PEER_TIMEOUT", "min"): "1 ms of silence loses the peer",
    ("RDMAMW_SHM_ASSIST_STALL", "min"): "1 ms without progress fails an assisted copy",
    ("RDMAMW_SHM_STAGING", "min"): "a 1-byte staging area takes no large message",
}


def test_every_numeric_setting_has_a_finite_range_and_a_path_here():
    for s in NUMERIC:
        assert s.maximum < float("inf") and s.minimum <= s.maximum, s.name
        assert s.name in PATHS or s.name in LAUNCH or s.name in ELSEWHERE, s.name
    assert {n for n, _ in MAY_REFUSE} <= set(PATHS)


@pytest.mark.parametrize("end", ["min", "max"])
@pytest.mark.parametrize("name", [s.name for s in NUMERIC if s.name not in ELSEWHERE])
def test_a_setting_at_its_bound_is_honoured_or_refused_typed(name, end, monkeypatch):
    s = config.setting(name)
    value = s.minimum if end == "min" else s.maximum
    monkeypatch.setenv(name, _text(s, value))
    assert config.get(name) == value
    run = _launcher(name, int(value)) if name in LAUNCH else PATHS[name]
    threads = threading.active_count()
    try:
        run()
    except RdmamwError as e:
        if (name, end) not in MAY_REFUSE:
            raise
        assert not isinstance(e, ConfigError), e
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads


@pytest.mark.parametrize("name, text", [
    ("RDMAMW_OPEN_TIMEOUT", "1e18"), ("RDMAMW_HANDSHAKE_TIMEOUT", "1e18"),
    ("RDMAMW_TCP_PEER_TIMEOUT", "1e18"), ("RDMAMW_TCP_HEARTBEAT", "61"),
    ("RDMAMW_SHM_STAGING", "0"), ("RDMAMW_COLL_SLOTS", "100000000000000000000000"),
    ("RDMAMW_WORLD_SIZE", "100000000"), ("RDMAMW_PS_SLOTS", str((1 << 20) + 1)),
    ("RDMAMW_COLL_PIECES", str(1 << 40)), ("RDMAMW_SPIN_US", "1e300"),
    ("RDMAMW_VERBS_SQ_DEPTH", str(1 << 40)), ("RDMAMW_VERBS_INLINE", "1000000"),
])
def test_finding_10_values_are_refused_by_the_table(name, text, monkeypatch):
    """The values of finding 10 the table took and the code could not (a raw error,
    a dead accept thread, a heartbeat the peer refuses, a hang) are ConfigErrors
    naming the variable."""
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError, match=name):
        config.get(name)


def test_the_listener_survives_the_largest_handshake_timeout(monkeypatch):
    """Finding 10: RDMAMW_HANDSHAKE_TIMEOUT=1e18 killed the listener's accept thread;
    at the table's maximum a stranger that connects and says nothing does not stop a
    real client from being accepted."""
    s = config.setting("RDMAMW_HANDSHAKE_TIMEOUT")
    monkeypatch.setenv("RDMAMW_HANDSHAKE_TIMEOUT", _text(s, s.maximum))
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        host, port = lst.address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port))):
            got: dict = {}
            t = threading.Thread(target=lambda: got.update(ch=lst.accept(timeout=10)))
            t.start()
            with rdmamw.Channel.open(lst.address, timeout=10) as a:
                t.join(10)
                a.send(b"x")
                with got["ch"] as b, b.recv(timeout=10) as m:
                    assert bytes(m) == b"x"


def _init(env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    code = ("import rdmamw, time\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    rdmamw.init()\n"
            "    print('ok', round(time.monotonic() - t, 2))\n"
            "except rdmamw.RdmamwError as e:\n"
            "    print(type(e).__name__, round(time.monotonic() - t, 2))\n")
    keep = {k: v for k, v in os.environ.items() if k not in config.launcher_variables()}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={**keep, "PYTHONPATH": ROOT, **env})


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_init_timeout_at_its_bounds_and_the_largest_world():
    """RDMAMW_INIT_TIMEOUT at 0 and at its maximum, and rank 0 of a job of the largest
    RDMAMW_WORLD_SIZE (1e8 made init hang past its timeout): a typed Timeout within
    the deadline, or a one-rank job that starts."""
    s = config.setting("RDMAMW_INIT_TIMEOUT")
    base = {"RDMAMW_RANK": "0", "RDMAMW_MASTER_ADDR": "127.0.0.1"}
    r = _init({**base, "RDMAMW_WORLD_SIZE": "2", "RDMAMW_MASTER_PORT": _free_port(),
               "RDMAMW_INIT_TIMEOUT": _text(s, s.minimum)})
    assert r.stdout.split()[0] == "Timeout", r.stdout + r.stderr
    r = _init({**base, "RDMAMW_WORLD_SIZE": "1", "RDMAMW_MASTER_PORT": _free_port(),
               "RDMAMW_INIT_TIMEOUT": _text(s, s.maximum)})
    assert r.stdout.split()[0] == "ok", r.stdout + r.stderr
    big = config.setting("RDMAMW_WORLD_SIZE").maximum
    r = _init({**base, "RDMAMW_WORLD_SIZE": str(int(big)), "RDMAMW_MASTER_PORT": _free_port(),
               "RDMAMW_INIT_TIMEOUT": "1"})
    what, secs = r.stdout.split()[:2]
    assert what == "Timeout" and float(secs) < 5, r.stdout[:200] + r.stderr[-2000:]


@pytest.mark.parametrize("content", [
    "{not json", "[1, 2]", '{"intra": 5}', '{"model": {"intra": {"alpha": "x", "beta": 1}}}',
    json.dumps({"intra": {"alpha": 1e-6, "beta": 1e-9}, "inter": {"alpha": -1, "beta": 1e-9},
                "gamma": 1e-9}),
    json.dumps({"intra": {"alpha": 1e-6, "beta": 1e-9}, "inter": {"alpha": 1e-6, "beta": 1e-9},
                "gamma": 1e-9, "algorithm": "butterfly"}),
    "\udcff",
])
def test_a_garbage_cost_model_is_a_config_error(content, tmp_path, monkeypatch):
    """Finding 10: a garbage RDMAMW_COLL_CONFIG gave a raw JSONDecodeError (and wrong
    types a KeyError or TypeError); now a ConfigError naming the file and variable."""
    from rdmamw.collectives import policy

    p = tmp_path / "c.json"
    p.write_bytes(content.encode("utf-8", "surrogateescape"))
    monkeypatch.setenv("RDMAMW_COLL_CONFIG", str(p))
    with pytest.raises(ConfigError, match="RDMAMW_COLL_CONFIG"):
        policy.load()


@pytest.mark.parametrize("text", ["abc", "HOST", "prob"])
def test_a_garbage_topology_is_a_config_error(text, monkeypatch):
    """Finding 10: RDMAMW_COLL_TOPOLOGY=abc gave a raw ValueError when the first
    hierarchical collective resolved it; the table refuses it when it is read."""
    from rdmamw.bootstrap import World
    from rdmamw.collectives import topology
    from rdmamw.collectives.comm import Communicator

    monkeypatch.setenv("RDMAMW_COLL_TOPOLOGY", text)
    with pytest.raises(ConfigError, match="RDMAMW_COLL_TOPOLOGY"):
        config.get("RDMAMW_COLL_TOPOLOGY")
    monkeypatch.setenv("RDMAMW_COLL_TOPOLOGY", "a,b")
    w = World(0, 1, "test", "solo", {0: {"host": "h", "hostname": "h"}})
    with pytest.raises(ConfigError, match="2 labels for 1 ranks"):
        topology.resolve(Communicator(w), None, lambda a, comm: a)
