"""Issue 43, finding 4: a tcp peer that stops reading its socket. Our READ responder
answering it, or our own sends to it, must never freeze this process (the GIL), hold
up close(), or outlast a send's deadline."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import rdmamw
from rdmamw.channel.channel import Channel
from tests.support import hooks
from tests.support.tcp_util import frame, raw_peer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
XREAD_REQ = 8
MiB = 1 << 20


class Ticker:
    """A thread that counts while it can run: its longest pause says whether some
    other thread held the GIL (or froze the process) meanwhile."""

    def __init__(self):
        self.stop = False
        self.longest = 0.0
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        last = time.monotonic()
        while not self.stop:
            time.sleep(0.01)
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def end(self) -> float:
        self.stop = True
        self.t.join()
        return self.longest


@contextlib.contextmanager
def stuck_responder(monkeypatch, size: int):
    """(our channel, its transport, the exposure key): a
    token holder that asked for one READ of ``size`` exposed bytes and reads nothing,
    so our responder is stuck on the full socket."""
    monkeypatch.setenv("RDMAMW_TCP_PEER_TIMEOUT", "10")    # bounds a failing run
    tps = []
    setup = Channel._setup

    def capture(self, tp, *a, **k):
        tps.append(tp)
        return setup(self, tp, *a, **k)

    monkeypatch.setattr(Channel, "_setup", capture)
    src = bytearray(size)
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(ch=lst.accept(timeout=10)))
        t.start()
        s = raw_peer(lst.address)
        t.join()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
        key = hooks.expose_range(tps[-1], addr, len(src))
        s.sendall(frame(XREAD_REQ, region=key, offset=addr, length=len(src)))
        time.sleep(0.5)                     # the responder has filled the socket by now
        try:
            yield got["ch"], tps[-1], key
        finally:
            s.close()


def test_a_token_holder_that_reads_nothing_freezes_neither_sends_nor_close(monkeypatch):
    """It proves the token, asks for one large READ of what we exposed, then never
    reads: our responder is stuck on the full socket. Another thread keeps running,
    a send with a deadline returns by it, close() in bounded time."""
    with stuck_responder(monkeypatch, 64 * MiB) as (ch, _tp, _key):
        ticker = Ticker()
        t0 = time.monotonic()
        try:
            ch.send(b"x", timeout=1)
        except (rdmamw.Timeout, rdmamw.PeerLost):
            pass
        took = time.monotonic() - t0
        t0 = time.monotonic()
        ch.close()
        closed = time.monotonic() - t0
        longest = ticker.end()
    assert took < 1.5, f"send(timeout=1) took {took:.1f} s"
    assert closed < 2.0, f"close() took {closed:.1f} s"
    assert longest < 0.5, f"another thread stood still for {longest:.1f} s"


def test_a_range_is_unexposed_at_once_while_its_reader_reads_nothing(monkeypatch):
    """The responder answering a READ holds the range (so it is not freed under it);
    when the range is wanted back (the engine's unexpose at a send's end or a close)
    while the peer reads nothing, the rest of the answer is copied out (or the
    connection dropped) instead of keeping the caller waiting."""
    with stuck_responder(monkeypatch, 32 * MiB) as (ch, tp, key):
        t0 = time.monotonic()
        hooks.unexpose_range(tp, key)
        took = time.monotonic() - t0
        t0 = time.monotonic()
        ch.close()
        closed = time.monotonic() - t0
    assert took < 1.0, f"unexpose took {took:.1f} s"
    assert closed < 2.0, f"close() took {closed:.1f} s"


STOPPED_PEER = """
import sys, time, rdmamw
ch = rdmamw.Channel.open(sys.argv[1], timeout=30, slots=512, slot_size=65536)
print("ready", flush=True)
time.sleep(120)
"""


def all_stopped(pid: int) -> bool:
    states = []
    for path in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            with open(path) as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        except OSError:
            pass
    return bool(states) and all(s == "T" for s in states)


def test_a_send_to_a_stopped_peer_times_out_by_its_deadline(monkeypatch):
    """An honest peer SIGSTOPped: a batch that fills the socket returns Timeout by its
    deadline, not PeerLost after RDMAMW_TCP_PEER_TIMEOUT."""
    monkeypatch.setenv("RDMAMW_TCP_PEER_TIMEOUT", "8")     # bounds a failing run
    with rdmamw.listen("tcp://127.0.0.1:0") as lst:
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STOPPED_PEER), lst.address],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            ch = lst.accept(timeout=30)
            assert p.stdout.readline().strip() == "ready"
            p.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while not all_stopped(p.pid):
                assert time.monotonic() < deadline, "the peer did not stop"
                time.sleep(0.01)
            # 60 MB: more than both sockets hold, and than the peer's ring (32 MB), so
            # part of the batch is still unsent at the deadline: Timeout says how much went
            batch = [bytes(60000)] * 1000
            t0 = time.monotonic()
            with pytest.raises(rdmamw.Timeout) as e:
                ch.send_batch(batch, timeout=2)
            took = time.monotonic() - t0
            assert took < 2.5, f"send_batch(timeout=2) took {took:.1f} s"
            assert 0 <= e.value.sent < len(batch)
            t0 = time.monotonic()
            ch.close()
            assert time.monotonic() - t0 < 3.0
        finally:
            p.kill()
            p.send_signal(signal.SIGCONT)
            p.wait()
