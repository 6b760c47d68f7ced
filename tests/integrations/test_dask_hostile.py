"""The ``rdmamw://`` comm (rdmamw.dask.comm) against peers that are legal rdmamw
channels but bad Dask peers: one announcing a tiny largest message (what our write
builds for a frame stays bounded by the frame), and one writing comm headers that lie
(every failure of read() is Dask's CommClosedError, nothing huge is allocated)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import struct
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("distributed", reason="dask distributed is not installed "
                    "(pip install rdmamw[dask])")
from distributed.comm import CommClosedError, connect, listen  # noqa: E402
from distributed.comm.core import FatalCommClosedError  # noqa: E402

import rdmamw.dask  # noqa: E402
from rdmamw import channel as _sync  # noqa: E402
from rdmamw.aio import Channel, Listener, open_channel  # noqa: E402
from rdmamw.dask import comm as dcomm  # noqa: E402
from tests.support.dask_echo import echo  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(coro, timeout=60):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


async def pair(name: str, **peer: object) -> tuple[dcomm.RdmamwComm, Channel, Listener]:
    """Our comm (the opener) and the peer's raw channel (the acceptor, opened with
    ``peer``'s options: what it announces in the handshake)."""
    lst = Listener(_sync.listen(f"shm://{name}", slots=8, **peer))
    accepted = asyncio.ensure_future(lst.accept())
    ch = await open_channel(f"shm://{name}", 5.0, slots=8)
    theirs = await accepted
    return dcomm.RdmamwComm(ch, "rdmamw://127.0.0.1:1", "rdmamw://127.0.0.1:2"), theirs, lst


# ---- a peer whose largest message is tiny ---------------------------------------------
TINY_PEER = """
    import asyncio, resource, sys, time
    sys.path.insert(0, %r)
    from tests.integrations.test_dask_hostile import pair
    from distributed.comm import CommClosedError
    from distributed.protocol import to_serialize

    def rss_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    async def main():
        comm, theirs, lst = await pair("dask-tiny-peer-%d", max_message_size=%d)
        frame = bytearray(1 << 20)
        frame[::4096] = b"x" * len(frame[::4096])
        await asyncio.sleep(0.2)
        before, t0 = rss_mib(), time.monotonic()
        try:
            await asyncio.wait_for(comm.write({"x": to_serialize(frame)}), 10)
            outcome = "written"
        except CommClosedError as e:
            outcome = "CommClosedError " + str(e)
        except BaseException as e:
            outcome = type(e).__name__ + " " + str(e)
        print("OUTCOME", outcome[:300])
        print("GROWTH_MIB", rss_mib() - before)
        print("SECONDS", time.monotonic() - t0)
        comm.abort()
        theirs.close()
        lst.close()

    asyncio.run(main())
"""


@pytest.mark.parametrize("peer_max", [1, 1000])
def test_a_peer_with_a_tiny_largest_message_costs_no_more_than_the_frame(peer_max):
    """A peer announcing max_message_size=1 (legal for a channel): writing one 1 MiB
    frame to it used to build a piece (a memoryview) per byte, ~320 MiB of RSS. Now
    the comm is refused quickly with CommClosedError, and the write's peak RSS growth
    stays within a few MiB."""
    code = textwrap.dedent(TINY_PEER % (str(ROOT), peer_max, peer_max))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert float(got["GROWTH_MIB"]) < 4, out.stdout
    assert got["OUTCOME"].startswith("CommClosedError"), out.stdout
    assert "max_message_size" in got["OUTCOME"], out.stdout
    assert float(got["SECONDS"]) < 5, out.stdout


def test_a_peer_with_a_usable_largest_message_still_gets_pieces():
    """The floor refuses only the absurd: a peer taking 64 KiB messages gets a 1 MiB
    frame in pieces, whole."""
    async def main():
        comm, theirs, lst = await pair("dask-64k-peer", max_message_size=64 << 10)
        try:
            mine = dcomm.RdmamwComm(theirs, "rdmamw://127.0.0.1:2", "rdmamw://127.0.0.1:1")
            frame = bytes(range(256)) * 4096
            _, back = await asyncio.gather(comm.write(frame), mine.read())
            assert back == frame
        finally:
            comm.abort()
            theirs.close()
            lst.close()

    run(main(), timeout=30)


# ---- a peer whose headers lie ---------------------------------------------------------
def header(count: int, piece: int, sizes: list[int], magic: bytes = dcomm._MAGIC) -> bytes:
    return dcomm._HEADER.pack(magic, count, piece) + struct.pack(f"<{len(sizes)}Q", *sizes)


