"""Dask distributed's ``rdmamw://`` comm (rdmamw.dask, issue 31 items 1-2), driven
through the public ``distributed.comm`` API the way distributed's own comm tests
drive tcp://: connect/listen, many listeners and concurrent clients, frames above the
eager limit, close and abort from either side, a killed peer, a stranger without the
token, thousands of open/close cycles; and a LocalCluster of 4 worker processes
doing dask.dataframe's P2P shuffle, compared with tcp://."""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

distributed = pytest.importorskip("distributed", reason="dask distributed is not installed "
                                  "(pip install rdmamw[dask])")
import dask  # noqa: E402
from distributed.comm import CommClosedError, connect, listen, registry  # noqa: E402
from distributed.protocol import to_serialize  # noqa: E402

import rdmamw.dask  # noqa: E402
from rdmamw import errors  # noqa: E402
from rdmamw.aio import Channel  # noqa: E402
from rdmamw.dask import comm as dcomm  # noqa: E402
from tests.support.dask_echo import echo  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
EP = "rdmamw.dask.comm:RdmamwBackend"
#: both ways a Dask comm reaches a peer of this host: shm, and tcp (what another
#: host gets)
WAYS = [pytest.param(True, id="shm"), pytest.param(False, id="tcp")]


@pytest.fixture(scope="module", autouse=True)
def entry_point(tmp_path_factory):
    """The ``distributed.comm.backends`` entry point as ``pip install`` makes it; a
    tree whose installed metadata predates it (an editable install of an older
    checkout) gets the same entry point from a dist-info made here, for this process
    and the worker processes it starts."""
    if any(ep.value == EP for ep in importlib.metadata.entry_points(
            group="distributed.comm.backends", name="rdmamw")):
        yield
        return
    site = tmp_path_factory.mktemp("ep")
    info = site / "rdmamw_dask_entry-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rdmamw-dask-entry\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(f"[distributed.comm.backends]\nrdmamw = {EP}\n")
    sys.path.append(str(site))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old, str(site)) if p)
    try:
        yield
    finally:
        sys.path.remove(str(site))
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(autouse=True)
def no_verbs():
    """These tests are about shm and tcp (the "tcp" way is asserted as such): in the
    soft-RoCE VM a listener would otherwise offer verbs and the comms would move to it
    (tests/integrations/test_dask_verbs.py covers that)."""
    with dask.config.set({"distributed.comm.rdmamw.verbs": False}):
        yield


def run(coro, timeout=60):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def use_shm(on: bool):
    return dask.config.set({"distributed.comm.rdmamw.shm": on})


# ---- registration --------------------------------------------------------------------
def test_the_backend_is_found_through_its_entry_point():
    registry.backends.pop("rdmamw", None)
    backend = registry.get_backend("rdmamw")
    assert isinstance(backend, dcomm.RdmamwBackend)
    assert rdmamw.dask.register() == "rdmamw"
    assert registry.backends["rdmamw"] is backend      # idempotent: kept


def test_pyproject_declares_the_entry_point_and_the_extra():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["distributed.comm.backends"]["rdmamw"] == EP
    extra = meta["project"]["optional-dependencies"]["dask"]
    assert {r.split("=")[0].split("[")[0] for r in extra} >= {"dask", "distributed"}
    # `make test` installs [test]: the dask tests must not skip on a fresh clone
    assert "rdmamw[dask]" in meta["project"]["optional-dependencies"]["test"]


def test_addresses():
    b = registry.get_backend("rdmamw")
    assert b.get_address_host("10.1.2.3:80") == "10.1.2.3"
    assert b.get_address_host_port("10.1.2.3:80") == ("10.1.2.3", 80)
    assert b.resolve_address("localhost:80") == "127.0.0.1:80"
    assert b.get_local_address_for("127.0.0.1:80") == "127.0.0.1"


# ---- messages ----------------------------------------------------------------------
@pytest.mark.parametrize("shm", WAYS)
def test_round_trip_small_and_large_frames(shm):
    """Small messages, empty frames and frames far above the eager limit (64 KiB)
    come back equal, on shm and on tcp."""
    big = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)

    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            comm = await connect(lst.contact_address)
            assert comm.extra_info["provider"] == ("shm" if shm else "tcp")
            assert comm.same_host is shm
            for msg in ({"op": "ping"}, {"x": b""}, {"x": to_serialize(big)},
                        {"t": to_serialize(big[:600_000].reshape(3, -1).T)},  # strided
                        {"a": to_serialize(big[:70_000]), "b": b"x" * 200_000, "c": b""}):
                back = await comm.write(msg) and await comm.read()
                assert back.keys() == msg.keys()
                for k, v in msg.items():
                    v = getattr(v, "data", v)
                    assert np.array_equal(np.frombuffer(back[k], np.uint8)
                                          if isinstance(back[k], bytes) else back[k],
                                          np.frombuffer(v, np.uint8)
                                          if isinstance(v, bytes) else v), k
            await comm.close()

    with use_shm(shm):
        run(main())


