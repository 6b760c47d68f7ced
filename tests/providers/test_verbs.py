"""The verbs provider: what holds without a device (reasons, descriptor checks) on
the host, and what needs one (doorbells, chain splitting, event mode, faults, an
independent pyverbs peer) inside the soft-RoCE VM (`make test`)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import rdmamw
from rdmamw import auth, cli
from rdmamw.channel.channel import Channel, _make
from rdmamw.providers.verbs import provider as verbs
from rdmamw.providers.verbs._block import grant_after
from rdmamw.transport import layout
from rdmamw.transport import wire as _wire
from tests.channel.test_channel_basic import recv_all
from tests.support import hooks
from tests.support.helpers import NO_DEVICE, VERBS_OK, make_pair, send_until_peer_lost, within

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
device = pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE)


# ---- no device needed ------------------------------------------------------------

@pytest.mark.skipif(VERBS_OK, reason="a device is usable here")
def test_unavailable_says_why(capsys):
    for call in (lambda: rdmamw.listen("verbs://127.0.0.1:0"),
                 lambda: rdmamw.Channel.open("verbs://127.0.0.1:1", timeout=0.1)):
        with pytest.raises(rdmamw.ProviderUnavailable, match="verbs:// is unavailable here: .+"):
            call()
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "verbs://" in out and "unavailable" in out and "shm://" in out


def test_without_the_extension_verbs_says_why_and_the_rest_works(monkeypatch):
    from rdmamw.providers.verbs import probe as verbs_device
    monkeypatch.setitem(sys.modules, "rdmamw.providers.verbs._transport", None)
    monkeypatch.delattr(rdmamw.providers, "_verbs", raising=False)
    verbs_device._module.cache_clear()
    try:
        ok, why = verbs_device.status()
        assert not ok and "built without the verbs extension" in why
        with pytest.raises(rdmamw.ProviderUnavailable, match="built without the verbs"):
            rdmamw.listen("verbs://127.0.0.1:0")
        a, b, lst = make_pair(provider="shm")
        a.send(b"still fine")
        assert bytes(b.recv(timeout=5)) == b"still fine"
        a.close(), b.close(), lst.close()
    finally:
        verbs_device._module.cache_clear()


def test_parse_where_and_options():
    w = verbs.parse_where("10.0.0.1:0?event=1&sq_depth=64&device=rxe0")
    assert (w.host, w.port) == ("10.0.0.1", 0)
    assert w.opts["event"] == 1 and w.opts["sq_depth"] == 64 and w.opts["device"] == "rxe0"
    assert verbs.parse_where("[::1]:7").host == "::1"
    for bad in ("nohost", "h:port", "h:70000", "h:1?nope=1", "h:1?sq_depth=x",
                "h:1?read_chunk=-1", "h:1?read_chunk=4G", "h:1?read_chunk=x"):
        with pytest.raises(ValueError):
            verbs.parse_where(bad)


def test_read_chunk_option_and_setting(monkeypatch):
    """``read_chunk`` reads sizes as its setting does; unset, -1 lets the provider
    choose by device (512 KiB on soft-RoCE, no limit elsewhere)."""
    assert verbs.parse_where("h:1").opts["read_chunk"] == -1
    assert verbs.parse_where("h:1?read_chunk=256K").opts["read_chunk"] == 256 << 10
    assert verbs.parse_where("h:1?read_chunk=0").opts["read_chunk"] == 0
    monkeypatch.setenv("RDMAMW_VERBS_READ_CHUNK", "1M")
    assert verbs.parse_where("h:1").opts["read_chunk"] == 1 << 20
    assert verbs.parse_where("h:1?read_chunk=64K").opts["read_chunk"] == 64 << 10
    with pytest.raises(rdmamw.errors.ConfigError, match="RDMAMW_VERBS_READ_CHUNK"):
        verbs.parse_where("h:1?read_chunk=lots")


STRIDE = layout.slot_stride(4096)       # of the ring of endpoint_layout(16, 4096, 8)


def _descriptor(theirs: layout.Layout, **changes) -> dict:
    d = {"v": 1, "qpn": 17, "psn": 5, "gid": bytes(16), "lid": 0, "mtu": 3,
         "addr": 0x7F0000000000, "rkey": 0x1234, "len": theirs.total,
         "regions": [list(r) for r in theirs.regions()], "event": False}
    d.update(changes)
    return d


@pytest.mark.parametrize("changes", [
    {"v": 2}, {"v": "1"}, {"qpn": 0}, {"qpn": 1 << 24}, {"psn": -1}, {"gid": b"x"},
    {"mtu": 9}, {"addr": 0}, {"addr": 1 << 64}, {"addr": (1 << 64) - 4096},
    {"rkey": 1 << 32}, {"rkey": -1}, {"len": 4096}, {"regions": [[0, 4096]] * 4},
    {"regions": None}, {"event": 1}, {"lid": 1 << 16},
    {"granted": -1}, {"granted": 17}, {"granted": True}, {"granted": "1"}, {"granted": None},
    {"granted": -1}, {"granted": 17}, {"granted": True}, {"granted": "1"}, {"granted": None},
    {"rid": -1}, {"rid": 1 << 64}, {"rid": True}, {"rid": b"x"}, {"rid": None},
])
def test_bad_descriptor_is_protocol_error(changes):
    theirs = layout.endpoint_layout(16, 4096, 8)
    assert verbs.check_descriptor(_descriptor(theirs), theirs, STRIDE)["rid"] == 0
    assert verbs.check_descriptor(_descriptor(theirs, rid=2**64 - 1), theirs,
                                  STRIDE)["rid"] == 2**64 - 1
    with pytest.raises(rdmamw.ProtocolError):
        verbs.check_descriptor(_descriptor(theirs, **changes), theirs, STRIDE)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "qpn", "psn", "gid", "lid", "mtu", "addr", "rkey",
                                        "len", "regions", "event", "granted", "rid"]),
                       st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=17),
                                 st.booleans(), st.none(), st.text(max_size=4),
                                 st.lists(st.lists(st.integers(0, 1 << 20), max_size=2),
                                          max_size=4))))
def test_fuzz_descriptor(changes):
    """Any descriptor is either exactly right or a ProtocolError, never another error."""
    theirs = layout.endpoint_layout(16, 4096, 8)
    d = _descriptor(theirs, **changes)
    try:
        verbs.check_descriptor(d, theirs, STRIDE)
    except rdmamw.ProtocolError:
        return
    assert d["v"] == 1 and d["len"] == theirs.total
    assert type(d["granted"]) is int and 0 <= d["granted"] <= 16
    assert type(d["rid"]) is int and 0 <= d["rid"] < 1 << 64       # absent: 0
    assert d["regions"] == [list(r) for r in theirs.regions()]
    assert 0 < d["qpn"] < 1 << 24 and len(d["gid"]) == 16 and type(d["event"]) is bool
    assert 0 < d["addr"] and d["addr"] + d["len"] <= 1 << 64 and 0 <= d["rkey"] < 1 << 32


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 1 << 20), st.integers(1, 1 << 20), st.integers(0, 2**64 - 1))
@example(1, 128, 1)             # a flag of 1 (a peer before the rule): as many again
@example(1, 128, 40)            # a send of 40 slots from one granted: 40 in one grant
@example(1, 128, 2**64 - 1)     # anything: bounded by the ring
@example(64, 128, 3)            # no more than granted: as many again
def test_fuzz_grant_asked_for(have, slots, ask):
    """The credit flag is the peer's to write (any 64-bit value): one grant gives what
    it asks for when that is more than granted, bounded by the ring; else as many
    again; always more than granted (the grant word's check) while the ring is not
    whole, never more than the ring."""
    if have >= slots:
        return
    new = grant_after(have, slots, ask)
    assert have < new <= slots
    assert new == (min(slots, ask) if ask > have else min(slots, 2 * have))


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=2000), st.binary(max_size=64), st.integers(),
                 st.none(), st.booleans(), st.lists(st.text(max_size=8), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=3)),
       st.booleans())
@example("x" * (1 << 20), False)
@example("budget\n\x1b[2Jfull", True)
def test_a_hostile_refusal_frame_is_a_bounded_peer_refused(why, with_descriptor):
    """Whatever a peer puts in ``refused`` (a megabyte-long story, bytes, a dict, control
    characters), even beside a whole descriptor, the result is PeerRefused with a short
    printable reason; never the descriptor, never another error."""
    frame = {"refused": why}
    if with_descriptor:
        frame.update(_descriptor(layout.endpoint_layout(16, 4096, 8)))
    with pytest.raises(rdmamw.PeerRefused) as e:
        verbs._unless_refused(frame, "peer 7")
    msg = str(e.value)
    assert msg.startswith("peer 7 refused the channel: ")
    reason = msg[len("peer 7 refused the channel: "):]
    assert 0 < len(reason) <= verbs.REFUSAL_CHARS and reason.isprintable()
    if isinstance(why, str) and why.isprintable() and why:
        assert reason == why[:verbs.REFUSAL_CHARS]
    elif not isinstance(why, str) or not why:
        assert reason == "no reason given"


def test_a_frame_without_refused_is_passed_on_whole():
    d = _descriptor(layout.endpoint_layout(16, 4096, 8))
    assert verbs._unless_refused(dict(d), "peer") == d


# ---- on a device (the soft-RoCE VM) ----------------------------------------------

def _pair(where_opts: str = "", **kw):
    """(opener, acceptor, listener, opener transport, acceptor transport)."""
    lst = verbs.listen(f"127.0.0.1:0{where_opts}", slots=kw.get("slots", 16),
                       slot_size=kw.get("slot_size", 4096))
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("c", lst.accept(timeout=20)))
    t.start()
    where = f"127.0.0.1:{lst.port}{where_opts}"
    ca = verbs.connect(where, mode=kw.get("mode", "batched"), timeout=20,
                       slots=kw.get("slots", 16), slot_size=kw.get("slot_size", 4096))
    t.join(20)
    a, b = _make(Channel, ca, 20.0), _make(Channel, got["c"], 20.0)
    return a, b, lst, ca.transport, got["c"].transport


@device
@pytest.mark.device
def test_one_doorbell_and_one_signal_per_batch():
    a, b, lst, _, _ = _pair(slots=64)
    try:
        st0 = a.stats()         # set-up posted one control word (max_message_size)
        for _ in range(10):
            a.send_batch([b"12345678"] * 256).wait(timeout=10)
            assert len(recv_all(b, 256)) == 256
        st = a.stats()
        assert st["batches"] == 10 and st["messages"] == 2560
        assert (st["doorbells"] - st0["doorbells"]) - (st["wakeups_sent"]
                                                       - st0["wakeups_sent"]) == 10
        assert st["signaled_completions"] / st["messages"] <= 1 / 64
    finally:
        a.close(), b.close(), lst.close()


@device
@pytest.mark.device
def test_a_long_read_goes_as_pieces_of_read_chunk():
    """RDMAMW_VERBS_READ_CHUNK / ``read_chunk``: the receiver posts an 8 MiB rendezvous
    READ as 8 MiB / chunk work requests, the last one signaled, and the message lands
    whole; 0 posts it as one. Soft-RoCE defaults to 512 KiB (its retry of one long
    READ that lost a packet can stall the QP: docs/design.md "Long READs on
    soft-RoCE"). 128 pieces through a send queue of 16 go in parts, freed as they go
    (every 16th piece is signaled)."""
    msg = os.urandom(8 << 20)
    posted = {}
    cases = {"?read_chunk=0": 0, "?read_chunk=256K": 256 << 10, "": 512 << 10,
             "?read_chunk=64K&sq_depth=16": 64 << 10}
    for opts, chunk in cases.items():
        a, b, lst, _, tb = _pair(opts, slots=16)
        try:
            assert tb.read_chunk == chunk
            st0 = b.stats()
            h = a.send(msg)
            assert bytes(b.recv(timeout=60)) == msg
            h.wait(timeout=60)
            st = b.stats()
            assert st["rndv_reads"] - st0["rndv_reads"] == 1
            posted[opts] = (st["work_requests"] - st0["work_requests"]
                            - (st["wakeups_sent"] - st0["wakeups_sent"]))
        finally:
            a.close(), b.close(), lst.close()
    base = posted["?read_chunk=0"]
    assert [posted[o] - base for o in cases] == [0, 31, 15, 127], posted


@device
@pytest.mark.device
def test_chain_longer_than_the_send_queue_is_split():
    a, b, lst, ta, _ = _pair("?sq_depth=16", slots=64, slot_size=256)
    try:
        assert ta.sq_depth == 16 and ta.max_chain == 8
        msgs = [bytes([i]) * 200 for i in range(60)]     # 60 SINGLE slots: 61 WRs
        st0 = a.stats()
        a.send_batch(msgs).wait(timeout=10)
        assert recv_all(b, 60) == msgs
        st = a.stats()
        assert st["doorbells"] - st0["doorbells"] >= 8
        assert st["work_requests"] - st0["work_requests"] == 61
    finally:
        a.close(), b.close(), lst.close()


@device
@pytest.mark.device
@pytest.mark.parametrize("event", [1, 0])
def test_a_sleeping_receiver_is_woken(event):
    """By the immediate of the peer's WRITE_WITH_IMM (event mode, the default), or by
    the wake-up SEND the peer sends on seeing our sleep flag (event=0)."""
    a, b, lst, _, tb = _pair(f"?event={event}")
    try:
        assert tb.event_mode == bool(event)
        got = []
        t = threading.Thread(target=lambda: got.extend(recv_all(b, 3, timeout=20)))
        t.start()
        time.sleep(0.5)                    # b is asleep on its completion channel by now
        a.send_batch([b"x", b"y", b"z"])
        t.join(20)
        assert got == [b"x", b"y", b"z"]
        assert b.stats()["sleeps"] >= 1 and b.stats()["recv_completions"] >= 1
    finally:
        a.close(), b.close(), lst.close()


@device
@pytest.mark.device
@pytest.mark.parametrize("mode,event", [("batched", 1), ("ack", 1), ("batched", 0)])
def test_many_laps_in_order_with_sleepers(mode, event):
    """Receiver and sender both sleep at times (on completion channels in event mode,
    the default; with timed re-checks without it); nothing is lost."""
    a, b, lst, _, _ = _pair(f"?event={event}", slots=8, slot_size=512, mode=mode)
    total = 1500 if mode == "batched" else 400
    got = []
    t = threading.Thread(target=lambda: got.extend(recv_all(b, total, timeout=20)))
    t.start()
    try:
        i = 0
        while i < total:
            k = min(total - i, 1 + i % 13)
            a.send_batch([j.to_bytes(4, "little") for j in range(i, i + k)], timeout=20)
            i += k
        t.join(60)
        assert [int.from_bytes(g, "little") for g in got] == list(range(total))
    finally:
        a.close(), b.close(), lst.close()


@device
@pytest.mark.device
def test_an_immediate_a_drain_took_still_ends_the_next_wait():
    """A drain between a sleeper's last look and its sleep (peer_state()'s, a post's)
    takes the count of the immediate whose message that look missed; the wait that
    follows must end at once, not at its timeout (a perf server thread slept through a
    ping-pong's message until the client gave up: 120 s in a CI run)."""
    a, b, lst, _, tb = _pair()
    try:
        deadline = time.monotonic() + 10
        while hooks.verbs_drain_then_wait(tb, 10)[1] != 0:     # nothing left to see
            assert time.monotonic() < deadline
        a.send(b"ping").wait(timeout=10)
        while not b.diagnostics()["pending"]:                   # it landed, unseen
            assert time.monotonic() < deadline
            time.sleep(0.01)
        taken, woke, seconds = hooks.verbs_drain_then_wait(tb, 3000)
        assert (taken >= 1, woke) == (True, 1) and seconds < within(1.0), (taken, woke, seconds)
        assert bytes(b.recv(timeout=0)) == b"ping"
    finally:
        a.close(), b.close(), lst.close()


@device
@pytest.mark.device
def test_qp_in_error_is_peer_lost_within_2s():
    a, b, lst, ta, _ = _pair()
    try:
        a.send(b"before").wait(timeout=5)
        assert recv_all(b, 1) == [b"before"]
        hooks.qp_error(ta)
        t0 = time.monotonic()
        send_until_peer_lost(b, t0, batch=4, timeout=5)
        t0 = time.monotonic()
        # the message names the failed completion's status
        with pytest.raises(rdmamw.PeerLost, match=r"completion .+ \(status \d+, vendor_err"):
            a.recv(timeout=10)
        assert time.monotonic() - t0 < within(2.0)
    finally:
        a.close(), b.close(), lst.close()


@device
@pytest.mark.device
def test_stray_bytes_on_the_side_channel_do_not_make_waits_spin():
    """Nothing is sent on the side channel after the handshake; bytes a peer sends
    anyway must not leave it readable, or every later wait returns at once and spins
    a core (issue 29, finding 8)."""
    a, b, lst, ta, _ = _pair()
    try:
        os.write(hooks.verbs_side_socket(ta), b"x" * 1000)
        c0, t0 = time.thread_time(), time.monotonic()
        with pytest.raises(rdmamw.Timeout):
            b.recv(timeout=3)
        assert time.monotonic() - t0 >= 2.9
        assert time.thread_time() - c0 < 1.0       # spinning takes the whole 3 s
        a.send(b"still fine").wait(timeout=10)
        assert recv_all(b, 1) == [b"still fine"]
    finally:
        a.close(), b.close(), lst.close()


@device
@pytest.mark.device
def test_expose_from_two_threads_never_shares_a_slot():
    """The engine's send thread exposes sources while its receive thread exposes READ
    targets: one exposure table, two threads. An exposure handed to both (the cause of
    the bidirectional rendezvous test's PeerLost: one side's unexpose deregistered the
    other's MR, the peer's READ of it failed with a remote access error) shows up as a
    slot holding another MR."""
    a, b, lst, ta, _ = _pair()
    bufs = [bytearray(1 << 16) for _ in range(2)]
    clashes = [0, 0]

    def churn(i):
        addr = ctypes.addressof(ctypes.c_char.from_buffer(bufs[i]))
        clashes[i] = hooks.expose_churn(ta, addr, len(bufs[i]), 4000)

    try:
        ts = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert clashes == [0, 0]
        a.send(b"still up").wait(timeout=5)
        assert recv_all(b, 1) == [b"still up"]
    finally:
        a.close(), b.close(), lst.close()


@device
@pytest.mark.device
def test_bad_descriptor_over_the_wire_is_dropped(caplog):
    """A peer with the token whose descriptor is bad is dropped and logged; its QP
    never leaves INIT, and the listener goes on accepting."""
    caplog.set_level(logging.WARNING, logger="rdmamw.verbs")
    lst = verbs.listen("127.0.0.1:0", slots=8, slot_size=256)
    try:
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.05)                         # start serving
        s = socket.create_connection(("127.0.0.1", lst.port), timeout=20)
        auth.open_side(s)
        _wire.send_frame(s, {"v": 1, "slots": 8, "slot_size": 256, "mode": "batched",
                             "pid": 1})
        _wire.recv_frame(s)
        theirs = layout.endpoint_layout(8, 256, 8)
        _wire.recv_frame(s)                                  # the listener's descriptor
        _wire.send_frame(s, _descriptor(theirs, v=7))
        assert s.recv(100) == b""                            # dropped
        s.close()
        with pytest.raises(rdmamw.Timeout):
            lst.accept(timeout=0.5)
    finally:
        lst.close()
    assert any("descriptor version 7" in r.getMessage() for r in caplog.records)


SINK = """
import sys, time, rdmamw
lst = rdmamw.listen("verbs://127.0.0.1:0", slots=8, slot_size=1024)
print(lst.address, flush=True)
ch = lst.accept(timeout=20)
ch.recv_batch(timeout=20)
print("got", flush=True)
time.sleep(60)
"""


def _spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)


@device
@pytest.mark.device
def test_receiver_killed_sender_gets_peer_lost():
    p = _spawn(SINK)
    address = p.stdout.readline().strip()
    ch = rdmamw.Channel.open(address, timeout=30, slots=8, slot_size=1024)
    ch.send_batch([b"first"])
    assert p.stdout.readline().strip() == "got"
    p.send_signal(signal.SIGKILL)
    p.wait()
    t_kill = time.monotonic()
    send_until_peer_lost(ch, t_kill, rounds=100_000, timeout=10)
    ch.close()


@device
@pytest.mark.device
def test_pyverbs_peer_writes_into_an_rdmamw_ring():
    """A sender built on pyverbs alone (tests/support/peers/pyverbs_sender.py) follows
    docs/protocol.md; the rdmamw receiver delivers its messages and writes its
    reclaim bits back into the peer's block."""
    pytest.importorskip("pyverbs.device", reason="python3-pyverbs is not linked into the venv")
    with rdmamw.listen("verbs://127.0.0.1:0", slots=16, slot_size=256) as lst:
        port = lst.address.rsplit(":", 1)[1]
        p = subprocess.Popen([sys.executable,
                              os.path.join(ROOT, "tests/support/peers/pyverbs_sender.py"),
                              "127.0.0.1", port, "5"], stdout=subprocess.PIPE, text=True)
        ch = lst.accept(timeout=30)
        got = recv_all(ch, 8, timeout=20)
        assert got == [b"pyverbs-%d" % k for k in range(5)] + [b"packed-a", b"packed-bb", b""]
        with pytest.raises(rdmamw.ChannelClosed):
            ch.recv(timeout=20)
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0 and out.split("\n")[:3] == ["sent 8", "reclaimed", "closed"]
        ch.close()




STOPPED_SINK = """
import sys, time, rdmamw
lst = rdmamw.listen("verbs://127.0.0.1:0?ring_start=65536", slots=64, slot_size=65536)
print(lst.address, flush=True)
ch = lst.accept(timeout=20)
got = []
while not got or got[-1] != b"last":
    got += [bytes(m) for m in ch.recv_batch(timeout=60)]
print(repr(got), flush=True)
"""


@device
@pytest.mark.device
@pytest.mark.timeout(120)
def test_a_stopped_receiver_never_holds_a_send_past_its_deadline():
    """The peer is stopped (SIGSTOP) asleep, and our sender runs short of the ring
    slots it granted, so it asks for more every 20 ms with a wake-up SEND. Each takes
    one of the stopped peer's receive WRs; with none left the QP waits for it (RNR) and
    the send queue fills with asks. A full send queue made the next post wait 10 s,
    past the send's deadline, then give the live peer up as lost. Each send must keep
    its 0.2 s deadline for the whole 12 s, and once the peer goes on, every message
    that was accepted arrives, in order."""
    p = _spawn(STOPPED_SINK)
    try:
        address = p.stdout.readline().strip()
        ch = rdmamw.Channel.open(address, timeout=30, slots=64, slot_size=65536)
        ch.send_batch([b"first"]).wait(timeout=10)
        time.sleep(0.5)                                 # the peer sleeps in its recv
        p.send_signal(signal.SIGSTOP)
        sent, longest, timeouts = [b"first"], 0.0, 0
        end = time.monotonic() + 12
        while time.monotonic() < end:
            msg, t0 = b"m%d" % len(sent), time.monotonic()
            try:
                ch.send_batch([msg], timeout=0.2)
                sent.append(msg)
            except rdmamw.Timeout as e:
                timeouts += 1
                if e.sent:
                    sent.append(msg)
            longest = max(longest, time.monotonic() - t0)
        assert longest < within(1.5), longest
        assert timeouts > 20, (timeouts, len(sent))     # short of slots most of the time
        st = ch.stats()
        # the asks it did not add to the queue; the flag writes it queued past a deadline
        assert st["wakeups_held"] > 0 and st["wrs_queued_late"] > 0, st
        p.send_signal(signal.SIGCONT)
        ch.send_batch([b"last"], timeout=20).wait(timeout=20)
        assert p.stdout.readline().strip() == repr(sent + [b"last"])
        ch.close()
    finally:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait()
