"""Assisted READ/WRITE on shm (rdmamw/providers/shm/rm_assist.h): the exposing side copies
chunks of the peer's large rendezvous READ or WRITE while it is idle. What it may copy is checked
against its own exposure table; the data must land whole and exactly once reported."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import rdmamw
from rdmamw.errors import ConfigError
from rdmamw.providers.shm import provider as shm
from rdmamw.providers.shm.provider import assist_settings
from tests.support import hooks
from tests.support.helpers import LISTEN_ADDRESS

MiB = 1 << 20
CHUNK = 256 << 10


@pytest.fixture
def pair():
    """Two connected shm transports (no engines): the test hooks drive them."""
    name = f"rdmamw-assist-{os.getpid()}"
    lst = shm.listen(name, slots=8, slot_size=4096)
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("c", lst.accept(timeout=20)))
    t.start()
    ca = shm.connect(name, mode="batched", timeout=20, slots=8, slot_size=4096)
    t.join(20)
    a, b = ca.transport, got["c"].transport
    try:
        if a.cma_modes != (True, True):
            pytest.skip("CMA (process_vm_readv) is not permitted here: no assisted READ")
        yield a, b
    finally:
        a.close(), b.close(), lst.close()


def _addr(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


def test_the_exposing_side_copies_every_chunk_it_claims(pair):
    a, b = pair                      # a exposes its source, b is the reader
    src = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8)
    dst = np.zeros(MiB, np.uint8)
    key = hooks.expose_range(a, _addr(src), src.nbytes)
    hooks.offer_job(b, _addr(src), _addr(dst), MiB, CHUNK, key, 4)
    assert hooks.assist_now(a) == 4
    assert np.array_equal(dst, src)
    assert hooks.job_state(b) == (0b1111, 0)
    assert a.counters()["assist_bytes_given"] == MiB
    assert hooks.assist_now(a) == 0            # nothing left to claim


def test_a_write_job_is_pulled_into_the_exposed_destination(pair):
    a, b = pair                      # a exposes a destination, b is the writer
    src = np.random.default_rng(2).integers(0, 256, MiB + 5, dtype=np.uint8)
    dst = np.zeros(MiB + 5, np.uint8)
    key = hooks.expose_range(a, _addr(dst), dst.nbytes, writable=True)
    hooks.offer_job(b, _addr(dst), _addr(src), MiB + 5, CHUNK, key, 5, write=True)
    assert hooks.assist_now(a) == 5
    assert np.array_equal(dst, src)
    assert hooks.job_state(b) == (0b11111, 0)


def test_a_write_job_into_a_read_only_exposure_copies_nothing(pair):
    a, b = pair
    src = np.ones(MiB, np.uint8)
    dst = np.zeros(MiB, np.uint8)
    key = hooks.expose_range(a, _addr(dst), MiB)           # exposed for READ only
    hooks.offer_job(b, _addr(dst), _addr(src), MiB, CHUNK, key, 4, write=True)
    assert hooks.assist_now(a) == 0
    assert not dst.any()


@pytest.mark.parametrize("case", ["outside", "past_end", "one_past_end", "wrong_key", "write_only",
                                  "too_many_chunks", "chunks_too_small", "chunk_zero"])
def test_a_job_outside_what_was_exposed_copies_nothing(pair, case):
    a, b = pair
    src = np.full(2 * MiB, 7, np.uint8)
    dst = np.zeros(2 * MiB, np.uint8)
    base, n, chunk, length = _addr(src), 4, CHUNK, MiB
    key = hooks.expose_range(a, base, MiB, writable=(case == "write_only"))
    remote = base
    if case == "outside":
        remote = base + MiB                          # the unexposed second half
    elif case == "past_end":
        remote, length, n = base + CHUNK, MiB, 4     # runs 256 KiB past the end
    elif case == "one_past_end":
        remote = base + 1                            # its last byte is one past the end
    elif case == "wrong_key":
        key ^= 0x100
    elif case == "too_many_chunks":
        n, chunk = 65, MiB // 64
    elif case == "chunks_too_small":
        n = 5                                        # 5 x 256 KiB > 1 MiB: bad geometry
    elif case == "chunk_zero":
        chunk = 0
    hooks.offer_job(b, remote, _addr(dst), length, chunk, key, n)
    assert hooks.assist_now(a) == 0
    assert not dst.any()
    assert hooks.job_state(b) == (0, 0)


def test_a_destination_the_helper_cannot_write_is_marked_bad_not_a_crash(pair):
    a, b = pair
    src = np.ones(MiB, np.uint8)
    key = hooks.expose_range(a, _addr(src), MiB)
    hooks.offer_job(b, _addr(src), 4096, MiB, CHUNK, key, 4)   # page 1: unmapped
    assert hooks.assist_now(a) == 4
    assert hooks.job_state(b) == (0b1111, 0b1111)     # the reader redoes them


def _valid_geometry(length: int, chunk: int, n: int) -> bool:
    """n chunks of ``chunk`` bytes cover ``length`` exactly, the last one not empty."""
    return 2 <= n <= 64 and 0 < chunk <= length and (n - 1) * chunk < length <= n * chunk


KEYS = ("own",) * 7 + ("other", "stale", "own+1", "own-1", "own+gen", "high")


@st.composite
def edge_jobs(draw) -> tuple:
    """A job whose start, end, chunk geometry and key sit at or one off their limits
    (the exposure is 1 MiB; "other" is another live exposure, "stale" a removed one);
    about a fifth of them are sound, so both sides of each limit are tried."""
    if draw(st.booleans()):         # the start at -1 / 0 / +1, any end
        off = draw(st.sampled_from([-1, 0, 1]))
        length = max(1, MiB - off + draw(st.one_of(st.sampled_from([-1, 0, 1]),
                                                   st.integers(-MiB, 0))))
    else:                           # the end one short of / at / one past the exposure's
        off = draw(st.one_of(st.sampled_from([0, 1, -1, CHUNK]), st.integers(-CHUNK, MiB)))
        length = max(1, MiB - off + draw(st.sampled_from([-1, 0, 1])))
    if draw(st.integers(0, 9)) < 7:     # sound: 2..64 chunks, each between the limits
        n = draw(st.one_of(st.sampled_from([2, 4, 64]), st.integers(2, 64)))
        per, wide = -(-length // n), -(-length // (n - 1))
        chunk = draw(st.one_of(st.sampled_from([per, wide - 1]),
                               st.integers(per, max(per, wide - 1))))
    else:                               # one off: too few / many chunks, too small / big
        n = draw(st.sampled_from([0, 1, 2, 4, 64, 65, 255]))
        per, wide = -(-length // max(n, 1)), -(-length // max(n - 1, 1))
        chunk = draw(st.sampled_from([per - 1, wide, 0, length, length + 1, 2 * MiB]))
    return off, length, max(chunk, 0), n, draw(st.sampled_from(KEYS)), draw(st.booleans()), \
        draw(st.sampled_from([True] * 6 + [False]))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=edge_jobs())
@example(job=(0, MiB + 1, (MiB + 1) // 4 + 1, 4, "own", False, True))  # one byte past the end
@example(job=(0, MiB + 1, (MiB + 1) // 4 + 1, 4, "own", True, True))
@example(job=(-1, MiB, CHUNK, 4, "own", False, True))                   # one byte before
@example(job=(1, MiB, CHUNK, 4, "own", True, True))                     # shifted one past
@example(job=(0, MiB, CHUNK, 4, "own", False, True))                    # exactly the exposure
@example(job=(0, MiB, CHUNK, 4, "other", False, True))                  # another's key
@example(job=(0, MiB, CHUNK, 4, "own", True, False))                    # read-only: no WRITE
def test_fuzzed_jobs_do_exactly_what_the_exposure_allows(pair, job):
    """a exposes the second MiB of ``mem`` (for the job's access, or the other one);
    b offers a job at the edges of it. A job inside the exposure, under its key, with
    a sound geometry is done whole (every chunk, the exact bytes); any other is
    refused (nothing claimed, nothing copied): both sides of each limit."""
    off, length, chunk, n, which, write, same_access = job
    a, b = pair
    mem = np.full(4 * MiB, 9, np.uint8)
    exposed = mem[MiB:2 * MiB]
    exposed[:] = 5
    other = np.zeros(4 * MiB, np.uint8) if not write else np.full(4 * MiB, 3, np.uint8)
    spare = np.zeros(4096, np.uint8)
    stale = hooks.expose_range(a, _addr(spare), spare.nbytes, writable=write)
    hooks.unexpose_range(a, stale)
    key = hooks.expose_range(a, _addr(exposed), MiB, writable=write == same_access)
    other_key = hooks.expose_range(a, _addr(spare), spare.nbytes, writable=write)
    k = {"own": key, "other": other_key, "stale": stale, "own+1": key + 1, "own-1": key - 1,
         "own+gen": key + 0x100, "high": key | 0x10000}[which]
    try:
        hooks.offer_job(b, _addr(exposed) + off, _addr(other), length, chunk, k & 0xFFFFFFFF, n,
                     write=write)
        ok = (which == "own" and same_access and off >= 0 and off + length <= MiB
              and _valid_geometry(length, chunk, n))
        did = hooks.assist_now(a)
        assert did == (n if ok else 0), (job, did)
        assert hooks.job_state(b) == (((1 << n) - 1, 0) if ok else (0, 0))
        assert (mem[:MiB] == 9).all() and (mem[2 * MiB:] == 9).all()
        event("done" if ok else "refused")
        if not ok:
            assert (exposed == 5).all() and (other == (3 if write else 0)).all()
        elif write:
            assert (exposed[off:off + length] == 3).all()
            assert (exposed[:off] == 5).all() and (exposed[off + length:] == 5).all()
        else:
            assert (other[:length] == 5).all() and not other[length:].any()
            assert (exposed == 5).all()
    finally:
        hooks.unexpose_range(a, key)
        hooks.unexpose_range(a, other_key)


def _stream_receiver(address, strategy, sizes, q):
    try:
        with rdmamw.listen(address, slots=8, slot_size=4096, rendezvous=strategy) as lst:
            q.put(lst.address)
            ch = lst.accept(timeout=30)
            out = []
            bufs = [np.zeros(size, np.uint8) for size in sizes]
            if strategy == "write":
                for buf in bufs:
                    ch.post_recv(buf)
            ch.send(b"go").wait(timeout=30)
            for size, buf in zip(sizes, bufs, strict=True):
                if strategy == "write":
                    assert len(ch.recv(timeout=60)) == size
                else:
                    assert ch.recv_into(buf, timeout=60) == size
                want = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
                out.append(bool(np.array_equal(buf, want)))
            ch.send(b"ok").wait(timeout=30)
            q.put({"same": out, "stats": ch.stats()})
            ch.recv(timeout=30)
    except rdmamw.ChannelClosed:
        pass
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put({"error": repr(e)})


@pytest.mark.parametrize("strategy", ["read", "write"])
@pytest.mark.parametrize("assist", ["1M", "0"])
def test_streams_between_processes_land_whole(monkeypatch, assist, strategy):
    monkeypatch.setenv("RDMAMW_SHM_ASSIST", assist)
    sizes = [MiB, 4 * MiB + 123, 16 * MiB + 4097, 3 * MiB - 1, 600 << 10]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_stream_receiver,
                    args=(LISTEN_ADDRESS["shm"](), strategy, sizes, q))
    p.start()
    try:
        ch = rdmamw.Channel.open(q.get(timeout=60), timeout=30, rendezvous=strategy)
        assert bytes(ch.recv(timeout=60)) == b"go"       # the destinations are posted
        for size in sizes:
            msg = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            ch.send(msg).wait(timeout=60)            # the sender idles here: it may help
        assert bytes(ch.recv(timeout=60)) == b"ok"
        rep = q.get(timeout=60)
        sender = ch.stats()
        ch.close()
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert "error" not in rep, rep
    assert rep["same"] == [True] * len(sizes)
    recv = rep["stats"]
    big = sum(s >= MiB for s in sizes)
    init, helper = (recv, sender) if strategy == "read" else (sender, recv)
    if strategy == "write":
        assert sender["rndv_writes"] == len(sizes)
    if assist == "0":
        assert init["assist_jobs"] == 0 and helper["assist_bytes_given"] == 0
    else:
        assert init["assist_jobs"] == big
        assert (init["assist_chunks_got"] > 0) == (helper["assist_bytes_given"] > 0)


def test_settings_come_from_the_environment(monkeypatch):
    assert assist_settings() == (MiB, CHUNK, 10.0)
    monkeypatch.setenv("RDMAMW_SHM_ASSIST", "4M")
    monkeypatch.setenv("RDMAMW_SHM_ASSIST_CHUNK", "1M")
    monkeypatch.setenv("RDMAMW_SHM_ASSIST_STALL", "2.5")
    assert assist_settings() == (4 * MiB, MiB, 2.5)
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("RDMAMW_SHM_ASSIST_STALL", bad)
        with pytest.raises(ConfigError, match="RDMAMW_SHM_ASSIST_STALL"):
            assist_settings()
    monkeypatch.setenv("RDMAMW_SHM_ASSIST_STALL", "10")
    monkeypatch.setenv("RDMAMW_SHM_ASSIST", "lots")
    with pytest.raises(ConfigError, match="RDMAMW_SHM_ASSIST"):
        assist_settings()


HELPER_DIES = """
import sys, numpy, rdmamw
ch = rdmamw.Channel.open(sys.argv[1], timeout=60, slot_size=4096, rendezvous="read")
msg = numpy.arange(int(sys.argv[2]), dtype=numpy.uint8)
h = ch.send(msg)
print("sent", flush=True)
h.wait(timeout=60)          # idle here: helps with the receiver's READ until signalled
sys.stdin.read()            # then stays (holding the channel open) until killed
"""


SIZE = 256 * MiB
#: 64 chunks of 4 MiB: each takes the helper milliseconds, so a helper signalled while
#: it has finished one and chunks are left is inside (or claiming) the next
ASSIST_CHUNK = "4M"


def _read_with_helper(monkeypatch, sig=None, stall: str = "10") -> dict:
    """A sender process sends 256 MiB (arange pattern) by READ and helps with it while
    it idles. With ``sig``: a watcher sends it ``sig`` as soon as the receiver's job
    record shows the helper finished a chunk while chunks were still unclaimed (the
    helper is then mid-chunk) and notes that state; without: the helper is SIGKILLed
    after ``recv_into`` returned. What happened: {"n": bytes or None (PeerLost),
    "took": s, "at_signal": {fin, claimed, n}, "stats", "after": what a recv then raised}."""
    import signal
    import subprocess
    import sys
    import time

    from rdmamw.channel import channel as chmod
    monkeypatch.setenv("RDMAMW_SHM_ASSIST_CHUNK", ASSIST_CHUNK)
    monkeypatch.setenv("RDMAMW_SHM_ASSIST_STALL", stall)
    tps = []
    make = chmod._make
    monkeypatch.setattr(chmod, "_make", lambda cls, conn, *a, **k: (
        tps.append(conn.transport), make(cls, conn, *a, **k))[1])
    out: dict = {}
    with rdmamw.listen(LISTEN_ADDRESS["shm"](), slot_size=4096, rendezvous="read") as lst:
        p = subprocess.Popen([sys.executable, "-c", HELPER_DIES, lst.address, str(SIZE)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            ch = lst.accept(timeout=60)
            tp = tps[-1]
            assert p.stdout.readline().strip() == "sent"
            buf = np.zeros(SIZE, np.uint8)
            stop = threading.Event()

            def watch() -> None:       # signal the helper inside a chunk of the job
                n = SIZE // (4 * MiB)
                while not stop.is_set():
                    fin, claimed = hooks.job_state(tp)[0], hooks.job_claimed(tp)
                    if fin and claimed < n:
                        p.send_signal(sig)
                        out["at_signal"] = {"fin": bin(fin).count("1"), "claimed": claimed,
                                            "n": n}
                        return

            w = threading.Thread(target=watch)
            if sig is not None:
                w.start()
            t0 = time.monotonic()
            try:
                out["n"] = ch.recv_into(buf, timeout=30)
            except rdmamw.PeerLost:
                out["n"] = None
            out["took"] = time.monotonic() - t0
            stop.set()
            if sig is not None:
                w.join()
            out["stats"] = ch.stats()
            if out["n"] is not None:
                assert out["n"] == SIZE
                assert np.array_equal(buf, np.arange(SIZE, dtype=np.uint8))
            if sig is None:             # the copy is over: now the helper dies
                p.kill()
                p.wait(30)
                with pytest.raises(rdmamw.PeerLost):
                    ch.recv(timeout=10)
            ch.close()
            return out
        finally:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(30)


def test_a_helper_killed_mid_chunk_is_peer_lost(monkeypatch):
    """SIGKILL the sender while it holds a chunk of the receiver's READ of its 256 MiB:
    that chunk will never be finished, so the receiver gets PeerLost (at once: the
    process is gone), not a hang and not a part of the message."""
    import signal
    out = _read_with_helper(monkeypatch, signal.SIGKILL)
    print("killed mid-chunk:", out["at_signal"], out["n"], round(out["took"], 3))
    assert out["at_signal"]["fin"] >= 1 and out["at_signal"]["claimed"] < 64, out
    assert out["n"] is None and out["took"] < 5, out


def test_a_helper_stopped_mid_chunk_is_peer_lost_after_the_stall_timeout(monkeypatch):
    """SIGSTOP the sender while it holds a chunk: it is alive but that chunk stays
    unfinished; after RDMAMW_SHM_ASSIST_STALL (1 s) the receiver gives up: PeerLost."""
    import signal
    out = _read_with_helper(monkeypatch, signal.SIGSTOP, stall="1")
    print("stopped mid-chunk:", out["at_signal"], out["n"], round(out["took"], 3))
    assert out["at_signal"]["fin"] >= 1 and out["at_signal"]["claimed"] < 64, out
    assert out["n"] is None and 1.0 <= out["took"] < 10, out


def test_a_helper_killed_after_the_copy_leaves_the_whole_message(monkeypatch):
    """The helper copied part of the message and is killed once it has arrived: the
    message is whole and right (checked in the helper function), the next call PeerLost."""
    out = _read_with_helper(monkeypatch)
    print("killed after:", out["n"], out["stats"]["assist_chunks_got"], "chunks by the helper")
    assert out["n"] == SIZE and out["stats"]["assist_chunks_got"] > 0, out