def test_frames_with_zeros_in_their_shape():
    """An empty DataFrame's frames are views of shape (1, 0): they go (as empty frames),
    not a TypeError that drops the comm (the P2P shuffle sends such shards)."""
    import pandas as pd
    empty = pd.DataFrame({"a": np.array([], "f8"), "b": np.array([], "i8")})

    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            comm = await connect(lst.contact_address)
            await comm.write({"df": to_serialize(empty), "n": 1})
            back = await comm.read()
            await comm.close()
        return back

    back = run(main())
    pd.testing.assert_frame_equal(back["df"], empty)
    assert back["n"] == 1


def test_a_frame_above_the_channels_limit_goes_in_pieces(monkeypatch):
    """A frame larger than the largest message the peer's channel takes (here 1 MiB;
    the echo's reply is pickled, which distributed.comm.shard does not cut) goes as
    pieces of one batch, received into slices of one buffer: whole, never refused."""
    monkeypatch.setenv("RDMAMW_MAX_MESSAGE_SIZE", str(1 << 20))
    big = np.arange(5 << 20, dtype=np.uint8)

    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            comm = await connect(lst.contact_address)
            await comm.write({"x": to_serialize(big)})
            back = await comm.read()
            await comm.close()
        return back["x"]

    assert np.array_equal(run(main()), big)


def test_one_send_batch_per_message_no_copy_and_right_sized_receives(monkeypatch):
    """A message is one send_batch of header + frames, the frames the caller's own
    memory; each frame is received by recv_into a buffer of exactly its size."""
    sent, received = [], []
    arr = np.arange(300_000, dtype=np.float64)           # 2.4 MB: rendezvous
    real_send, real_into = Channel.send_batch, Channel.recv_into

    async def send_batch(self, msgs):
        sent.append(list(msgs))
        return await real_send(self, msgs)

    async def recv_into(self, buf):
        n = await real_into(self, buf)
        received.append((np.asarray(memoryview(buf).obj).nbytes, n))  # the whole buffer
        return n

    monkeypatch.setattr(Channel, "send_batch", send_batch)
    monkeypatch.setattr(Channel, "recv_into", recv_into)

    async def main():
        got = []

        async def keep(comm):
            got.append(await comm.read())
        async with listen("rdmamw://127.0.0.1:0", keep) as lst:
            comm = await connect(lst.contact_address)
            sent.clear()
            received.clear()
            await comm.write({"x": to_serialize(arr), "y": b"abc"})
            while not got:
                await asyncio.sleep(0.01)
            await comm.close()
        return got[0]

    back = run(main())
    assert np.array_equal(back["x"], arr)
    assert len(sent) == 1                                  # one send_batch
    assert any(np.shares_memory(np.asarray(f), arr) for f in sent[0][1:]
               if not isinstance(f, bytes))                # the array itself, no copy
    assert received and all(size == n for size, n in received)
    assert arr.nbytes in {n for _size, n in received}


@pytest.mark.parametrize("shm", WAYS)
def test_large_frames_land_in_the_pool_and_a_kept_one_is_never_reused(shm):
    """A received frame of POOLED_FRAME bytes and up comes from the process's buffer
    pool and goes back when the last view of it is gone: the next frame of its size
    reuses the memory. One the reader still holds (here through a numpy view, as a
    deserialized array holds it) keeps its bytes while more frames arrive."""
    from rdmamw.memory import pool
    n = dcomm.POOLED_FRAME * 4
    fills = [np.full(n, v, np.uint8) for v in (0xAA, 0xBB, 0xCC, 0xDD)]

    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            comm = await connect(lst.contact_address)
            stats0 = pool.default_pool().stats()
            await comm.write({"x": to_serialize(fills[0])})
            kept = (await comm.read())["x"][1:]             # a view of the frame, held
            for f in fills[1:]:
                await comm.write({"x": to_serialize(f)})
                back = (await comm.read())["x"]
                assert np.array_equal(back, f)
                del back                                    # this one goes back
            gc.collect()
            stats1 = pool.default_pool().stats()
            await comm.close()
        return kept, stats0, stats1

    with use_shm(shm):
        kept, s0, s1 = run(main())
    assert np.array_equal(kept, fills[0][1:])               # never overwritten
    # 8 frames received in all (4 here, 4 in the echo, which is this process too)
    assert s1["acquires"] - s0["acquires"] == 8
    assert s1["reuses"] - s0["reuses"] >= 4


