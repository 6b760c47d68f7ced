"""A peer killed with SIGKILL: the survivor gets PeerLost within 2 s, no segment
is left behind and no descriptor leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import rdmamw
from tests.support.helpers import LISTEN_ADDRESS, send_until_peer_lost, unique_name, within

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STREAMER = """
import sys, rdmamw
ch = rdmamw.Channel.open(sys.argv[1], timeout=60, slots=8, slot_size=1024)
print("ready", flush=True)
i = 0
while True:
    ch.send_batch([b"%d" % (i + k) for k in range(16)])
    i += 16
"""

SINK = """
import sys, time, rdmamw
lst = rdmamw.listen(sys.argv[1], slots=8, slot_size=1024)
print("ready", flush=True)
ch = lst.accept(timeout=60)
ch.recv_batch(timeout=60)        # take one batch, then stall holding nothing
print("got", flush=True)
time.sleep(60)
"""


def spawn(code: str, address: str, wait_ready: bool = True) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), address],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if wait_ready:
        assert p.stdout.readline().strip() == "ready"
    return p


def memfd_count() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "rdmamw" in os.readlink(f"/proc/self/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


def test_sender_killed_mid_stream_receiver_gets_peer_lost(provider):
    fds = memfd_count()
    with rdmamw.listen(LISTEN_ADDRESS[provider](), slots=8, slot_size=1024) as lst:
        p = spawn(STREAMER, lst.address, wait_ready=False)
        ch = lst.accept(timeout=60)
        assert p.stdout.readline().strip() == "ready"
        received = []
        while len(received) < 200:
            received += [bytes(m) for m in ch.recv_batch(timeout=30)]
        p.send_signal(signal.SIGKILL)
        p.wait()
        t_kill = time.monotonic()
        with pytest.raises(rdmamw.PeerLost):
            while True:     # whatever had arrived is still delivered, then PeerLost
                received += [bytes(m) for m in ch.recv_batch(timeout=30)]
        assert time.monotonic() - t_kill < within(2.0)
        # exactly once, in order, up to the last message that arrived
        assert received == [b"%d" % i for i in range(len(received))]
        ch.close()
    assert memfd_count() == fds


def test_receiver_killed_sender_gets_peer_lost():
    address = f"shm://{unique_name('kill')}"
    p = spawn(SINK, address)
    ch = rdmamw.Channel.open(address, timeout=60, slots=8, slot_size=1024)
    ch.send_batch([b"first"])
    assert p.stdout.readline().strip() == "got"
    p.send_signal(signal.SIGKILL)
    p.wait()
    t_kill = time.monotonic()
    send_until_peer_lost(ch, t_kill)
    ch.close()


def test_blocked_receiver_notices_killed_peer_quickly():
    address = f"shm://{unique_name('kill')}"
    with rdmamw.listen(address) as lst:
        p = subprocess.Popen([sys.executable, "-c",
                              "import sys,time,rdmamw;"
                              "c=rdmamw.Channel.open(sys.argv[1],timeout=60);"
                              "print('ready',flush=True);time.sleep(60)", address],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
        ch = lst.accept(timeout=60)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)           # the receiver is asleep by now, not spinning
        t0 = time.monotonic()
        p.kill()
        with pytest.raises(rdmamw.PeerLost):
            ch.recv(timeout=30)
        assert time.monotonic() - t0 < 2.0
        p.wait()
        ch.close()


FORKING_PEER = """
import os, sys, time, rdmamw
c = rdmamw.Channel.open(sys.argv[1], timeout=60)
pid = os.fork()
if pid == 0:            # a long-lived child: its copy of the side socket stays open
    time.sleep(60)
    os._exit(0)
print("ready", pid, flush=True)
time.sleep(60)
"""


def test_killed_peer_with_a_forked_child_is_lost_by_its_process():
    """Issue 43, finding 6: the peer forks a child that lives on with a copy of the
    side socket (no EOF for us), then is SIGKILLed: the peer *process* is gone, and
    recv() says PeerLost within the bound (the transport watches the peer's pidfd)."""
    address = f"shm://{unique_name('forkkill')}"
    with rdmamw.listen(address) as lst:
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FORKING_PEER), address],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
        child = 0
        try:
            ch = lst.accept(timeout=60)
            word, pid = p.stdout.readline().split()
            assert word == "ready"
            child = int(pid)
            time.sleep(0.3)
            t0 = time.monotonic()
            p.kill()
            p.wait()
            with pytest.raises(rdmamw.PeerLost):
                ch.recv(timeout=10)
            assert time.monotonic() - t0 < 2.0
            ch.close()
        finally:
            if child:
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
            p.wait()
