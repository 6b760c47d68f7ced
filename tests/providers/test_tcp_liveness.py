"""tcp liveness judges the peer process and its host apart (issue 29): a peer process
stopped or starved (SIGSTOP, a loaded machine) is not lost before
``RDMAMW_TCP_PEER_TIMEOUT`` (30 s), even while this side keeps sending into its full
buffers; a killed one closes its socket and is ``PeerLost`` at once; a host that
acknowledges nothing is lost after ``RDMAMW_TCP_HOST_TIMEOUT``
(tests/integrations/test_multihost.py, link down)."""

from __future__ import annotations

import signal
import time

import pytest

import rdmamw
from tests.channel.test_faults import spawn

PEER = """
import sys, rdmamw
ch = rdmamw.Channel.open(sys.argv[1], timeout=60, slots=8, slot_size=4096)
print("ready", flush=True)
n = 0
while True:
    for m in ch.recv_batch(timeout=60):
        if bytes(m) == b"end":
            ch.send(b"got %d" % n).wait(10)
            ch.recv(timeout=60)
        n += 1
"""


def _connected():
    lst = rdmamw.listen("tcp://127.0.0.1:0", slots=8, slot_size=4096)
    p = spawn(PEER, lst.address, wait_ready=False)
    ch = lst.accept(timeout=60)
    assert p.stdout.readline().strip() == "ready"
    return lst, p, ch


def _fill_for(ch, seconds: float) -> int:
    """Send 4 KiB messages for ``seconds`` (the stopped peer's ring and socket buffers
    fill; the rest time out); how many went."""
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            ch.send_batch([b"x" * 4000] * 8, timeout=0.05)
            sent += 8
        except rdmamw.Timeout as e:
            sent += e.sent
    return sent


def test_a_peer_stopped_for_3_s_is_not_lost_while_this_side_sends():
    lst, p, ch = _connected()
    try:
        p.send_signal(signal.SIGSTOP)
        sent = _fill_for(ch, 3.0)
        p.send_signal(signal.SIGCONT)
        ch.send(b"end").wait(10)
        assert bytes(ch.recv(timeout=30)) == b"got %d" % sent
    finally:
        p.kill(), p.wait(), ch.close(), lst.close()


def test_a_peer_stopped_for_3_s_is_not_lost_while_this_side_waits():
    lst, p, ch = _connected()
    try:
        p.send_signal(signal.SIGSTOP)
        with pytest.raises(rdmamw.Timeout):
            ch.recv(timeout=3.0)
        p.send_signal(signal.SIGCONT)
        ch.send(b"end").wait(10)
        assert bytes(ch.recv(timeout=30)) == b"got 0"
    finally:
        p.kill(), p.wait(), ch.close(), lst.close()


@pytest.mark.parametrize("stopped", [False, True])
def test_a_killed_peer_is_lost_in_under_2_s(stopped):
    """Killed while this side waits to receive, or while it was stopped with its buffers
    full: the kernel closes its socket, PeerLost without waiting for any timeout."""
    lst, p, ch = _connected()
    try:
        if stopped:
            p.send_signal(signal.SIGSTOP)
            _fill_for(ch, 0.5)
        t0 = time.monotonic()
        p.kill()
        with pytest.raises(rdmamw.PeerLost):
            if stopped:
                for _ in range(100_000):
                    ch.send_batch([b"x" * 4000] * 8, timeout=5)
            else:
                ch.recv(timeout=30)
        assert time.monotonic() - t0 < 2.0
    finally:
        p.kill(), p.wait(), ch.close(), lst.close()