def test_concurrent_writes_on_one_comm_stay_whole():
    """Writers that share a comm (a BatchedSend and an RPC, say) each send a whole
    message: a batch that waits for ring slots half-way is not interleaved with
    another's frames."""
    async def main():
        got = []
        done = asyncio.get_running_loop().create_future()

        async def keep(comm):
            for _ in range(8):
                got.append(await comm.read())
            done.set_result(None)
        async with listen("rdmamw://127.0.0.1:0", keep) as lst:
            comm = await connect(lst.contact_address)
            await asyncio.gather(*(comm.write(
                {"i": i, "p": [to_serialize(np.full(30_000 + i, i, np.uint8))
                               for _ in range(12)]}) for i in range(8)))
            await done
            await comm.close()
        return got

    with dask.config.set({"distributed.comm.rdmamw.slots": 4}):    # the ring fills
        got = run(main())
    assert sorted(m["i"] for m in got) == list(range(8))
    for m in got:
        assert all(len(p) == 30_000 + m["i"] and (p == m["i"]).all() for p in m["p"])


@pytest.mark.parametrize("shm", WAYS)
def test_many_listeners_and_concurrent_clients(shm):
    """3 listeners, 8 clients each, all at once, several RPCs per comm: Dask opens
    a comm per concurrent RPC between the same two processes."""
    async def main():
        lsts = [await listen("rdmamw://127.0.0.1:0", echo) for _ in range(3)]

        async def client(addr, i):
            comm = await connect(addr)
            for j in range(4):
                payload = bytes([i % 256]) * (10 + 40_000 * j)
                await comm.write({"i": i, "j": j, "p": payload})
                assert await comm.read() == {"i": i, "j": j, "p": payload}
            await comm.close()
        await asyncio.gather(*(client(lst.contact_address, i)
                               for i, lst in enumerate(lsts * 8)))
        for lst in lsts:
            lst.stop()

    with use_shm(shm):
        run(main())


# ---- closing ------------------------------------------------------------------------
@pytest.mark.parametrize("shm", WAYS)
@pytest.mark.parametrize("how", ["close", "abort"])
@pytest.mark.parametrize("side", ["client", "server"])
def test_close_or_abort_from_either_side(shm, how, side):
    """The other side's pending read and its next write raise CommClosedError; this
    side's comm is closed."""
    async def main():
        server_comm = asyncio.get_running_loop().create_future()

        async def handler(comm):
            server_comm.set_result(comm)
            await asyncio.sleep(30)
        async with listen("rdmamw://127.0.0.1:0", handler) as lst:
            client = await connect(lst.contact_address)
            server = await server_comm
            closer, other = (client, server) if side == "client" else (server, client)
            reading = asyncio.ensure_future(other.read())
            await asyncio.sleep(0.05)
            if how == "close":
                await closer.close()
            else:
                closer.abort()
            assert closer.closed()
            with pytest.raises(CommClosedError):
                await reading
            assert other.closed()
            with pytest.raises(CommClosedError):
                await other.write({"after": 1})
            with pytest.raises(CommClosedError):
                await closer.read()

    with use_shm(shm):
        run(main())


def test_stopping_a_listener_leaves_its_comms_working():
    """As with tcp://, stop() ends accepting; comms already handed to the handler stay
    (their owner closes them), and new connects fail."""
    async def main():
        lst = await listen("rdmamw://127.0.0.1:0", echo)
        comm = await connect(lst.contact_address)
        await comm.write("before stop")         # the listener's side of the handshake
        assert await comm.read() == "before stop"   # is over (stop() aborts those)
        lst.stop()
        await comm.write("after stop")
        assert await comm.read() == "after stop"
        await comm.close()
        with pytest.raises(OSError):
            await connect(lst.contact_address, timeout=0.5)

    run(main())