LIES = {
    # a frame of 2**60 bytes: no MemoryError-sized allocation, no MemoryError
    "huge frame": ([header(1, 1 << 20, [1 << 60])], []),
    "frames summing past any memory": ([header(3, 1 << 20, [1 << 40] * 3)], []),
    # a piece size of 0 or 1 byte: pieces of nothing, or a million receives
    "zero piece": ([header(1, 0, [10])], [b"x" * 10]),
    "one-byte pieces": ([header(1, 1, [1 << 20])], [b"x"]),
    # the header promises 100 bytes, the frame that follows has 10 (or 1000)
    "short frame": ([header(1, 1 << 20, [100])], [b"x" * 10]),
    "long frame": ([header(1, 1 << 20, [100])], [b"x" * 1000]),
    # a count that does not match the sizes that follow
    "count above the sizes": ([dcomm._HEADER.pack(dcomm._MAGIC, 5, 1 << 20)
                               + struct.pack("<Q", 3)], [b"abc"]),
    "count of 2**32-1": ([dcomm._HEADER.pack(dcomm._MAGIC, 2**32 - 1, 1 << 20)], []),
    "wrong magic": ([header(1, 1 << 20, [3], magic=b"NOPE")], [b"abc"]),
    "no header at all": ([b"RD"], []),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_header_is_comm_closed(lie):
    import tracemalloc

    first, rest = LIES[lie]

    async def main():
        comm, theirs, lst = await pair(f"dask-liar-{abs(hash(lie))}")
        try:
            await theirs.send_batch([*first, *rest])
            tracemalloc.start()
            try:
                with pytest.raises(CommClosedError) as got:
                    await asyncio.wait_for(comm.read(), 3)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 8 << 20, f"{lie}: {peak} bytes allocated"
            assert comm.closed()
            return got.value
        finally:
            comm.abort()
            theirs.close()
            lst.close()

    err = run(main(), timeout=30)
    assert not isinstance(err.__cause__, MemoryError), repr(err.__cause__)


def test_a_peer_gone_mid_frame_is_comm_closed():
    """The header announces two frames; the peer closes after the first."""
    async def main():
        comm, theirs, lst = await pair("dask-gone-mid-frame")
        try:
            await theirs.send_batch([header(2, 1 << 20, [3, 3]), b"abc"])
            theirs.close()
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(comm.read(), 10)
        finally:
            comm.abort()
            lst.close()

    run(main(), timeout=30)


def announce_late(monkeypatch, delay: float = 0.3) -> None:
    """Every channel says its peer has not announced its largest message yet (0) for
    ``delay`` s after it is first asked: a peer that sets up its side of the channel
    after ours returned from open(), as on a loaded machine."""
    real = _sync.Channel.peer_max_message_size
    first: dict[int, float] = {}

    def late(self):
        t = first.setdefault(id(self), time.monotonic())
        return 0 if time.monotonic() - t < delay else real.__get__(self)

    monkeypatch.setattr(_sync.Channel, "peer_max_message_size", property(late))


@pytest.mark.parametrize("late", [False, True], ids=["announced", "announced-late"])
@pytest.mark.parametrize("small", ["listener", "connector"])
def test_a_dask_peer_with_a_tiny_largest_message_is_refused_at_connect(monkeypatch, small,
                                                                       late):
    """Through Dask's own connect/listen, the side whose RDMAMW_MAX_MESSAGE_SIZE is
    absurd for the comm's framing is refused at connect: CommClosedError (Fatal, on the
    connector facing such a listener: retrying cannot help), the listener serves on.
    Also when the peer's announcement of it comes after open() returned: judged by what
    it says, not by the 0 of "not said yet"."""
    rdmamw.dask.register()
    if late:
        announce_late(monkeypatch)

    settings = dcomm._settings

    async def main():
        if small == "listener":         # its ring's options, kept for what it accepts
            monkeypatch.setattr(dcomm, "_settings",
                                lambda: {**settings(), "max_message_size": 1000})
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            if small == "listener":
                monkeypatch.setattr(dcomm, "_settings", settings)
            else:
                monkeypatch.setenv("RDMAMW_MAX_MESSAGE_SIZE", "1000")
            with pytest.raises(CommClosedError) as got:
                await connect(lst.contact_address, timeout=5)
            if small == "listener":
                assert isinstance(got.value, FatalCommClosedError), repr(got.value)
                assert "max_message_size" in str(got.value)
            monkeypatch.delenv("RDMAMW_MAX_MESSAGE_SIZE", raising=False)
            if small == "connector":
                comm = await connect(lst.contact_address, timeout=5)
                await comm.write("fine")
                assert await comm.read() == "fine"
                await comm.close()

    run(main(), timeout=60)
