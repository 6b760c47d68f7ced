"""A clean close loses nothing: a message whose send completed before the peer's
close() is delivered before the receiver sees ChannelClosed, whether the receive
blocks, polls or times out (docs/protocol.md, "Closing"); and the soak's hub, which
checks exactly that, does not end its receive on a ChannelClosed its own tick send
raised (tests/soak/soak.py: "no final report" in CI)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import threading
import time

import msgpack
import pytest

import rdmamw
from rdmamw.errors import ChannelClosed, RdmamwError, Timeout
from tests.support.close_worker import REC, body, plan
from tests.support.helpers import LISTEN_ADDRESS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: channels per test: tcp's close takes about 0.1 s here; verbs runs under TCG in the VM
#: (each set-up takes seconds there)
ROUNDS = {"shm": 400, "verbs": 12}
#: a bound for each open, send, accept and round's receive, only reached when something
#: is wrong (the VM's TCG with the receiver and the peer on one CPU makes a verbs round
#: take seconds, beside the host half of make test more than 10)
PATIENCE = 60


def _soak():
    spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "tests", "soak",
                                                                       "soak.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = mod           # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_the_soak_hub_checks_the_whole_batch_when_a_tick_finds_the_peer_closed(provider):
    """The CI failure: the peer's last batch (its threads' END, its report) came in one
    recv_batch; the hub sent a tick after the first message, the peer had closed by
    then, the send raised ChannelClosed and the hub took it for the end of the receive:
    the report, received, was never looked at."""
    soak = _soak()
    hub = soak.Hub(argparse.Namespace(seed=1, pool_seed=12345, provider=provider))
    try:
        peer = soak.Peer(0, 0, proc=None)
        hub.peers[(0, 0)] = peer
        hub.rng.random = lambda: 0.0    # a tick after every message
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("ch", hub.lst.accept(10)))
        t.start()
        ch = rdmamw.Channel.open(hub.lst.address, timeout=10)
        t.join(10)
        ch.send(soak.HDR.pack(soak.HELLO, 0, 0)).wait(5)
        ch.send_batch([soak.HDR.pack(soak.DATA, 0, 0) + bytes(soak.body_at(hub.pool, 0, 0, 9)),
                       soak.HDR.pack(soak.END, 0, 1),
                       soak.HDR.pack(soak.END, 1 << 31, 0) + msgpack.packb({"counts": [1]})]
                      ).wait(5)
        ch.close()                      # before the hub looks: its first tick finds it
        hub.serve(got["ch"])
        assert hub.failures == []
        assert peer.ended == {0: 1}, "the rest of the batch was dropped"
        assert peer.report == {"counts": [1]}
    finally:
        hub.lst.close()


def _receive_round(ch, how: int, buf: bytearray, rounds: set[int]) -> list[str]:
    """Receive until ChannelClosed (``how``: 0 blocks, 1 polls, 2 short timeouts,
    3 recv_into polls); the round is the one its first message names (handshakes run
    concurrently: accept() need not return the channels in the order they were
    opened), added to ``rounds``. What went wrong."""
    st: dict = {"rnd": None, "seen": [], "want": []}
    bad: list[str] = []

    def take(data) -> None:
        r, t, seq = REC.unpack_from(data)
        if st["rnd"] is None and r not in rounds:
            st["rnd"] = r
            rounds.add(r)
            st["want"] = [sum(s) for s in plan(r)]
            st["seen"] = [0] * len(st["want"])
        seen = st["seen"]
        if r != st["rnd"] or t >= len(seen) or seq != seen[t] or bytes(data) != body(r, t, seq):
            bad.append(f"round {st['rnd']}: got {(r, t, seq)} ({len(data)} B), expected "
                       f"{seen}")
            return
        seen[t] = seq + 1

    end = time.monotonic() + PATIENCE
    while time.monotonic() < end:
        try:
            if how == 3:
                n = ch.recv_into(buf, timeout=0)
                take(memoryview(buf)[:n])
                continue
            for m in ch.recv_batch(timeout=(None, 0, 0.0002)[how]):
                take(m)
                m.release()
        except Timeout:
            continue
        except ChannelClosed:
            break
        except RdmamwError as e:
            return [f"round {st['rnd']} (receive {how}): {type(e).__name__}: {e}"]
    else:
        return [f"round {st['rnd']}: no ChannelClosed within {PATIENCE} s"]
    if st["seen"] != st["want"] or st["rnd"] is None:
        bad.append(f"round {st['rnd']} (receive {how}): ChannelClosed after {st['seen']} "
                   f"of {st['want']} messages")
    try:
        late = ch.recv_batch(timeout=0)
        bad.append(f"round {st['rnd']} (receive {how}): {len(late)} message(s) delivered "
                   f"after ChannelClosed")
    except ChannelClosed:
        pass
    return bad


@pytest.mark.parametrize("slots", [8, 72])
def test_every_message_sent_before_close_comes_before_channel_closed(provider, slots):
    """ROUNDS (or 40) channels from another process: one or two threads send batches
    (some larger than the ring: they go in pieces), wait for them, and close at once.
    The receive blocks, polls, or times out in short slices: every message arrives, in
    order per thread, then ChannelClosed, and nothing is left to deliver after it. A
    ring of 72 slots has two arrival words: a batch that wraps writes word 1 before
    word 0, so a scan between the two sees slots behind a gap."""
    lst = rdmamw.listen(LISTEN_ADDRESS[provider](), slots=slots, slot_size=1024, spin_us=5)
    rounds = ROUNDS.get(provider, 40)
    cpus = os.sched_getaffinity(0)
    one = {min(cpus)}
    # the receiver and the closing peer on one CPU: the peer's last batch and its close
    # land while the receiver is preempted, at any point of its loop (else it takes a
    # loaded machine to put them between a look and the check of the close word)
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.close_worker", lst.address,
                             str(rounds), str(PATIENCE)], cwd=ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT},
                            preexec_fn=lambda: os.sched_setaffinity(0, one))
    bad: list[str] = []
    seen: set[int] = set()
    buf = bytearray(1024)
    try:
        os.sched_setaffinity(0, one)    # this thread only
        for i in range(rounds):
            try:
                ch = lst.accept(timeout=PATIENCE)
            except Timeout:     # (the peer gave up: what it said, with what we saw)
                proc.kill()
                out = proc.communicate()[0] or b""
                bad.append(f"round {i}: no connection within {PATIENCE} s; the peer "
                           f"said: {out.decode(errors='replace')[-2000:]}")
                break
            with ch:
                bad += _receive_round(ch, (0, 1, 3, 2, 1, 3)[i % 6], buf, seen)
            if len(bad) > 5:
                break
        if proc.wait(PATIENCE) != 0 and not bad:
            bad.append(f"the peer failed: {proc.communicate()[0].decode(errors='replace')}")
        assert seen == set(range(rounds)) or bad
    finally:
        os.sched_setaffinity(0, cpus)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        lst.close()
    assert not bad, "\n".join(bad)


@pytest.fixture(autouse=True)
def _quiet_soak_module():
    yield
    sys.modules.pop("soak", None)