def test_a_message_written_before_close_is_still_read():
    async def main():
        got = asyncio.get_running_loop().create_future()

        async def handler(comm):
            await asyncio.sleep(0.1)            # the client closed meanwhile
            got.set_result([await comm.read(), await comm.read()])
        async with listen("rdmamw://127.0.0.1:0", handler) as lst:
            client = await connect(lst.contact_address)
            await client.write({"n": 1})
            await client.write({"n": 2})
            await client.close()
            assert await got == [{"n": 1}, {"n": 2}]

    run(main())


def _spawn(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


KILLED_CLIENT = """
    import asyncio, os, sys, dask
    import rdmamw.dask; rdmamw.dask.register()
    from distributed.comm import connect
    async def main():
        with dask.config.set({"distributed.comm.rdmamw.shm": %r}):
            comm = await connect(%r)
        await comm.write({"pid": os.getpid(), "x": b"y" * 100000})
        print("sent", flush=True)
        await asyncio.sleep(60)
    asyncio.run(main())
"""


@pytest.mark.parametrize("shm", WAYS)
def test_a_peer_killed_mid_stream_is_comm_closed(shm):
    async def main():
        first = asyncio.get_running_loop().create_future()
        after = asyncio.get_running_loop().create_future()

        async def handler(comm):
            first.set_result(await comm.read())
            try:
                await comm.read()
            except BaseException as e:      # noqa: BLE001 - the type is the test
                after.set_result(e)
        async with listen("rdmamw://127.0.0.1:0", handler) as lst:
            proc = _spawn(KILLED_CLIENT % (shm, lst.contact_address))
            try:
                msg = await asyncio.wait_for(first, 30)
                os.kill(msg["pid"], 9)
                err = await asyncio.wait_for(after, 10)
            finally:
                proc.kill()
                proc.communicate()
            assert isinstance(err, CommClosedError), repr(err)

    run(main())


# ---- who may connect ----------------------------------------------------------------
STRANGER = """
    import sys
    import rdmamw
    try:
        rdmamw.Channel.open(%r, timeout=5)
    except Exception as e:
        print(type(e).__name__, e)
    else:
        print("ACCEPTED")
"""


def test_a_stranger_without_the_token_is_refused_and_the_listener_keeps_serving(
        monkeypatch):
    monkeypatch.setenv("RDMAMW_TOKEN", "the-clusters-secret")

    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            host, port = lst.get_host_port()
            # a process with another token, at the listener's tcp address
            proc = _spawn(STRANGER % f"tcp://{host}:{port}", RDMAMW_TOKEN="a-guess")
            out, _ = await asyncio.get_running_loop().run_in_executor(
                None, proc.communicate)
            assert "ACCEPTED" not in out and out.strip(), out
            # and bytes that are no handshake at all
            with socket.create_connection((host, port)) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
                s.settimeout(5)
                assert s.recv(4096) is not None
            for shm in (True, False):           # still serving, both ways
                with use_shm(shm):
                    comm = await connect(lst.contact_address)
                await comm.write({"ok": shm})
                assert await comm.read() == {"ok": shm}
                await comm.close()

    run(main())


def test_a_failed_accept_does_not_stop_the_listener(monkeypatch):
    """The provider's accept can raise for a local reason (out of descriptors); the
    listener logs it and goes on accepting."""
    from rdmamw import aio
    real, failed = aio.Listener.accept, []

    async def accept(self):
        if self not in failed:              # each listener (tcp, shm) fails once
            failed.append(self)
            raise OSError(24, "Too many open files")
        return await real(self)
    monkeypatch.setattr(aio.Listener, "accept", accept)

    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            for shm in (True, False):
                with use_shm(shm):
                    comm = await connect(lst.contact_address, timeout=10)
                await comm.write(shm)
                assert await comm.read() is shm
                await comm.close()

    run(main())
    assert len(failed) == 2


def test_a_peer_that_sends_no_comm_header_is_hung_up_on():
    """A same-user process that opens the shm name with a plain channel and sends
    junk: the listener drops it (its channel closes) and keeps serving."""
    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            host, port = lst.get_host_port()
            for junk in (b"x", b"RDK2" + b"\xff" * 60):
                ch = await Channel.open(f"shm://{dcomm.shm_name(host, port)}", slots=4)
                await ch.send(junk)
                with pytest.raises((errors.ChannelClosed, errors.PeerLost)):
                    while True:         # the listener's handshake, then the hang-up
                        (await ch.recv()).release()
                ch.close()
            comm = await connect(lst.contact_address)
            await comm.write("fine")
            assert await comm.read() == "fine"
            await comm.close()

    run(main(), timeout=20)


def test_no_listening_off_loopback_without_a_token(monkeypatch):
    monkeypatch.delenv("RDMAMW_TOKEN", raising=False)

    async def main():
        with pytest.raises(rdmamw.dask.TokenRequired, match="RDMAMW_TOKEN"):
            await listen("rdmamw://0.0.0.0:0", echo)
        monkeypatch.setenv("RDMAMW_TOKEN", "s3cret")
        lst = await listen("rdmamw://0.0.0.0:0", echo)
        try:
            assert lst.listen_address.startswith("rdmamw://0.0.0.0:")
            assert not lst.contact_address.startswith("rdmamw://0.0.0.0:")
            comm = await connect(lst.contact_address)      # shm on the wildcard name
            await comm.write(1)
            assert await comm.read() == 1
            await comm.close()
        finally:
            lst.stop()

    assert isinstance(rdmamw.dask.TokenRequired("x"), errors.ConfigError)
    run(main())


# ---- churn --------------------------------------------------------------------------
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    """Threads other than the loop's default executor (a bounded pool that starts its
    threads lazily, up to its max_workers, whatever the comms do)."""
    return sum(not t.name.startswith("asyncio_") for t in threading.enumerate())


def churn(cycles: int, shm: bool) -> tuple[int, int, int, int]:
    """``cycles`` connect/handshake/RPC/close cycles; fds and threads before and after."""
    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            async def cycle(i):
                comm = await connect(lst.contact_address)
                await comm.write(i)
                assert await comm.read() == i
                await comm.close()
            for i in range(20):             # the executor's threads, the pools: warm
                await cycle(i)
            await asyncio.sleep(0.2)
            before = _fds(), _threads()
            for i in range(cycles):
                await cycle(i)
            for _ in range(50):             # the listener's last closes settle
                if _fds() <= before[0]:
                    break
                await asyncio.sleep(0.02)
            return (*before, _fds(), _threads())

    with use_shm(shm):
        return run(main(), timeout=900)


@pytest.mark.parametrize("shm", WAYS)
def test_open_close_cycles_leak_no_fds_or_threads(shm):
    fd0, th0, fd1, th1 = churn(2000 if shm else 200, shm)
    assert fd1 <= fd0 and th1 <= th0, (fd0, th0, fd1, th1)


@pytest.mark.slow
@pytest.mark.parametrize("shm", WAYS)
def test_ten_thousand_open_close_cycles(shm):
    import resource
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fd0, th0, fd1, th1 = churn(10_000, shm)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert fd1 <= fd0 and th1 <= th0, (fd0, th0, fd1, th1)
    assert grew < 64 * 1024, f"max RSS grew {grew} KiB"


# ---- a real workload ---------------------------------------------------------------
def p2p_shuffle(protocol: str, nparts: int, rows: int):
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client, LocalCluster

    rng = np.random.default_rng(7)
    df = pd.DataFrame({"k": rng.integers(0, 1000, rows), "v": rng.random(rows),
                       "s": rng.integers(0, 1 << 30, rows).astype(str)})
    # forkserver: a worker starts in half the time spawn takes (no fresh interpreter)
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}), \
            LocalCluster(protocol=protocol, host="127.0.0.1", n_workers=4,
                         threads_per_worker=1, processes=True, dashboard_address=None,
                         worker_dashboard_address=None) as cluster, Client(cluster) as c:
        assert all(a.startswith(protocol) for a in c.scheduler_info()["workers"])
        ddf = dd.from_pandas(df, npartitions=nparts)
        out = ddf.shuffle("k", shuffle_method="p2p", npartitions=nparts)
        parts = c.compute(out.to_delayed())
        got = [p.result() for p in parts]
        import dask.array as da
        x = da.from_array(np.arange(rows * 8, dtype="f8").reshape(rows, 8), chunks=(rows // 8, 8))
        y = x.rechunk((rows, 1), method="p2p").compute()
    return [g.sort_values(["k", "v"]).reset_index(drop=True) for g in got], y


def test_p2p_shuffle_and_rechunk_on_four_worker_processes_equal_tcp():
    import pandas as pd
    got, got_y = p2p_shuffle("rdmamw://", 8, 40_000)
    want, want_y = p2p_shuffle("tcp://", 8, 40_000)
    assert np.array_equal(got_y, want_y)
    assert np.array_equal(got_y, np.arange(40_000 * 8, dtype="f8").reshape(40_000, 8))
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        pd.testing.assert_frame_equal(g, w)
    assert sum(len(g) for g in got) == 40_000


def shuffle_with_a_killed_worker(protocol: str) -> tuple[str, int]:
    """A P2P shuffle during which one worker process is SIGKILLed: what it came to
    (the result's row count, or the exception's type) and a task run afterwards."""
    import signal
    import time

    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client, LocalCluster

    rows = 400_000
    df = pd.DataFrame({"k": np.arange(rows) % 977, "v": np.arange(rows, dtype="f8")})
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}), \
            LocalCluster(protocol=protocol, host="127.0.0.1", n_workers=4,
                         threads_per_worker=1, processes=True, dashboard_address=None,
                         worker_dashboard_address=None) as cluster, Client(cluster) as c:
        out = dd.from_pandas(df, npartitions=16).shuffle(
            "k", shuffle_method="p2p", npartitions=16)
        fut = c.compute(out.map_partitions(len).sum())
        pids = c.run(os.getpid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                "shuffle-transfer" in str(key) for keys in c.processing().values()
                for key in keys):
            time.sleep(0.02)
        os.kill(next(iter(pids.values())), signal.SIGKILL)
        try:
            what = str(fut.result(timeout=120))
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            what = type(e).__name__
        after = c.submit(lambda: 41 + 1, pure=False).result(timeout=60)
    return what, after


@pytest.mark.slow
def test_a_worker_killed_during_a_p2p_shuffle_ends_as_on_tcp():
    got = shuffle_with_a_killed_worker("rdmamw://")
    want = shuffle_with_a_killed_worker("tcp://")
    print("killed worker: rdmamw", got, "tcp", want)
    assert got == want and got[1] == 42, (got, want)


# ---- bench/dask_shuffle.py (issue 31 item 4) -----------------------------------------
def _shuffle_bench():
    import importlib.util
    spec = importlib.util.spec_from_file_location("dask_shuffle",
                                                  ROOT / "bench" / "dask_shuffle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shuffle_benchs_sums_ignore_row_order_and_catch_a_changed_value():
    """What the bench compares across schemes: per-partition sums that a P2P shuffle's
    arrival order cannot change, but one changed bit of one value does."""
    b = _shuffle_bench()
    part = b.make_part(3, 1000)
    assert part["i"].tolist() == list(range(3000, 4000))
    assert part.equals(b.make_part(3, 1000))                # seeded: the same everywhere
    base = b.sums(part)
    assert base.equals(b.sums(part.sample(frac=1, random_state=1)))
    changed = part.copy()
    changed.loc[17, "f4"] = np.nextafter(changed.loc[17, "f4"], 2.0)
    assert not base.equals(b.sums(changed))
    other = b.sums(changed)
    inputs = {"rdmamw": b._totals(base), "tcp": b._totals(base)}
    assert b.agree({"rdmamw": [base, base], "tcp": [base]}, inputs, 1)
    assert not b.agree({"rdmamw": [base, base], "tcp": [other]}, inputs, 1)
    assert not b.agree({"rdmamw": [base, other], "tcp": [base]}, inputs, 1)
    assert not b.agree({"rdmamw": [base], "tcp": [base]}, inputs, 2)      # a lost part
    assert not b.agree({"rdmamw": [base], "tcp": [base]},
                       {"rdmamw": b._totals(other), "tcp": b._totals(base)}, 1)


def test_the_shuffle_bench_runs_both_schemes_and_they_agree():
    """bench/dask_shuffle.py at a tiny size: one P2P shuffle per scheme on 2 worker
    processes each (4 in the real run), the JSON it prints, both schemes' sums equal."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "dask_shuffle.py"),
                          "--gb", "0.01", "--reps", "1", "--part-mib", "1", "--workers", "2",
                          "--json"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    res = json.loads(out.stdout)
    assert res["identical"] is True and res["workers"] == 2 and res["reps"] == 1
    assert res["partitions"] == 11 and res["rows"] >= (1 << 30) // 100 // 64
    assert res["totals"]["n"] == res["rows"]
    assert res["totals"]["i"] == res["rows"] * (res["rows"] - 1) // 2
    for s in ("rdmamw", "tcp"):
        assert len(res["times_s"][s]) == 1 and res["median_s"][s] > 0
    assert res["rdmamw_over_tcp"] == pytest.approx(res["median_s"]["rdmamw"]
                                                   / res["median_s"]["tcp"])
    assert res["paired"] == pytest.approx([res["times_s"]["rdmamw"][0]
                                           / res["times_s"]["tcp"][0]])
