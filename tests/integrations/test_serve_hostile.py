"""Every server loop survives any one request (issue 29, findings 3, 4, 8 and 9): the
parameter server, the collectives' header round, ``rdmamw perf --server`` and the shm
side channel. A bad request gets a typed error back (or its connection dropped) and
the loop goes on serving the others. Each decoder is also fuzzed with hypothesis,
structured: valid msgpack of the wrong types, missing and extra fields, huge and
negative numbers, unhashable keys."""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdmamw
from rdmamw.errors import ProtocolError, RdmamwError
from rdmamw.ps import wire
from rdmamw.ps.server import KVServer
from tests.support.helpers import make_pair

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 150)), deadline=None,
                derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- the parameter server (finding 3) ------------------------------------------------


class _Sent:
    def wait(self, timeout: float | None = None) -> None:
        return None


class FakeChannel:
    """The Channel surface KVServer uses: queued frames in, sent frames recorded."""

    eager_limit = 1 << 16

    def __init__(self) -> None:
        self.inbox: list[list[bytes]] = []
        self.sent: list[dict] = []
        self.closed = False

    def recv_batch(self, timeout: float | None = None) -> list:
        if self.closed:
            raise rdmamw.ChannelClosed("closed")
        if not self.inbox:
            raise rdmamw.Timeout("nothing")
        return [memoryview(bytes(m)) for m in self.inbox.pop(0)]

    def send_batch(self, msgs: list, timeout: float | None = None) -> _Sent:
        if self.closed:
            raise rdmamw.ChannelClosed("closed")
        hdr = None
        for m in msgs:
            if hdr is not None:
                hdr["payload"] = bytes(m)
                hdr = None
                continue
            h = wire.unpack(m)
            self.sent.append(h)
            if h["op"] == wire.VAL:
                hdr = h
        return _Sent()

    def close(self) -> None:
        self.closed = True

    def ops(self) -> list[str]:
        return [h["op"] for h in self.sent]


def _served() -> tuple[KVServer, FakeChannel, FakeChannel]:
    """A server of two workers: 0 (the one that misbehaves) and 1, which has declared
    key "w" (10 float32 of 1.0)."""
    bad, good = FakeChannel(), FakeChannel()
    srv = KVServer({0: bad, 1: good}, consistency="asp")
    good.inbox.append([wire.pack(wire.INIT, k="w", o=0, shape=[10], dt="<f4", last=True),
                       np.ones(10, np.float32).tobytes(), wire.pack(wire.SYNC, id=7)])
    _spin(srv)
    assert good.ops() == [wire.OK]
    good.sent.clear()
    _good_pull_still_works(srv, good)      # read: the initial values are settled
    return srv, bad, good


def _spin(srv: KVServer, n: int = 4) -> None:
    for _ in range(n):
        srv.serve_once()


def _good_pull_still_works(srv: KVServer, good: FakeChannel, ones: bool = True) -> None:
    """Worker 1 pulls "w": answered whole (and still 1.0 everywhere if ``ones``: a
    fuzzed request may be a valid gradient, which changes the values)."""
    good.inbox.append([wire.pack(wire.PULL, keys=["w"], id=8)])
    _spin(srv)
    assert [h["op"] for h in good.sent] == [wire.VAL, wire.END], good.sent
    assert len(good.sent[0]["payload"]) == 40
    if ones:
        assert np.frombuffer(good.sent[0]["payload"], np.float32).tolist() == [1.0] * 10
    good.sent.clear()


def _p(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


F4 = np.ones(10, np.float32).tobytes()
#: the probes of finding 3 (20 of 20 killed serve()), and more of the same kinds
BAD_REQUESTS = {
    "no op": [_p({"id": 1})],
    "not msgpack": [b"\xc1\xc1\xc1"],
    "truncated msgpack": [_p({"op": "sync", "id": 1})[:-1]],
    "not a map": [_p([1, 2, 3])],
    "a bare int": [_p(5)],
    "op not a string": [_p({"op": 3})],
    "op unhashable": [_p({"op": [1]})],
    "sync without id": [_p({"op": "sync"})],
    "pull without keys": [_p({"op": "pull", "id": 1})],
    "pull keys not a list": [_p({"op": "pull", "id": 1, "keys": 5})],
    "pull of an unhashable key": [_p({"op": "pull", "id": 1, "keys": [[1, 2]]})],
    "pull of a map key": [_p({"op": "pull", "id": 1, "keys": [{"a": 1}]})],
    "init key unhashable": [_p({"op": "init", "k": [1], "shape": [10], "dt": "<f4"}), F4],
    "init negative shape": [_p({"op": "init", "k": "x", "shape": [-10], "dt": "<f4"}), F4],
    "init shape not a list": [_p({"op": "init", "k": "x", "shape": 10, "dt": "<f4"}), F4],
    "init huge shape": [_p({"op": "init", "k": "x", "shape": [1 << 62, 1 << 62],
                           "dt": "<f4"}), F4],
    "init bad dtype": [_p({"op": "init", "k": "x", "shape": [10], "dt": "nonsense"}), F4],
    "init object dtype": [_p({"op": "init", "k": "x", "shape": [10], "dt": "O"}), F4],
    "init dtype not a string": [_p({"op": "init", "k": "x", "shape": [10], "dt": 4}), F4],
    "init string offset": [_p({"op": "init", "k": "w", "o": "5", "shape": [10],
                               "dt": "<f4"}), F4],
    "init offset past the end": [_p({"op": "init", "k": "w", "o": 1 << 40, "shape": [10],
                                     "dt": "<f4"}), F4],
    "init negative offset": [_p({"op": "init", "k": "w", "o": -5, "shape": [10],
                                 "dt": "<f4"}), F4],
    "init payload not whole elements": [_p({"op": "init", "k": "x", "shape": [10],
                                            "dt": "<f4"}), b"\0" * 7],
    "grad string offset": [_p({"op": "grad", "k": "w", "o": "1", "dt": "<f4"}), F4],
    "grad negative offset": [_p({"op": "grad", "k": "w", "o": -3, "dt": "<f4"}), F4],
    "grad key unhashable": [_p({"op": "grad", "k": {"a": 1}, "dt": "<f4"}), F4],
    "grad bad dtype": [_p({"op": "grad", "k": "w", "dt": "zz"}), F4],
    "grad without dt": [_p({"op": "grad", "k": "w"}), F4],
    "grad payload not whole elements": [_p({"op": "grad", "k": "w", "dt": "<f4"}), b"\0" * 3],
    "clock string time": [_p({"op": "clock", "c": 1, "base": 0, "t": "fast"})],
    "clock nan time": [_p({"op": "clock", "c": 1, "base": 0, "t": float("nan")})],
    "clock infinite time": [_p({"op": "clock", "c": 1, "base": 0, "t": float("inf")})],
    "clock string base": [_p({"op": "clock", "c": 1, "base": "0"})],
    "clock negative samples": [_p({"op": "clock", "c": 1, "base": 0, "n": -4})],
    "clock map samples": [_p({"op": "clock", "c": 1, "base": 0, "n": {}})],
}


@pytest.mark.parametrize("frames", BAD_REQUESTS.values(), ids=BAD_REQUESTS)
def test_one_malformed_request_gets_an_error_and_the_server_serves_on(frames, caplog):
    """Finding 3: each of these killed serve() (the server thread died and every other
    worker's pull failed). Now the sender gets an ERR back (PSError on its side) or is
    dropped, and worker 1's pull is answered afterwards."""
    srv, bad, good = _served()
    bad.inbox.append(frames)
    with caplog.at_level(logging.WARNING, "rdmamw.ps"):
        _spin(srv)
    assert wire.ERR in bad.ops() or 0 in srv.lost, (bad.sent, srv.lost)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    _good_pull_still_works(srv, good)
    assert not srv.finished


def test_a_bad_request_is_answered_with_a_message_naming_it():
    srv, bad, good = _served()
    bad.inbox.append([_p({"op": "pull", "id": 1, "keys": [[1, 2]]})])
    _spin(srv)
    err = [h for h in bad.sent if h["op"] == wire.ERR]
    assert err and "bad request" in err[0]["msg"] and "keys" in err[0]["msg"], bad.sent


def test_a_bad_payload_header_does_not_turn_its_payload_into_a_header():
    """An INIT or GRAD header that is refused is still followed by its payload: that
    payload is skipped, not read as the next request (one ERR, not two)."""
    srv, bad, good = _served()
    bad.inbox.append([_p({"op": "grad", "k": [1], "dt": "<f4"}), b"\x91\x01",
                      wire.pack(wire.SYNC, id=3)])
    _spin(srv)
    assert bad.ops() == [wire.ERR, wire.OK], bad.sent


def test_a_request_the_server_fails_on_drops_only_that_worker(monkeypatch, caplog):
    """Past the checks, anything one request raises (a bug: planted here) drops that
    worker, logged with its traceback, instead of ending serve(): the other worker is
    served and the server finishes when it says goodbye."""
    srv, bad, good = _served()

    def broken(w, h):
        raise RuntimeError("planted")

    monkeypatch.setattr(srv, "_gradient_done", broken)
    bad.inbox.append([wire.pack(wire.CLOCK, c=1, base=0)])
    with caplog.at_level(logging.ERROR, "rdmamw.ps"):
        _spin(srv)
    assert srv.lost == {0} and bad.closed
    assert "worker 0: request failed (RuntimeError: planted)" in caplog.text
    _good_pull_still_works(srv, good)
    good.inbox.append([wire.pack(wire.BYE, id=9)])
    _spin(srv)
    assert srv.finished and good.ops() == [wire.OK]


def test_another_workers_pull_succeeds_after_a_bad_request_over_channels():
    """End to end on shm channels: the server runs serve() on its thread; worker 0
    sends one malformed request, worker 1 (a KVWorker) still pulls, and serve()
    returns normally once both are done."""
    from rdmamw.ps import KVWorker

    pairs = [make_pair(slots=16, slot_size=1 << 16) for _ in range(2)]
    srv = KVServer({w: p[1] for w, p in enumerate(pairs)}, consistency="asp")
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(stats=srv.serve()), daemon=True)
    t.start()
    try:
        good = KVWorker([pairs[1][0]], timeout=10)
        good.init(["w"], [np.arange(10, dtype=np.float32)])
        pairs[0][0].send(_p({"op": "pull", "id": 1, "keys": [{"a": 1}]}))
        reply = wire.unpack(pairs[0][0].recv(timeout=10))
        assert reply["op"] == wire.ERR, reply
        assert t.is_alive()
        got = good.pull(["w"])
        np.testing.assert_array_equal(got[0], np.arange(10, dtype=np.float32))
        pairs[0][0].close()
        good.close()
        t.join(10)
        assert not t.is_alive() and out["stats"]["keys"] == 1
    finally:
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                    st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8))
_value = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=8)
_ops = st.sampled_from([*wire.WITH_PAYLOAD, wire.SYNC, wire.CLOCK, wire.PULL, wire.BYE,
                        wire.OK, wire.END, wire.ERR, "nope"])
_fields = {"id": _value, "k": st.one_of(st.sampled_from(["w", "x"]), _value),
           "o": st.one_of(st.integers(-20, 20), _value),
           "shape": st.one_of(st.lists(st.integers(-3, 12), max_size=3), _value),
           "dt": st.one_of(st.sampled_from(["<f4", "<f8", "|u1", "O", "V4", "<M8[s]"]), _value),
           "keys": st.one_of(st.lists(st.sampled_from(["w", "x"]), max_size=3), _value),
           "last": _value, "start": _value, "t": _value, "n": _value, "base": _value,
           "c": _value}


@st.composite
def _requests(draw: st.DrawFn) -> list[bytes]:
    """One or a few frames of a worker: a structured header (a known op, some of the
    fields it takes with values right or wrong, extra ones) then perhaps a payload."""
    frames = []
    for _ in range(draw(st.integers(1, 3))):
        h = {name: draw(s) for name, s in _fields.items() if draw(st.booleans())}
        if draw(st.booleans()):
            h["op"] = draw(_ops)
        h.update(draw(st.dictionaries(st.text(max_size=3), _value, max_size=2)))
        frames.append(_p(h) if draw(st.integers(0, 9)) else _p(draw(_value)))
        if draw(st.booleans()):
            frames.append(draw(st.binary(max_size=48)))
    return frames


@FUZZ
@given(frames=_requests())
def test_fuzz_the_ps_request_decoder(frames):
    """Whatever one worker sends, the server answers (or ignores what is harmless,
    such as extra fields) and never needs to drop it: every request is checked before
    use, so the catch-all that drops a worker is never reached; the other worker's
    pull is answered after."""
    srv, bad, good = _served()
    bad.inbox.append(frames)
    _spin(srv)
    assert 0 not in srv.lost
    _good_pull_still_works(srv, good, ones=False)
    assert srv.model["w"].shape == (10,) and srv.model["w"].dtype == np.float32


# ---- the collectives' header round (finding 9) ----------------------------------------


class _PeerRank:
    """Rank 1 of a two-rank communicator, as rank 0's channel to it sees it: it
    answers the header round with ``reply``."""

    eager_limit = 1 << 16

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.closed = False

    def send_batch(self, msgs: list, timeout: float | None = None) -> _Sent:
        return _Sent()

    def recv_batch(self, n: int = 1, timeout: float | None = None) -> list:
        return [memoryview(self.reply)]

    def close(self) -> None:
        self.closed = True


def _comm_with(reply: bytes):
    from rdmamw.bootstrap import World
    from rdmamw.collectives.comm import Communicator

    w = World(0, 2, "test", "pair", {0: {"host": "h", "hostname": "h"},
                                        1: {"host": "h", "hostname": "h"}})
    comm = Communicator(w)
    comm._chans[1] = _PeerRank(reply)
    comm._queues[1] = __import__("collections").deque()
    comm._header_open = True
    return comm


HEADER = ["barrier", "-", [], "", -1, ""]


def _header_reply(lo: object, hi: object | None = None, cap: object = 1 << 20) -> bytes:
    from rdmamw.collectives.comm import MAGIC

    return msgpack.packb([MAGIC, lo, lo if hi is None else hi, cap])


BAD_HEADERS = {
    "header of wrong types": _header_reply([[1, 5, None, {}, 2.5, "x", 3], 1]),
    "rank not an int": _header_reply([[1, *HEADER], "one"]),
    "header not a list": _header_reply(["barrier", 1]),
    "short header": _header_reply([[1, "barrier"], 1]),
    "entry not a pair": _header_reply(7),
    "cap a string": _header_reply([[1, *HEADER], 1], cap="big"),
    "cap zero": _header_reply([[1, *HEADER], 1], cap=0),
    "shape of maps": _header_reply([[1, "barrier", "-", [{}], "", -1, ""], 1]),
    "rank out of range": _header_reply([[1, *HEADER], 5]),
}


@pytest.mark.parametrize("reply", BAD_HEADERS.values(), ids=BAD_HEADERS)
def test_a_header_of_the_wrong_types_is_a_protocol_error(reply):
    """Finding 9: the min/max comparison ran outside the malformed-header handling, so
    fields of the wrong types gave a raw TypeError (or an IndexError in the message)."""
    comm = _comm_with(reply)
    with pytest.raises(ProtocolError, match="rank 1 sent a malformed header"):
        comm.run(HEADER, [], lambda: None)


def test_an_uneven_alltoall_against_an_even_one_is_a_mismatch():
    """The same comparison between two honest ranks: ``["*", 4]`` (uneven alltoall)
    against ``[8, 4]`` compared a str with an int (TypeError); it is a mismatch."""
    from rdmamw.collectives.comm import CollectiveMismatch

    mine = ["alltoall", "float32", [8, 4], "", -1, ""]
    theirs = [1, "alltoall", "float32", ["*", 4], "", -1, "uneven"]
    comm = _comm_with(_header_reply([theirs, 1]))
    with pytest.raises(CollectiveMismatch, match="alltoall"):
        comm.run(mine, [], lambda: None)


def test_a_matching_header_still_agrees():
    comm = _comm_with(_header_reply([[1, *HEADER], 1]))
    assert comm.run(HEADER, [], lambda: 42) == 42


@FUZZ
@given(reply=st.one_of(
    st.builds(lambda lo, hi, cap: _header_reply(lo, hi, cap),
              st.one_of(_value, st.tuples(st.lists(_value, min_size=7, max_size=7)
                                          .map(lambda h: [1, *h[1:]]), _value).map(list)),
              st.one_of(st.none(), _value), _value),
    st.binary(max_size=40)))
def test_fuzz_the_collectives_header(reply):
    comm = _comm_with(reply)
    try:
        comm.run(HEADER, [], lambda: None)
    except RdmamwError:
        pass                    # typed: a mismatch, a malformed header


# ---- rdmamw perf --server (finding 4) --------------------------------------------------


PERF_V = 2      # rdmamw.apps.perf.PARAMS_VERSION (checked below)


def _perf_server(tmp_name: str, timeout: float = 10.0):
    from rdmamw.apps import perf

    lines: list[str] = []

    class Out:
        def write(self, s: str) -> None:
            lines.append(s)

        def flush(self) -> None:
            pass

    done: dict = {}

    def run() -> None:
        try:
            done["runs"] = perf.serve(f"shm://{tmp_name}", timeout, out=Out())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            done["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    end = time.monotonic() + 10
    while not any("listening on" in s for s in lines) and time.monotonic() < end:
        time.sleep(0.01)
    return t, done, lines


def _good_run(name: str) -> None:
    from rdmamw.apps import perf

    rows = perf.measure(f"shm://{name}", "bw", [64], 16, 4, "batched", True, 10)
    assert rows[0].server_messages == 16


PERF_BAD = {
    "not msgpack": b"\xc1",
    "a list": _p([1]),
    "wrong version": _p({"v": 99}),
    "huge iters": _p({"v": PERF_V, "test": "bw", "sizes": [8], "iters": 1 << 62, "warmup": 0,
                      "batch": 1, "last": False}),
    "negative size": _p({"v": PERF_V, "test": "lat", "sizes": [-8], "iters": 1, "warmup": 0,
                         "batch": 1, "last": True}),
    "unhashable test": _p({"v": PERF_V, "test": [1], "sizes": [8], "iters": 1, "warmup": 0,
                           "batch": 1, "last": True}),
}


@pytest.mark.parametrize("raw", PERF_BAD.values(), ids=PERF_BAD)
def test_perf_server_survives_one_clients_bad_parameters(raw):
    """Finding 4: one client's bad parameters ended ``rdmamw perf --server``; now that
    client is told why (a refusal: ProtocolError on its side), its channel is dropped
    and the next client's run is served."""
    from rdmamw.apps import perf, perf_rmem

    assert perf.PARAMS_VERSION == PERF_V
    name = f"perf-bad-{os.getpid()}-{time.monotonic_ns()}"
    t, done, lines = _perf_server(name)
    with rdmamw.Channel.open(f"shm://{name}", timeout=10) as ch:
        ch.send(raw)
        with pytest.raises(ProtocolError, match="the other end refused: ProtocolError: perf"):
            perf_rmem.message(ch, 10)
        with pytest.raises((rdmamw.ChannelClosed, rdmamw.PeerLost)):
            ch.recv(timeout=10)
    assert t.is_alive(), done
    _good_run(name)
    t.join(10)
    assert done.get("runs") == 1, done
    assert any("perf parameters" in s or "perf sizes" in s for s in lines), lines


def test_perf_server_survives_a_client_that_leaves_mid_run():
    name = f"perf-gone-{os.getpid()}-{time.monotonic_ns()}"
    t, done, _ = _perf_server(name)
    with rdmamw.Channel.open(f"shm://{name}", timeout=10) as ch:
        ch.send(_p({"v": PERF_V, "test": "bw", "sizes": [8], "iters": 100, "warmup": 0,
                    "batch": 1, "last": True}))
        ch.send(b"x" * 8)
    time.sleep(0.2)
    assert t.is_alive(), done
    _good_run(name)
    t.join(10)
    assert done.get("runs") == 1, done


_EDGE = st.one_of(st.sampled_from([0, -1, 1 << 30, (1 << 30) + 1, 10 ** 9 + 1, 4097,
                                   (1 << 64) - 1, -(1 << 63), 1.5, True, "8", None]), _value)


@st.composite
def _perf_params(draw: st.DrawFn) -> object:
    """Valid parameters with some fields replaced by edge values (huge, negative,
    wrong type), deleted, or extra ones added; or any msgpack value."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_value)
    d = {"v": PERF_V, "test": draw(st.sampled_from(["lat", "bw", "rate"])),
         "sizes": draw(st.lists(st.integers(1, 1 << 30), min_size=1, max_size=64)),
         "iters": draw(st.integers(1, 10 ** 9)), "warmup": draw(st.integers(0, 10 ** 9)),
         "batch": draw(st.integers(1, 4096)), "last": draw(st.booleans())}
    for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
        k = draw(st.sampled_from(sorted(d)))
        if draw(st.integers(0, 3)):
            d[k] = draw(_EDGE)
        else:
            d.pop(k, None)
    if draw(st.integers(0, 5)) == 0:
        d["sizes"] = draw(st.lists(st.one_of(st.integers(1, 1 << 30), _EDGE), min_size=0,
                                   max_size=70))
    d.update(draw(st.dictionaries(st.text(max_size=3), _value, max_size=2)))
    return d


@FUZZ
@given(d=_perf_params())
def test_fuzz_perf_parameters(d):
    """check_params returns Params within the documented bounds or raises
    ProtocolError: never another exception for the server loop to die of."""
    from rdmamw.apps import perf

    try:
        p = perf.check_params(_p(d))
    except ProtocolError:
        return
    assert p.test in perf.TESTS and 1 <= p.batch <= perf.MAX_BATCH
    assert 1 <= p.iters <= perf.MAX_ITERS and 0 <= p.warmup <= perf.MAX_ITERS
    assert isinstance(p.last, bool)
    assert all(1 <= s <= perf.MAX_SIZE for s in p.sizes) and len(p.sizes) <= perf.MAX_SIZES


def test_perf_server_says_it_listens_on_every_interface_and_takes_bind():
    from rdmamw.apps import perf

    assert perf.resolve(None, "tcp", True, bind=None) == "tcp://0.0.0.0:18515"
    assert perf.resolve(None, "tcp", True, bind="127.0.0.1") == "tcp://127.0.0.1:18515"
    args = perf.parser().parse_args(["--server", "--bind", "127.0.0.1"])
    assert args.bind == "127.0.0.1"
    assert "every interface" in perf.exposure_note("tcp://0.0.0.0:18515")
    assert perf.exposure_note("tcp://127.0.0.1:18515") == ""


# ---- one stray byte on the shm side channel (finding 8) -------------------------------


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)      # every thread: tcp has a progress one
    return r.ru_utime + r.ru_stime


def _shm_pair_with_socket():
    """(opener channel, acceptor channel, the acceptor transport's side socket fd,
    listener) over shm."""
    from rdmamw.channel.channel import Channel, _make
    from rdmamw.providers.shm import provider as shm
    from tests.support.helpers import unique_name

    name = unique_name("stray")
    lst = shm.listen(name, slots=16, slot_size=4096)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(c=lst.accept(timeout=10)))
    t.start()
    conn = shm.connect(name, mode="batched", timeout=10, slots=16, slot_size=4096)
    t.join(10)
    fd = got["c"].transport.fileno()
    return _make(Channel, conn, 0.0), _make(Channel, got["c"], 0.0), fd, lst


def test_a_stray_byte_on_the_shm_side_channel_does_not_make_waits_spin():
    """Finding 8: wait() and peer_state() only peeked at the kept socket, so one byte
    the peer wrote there woke every later wait at once: a 1 s receive burned 1 s of
    CPU. Now the byte is a breach of the protocol: the channel is lost at once."""
    a, b, fd, lst = _shm_pair_with_socket()
    try:
        with socket.socket(fileno=os.dup(fd)) as s:     # the acceptor's end: to a
            s.send(b"!")
        t0 = time.monotonic()
        cpu0 = _cpu()
        with pytest.raises((rdmamw.PeerLost, rdmamw.Timeout)) as got:
            a.recv(timeout=1.0)
        wall, cpu = time.monotonic() - t0, _cpu() - cpu0
        assert cpu < 0.3, f"a {wall:.2f} s wait used {cpu:.2f} s of CPU"
        assert got.type is rdmamw.PeerLost and wall < 0.5, (got, wall)
    finally:
        a.close(), b.close(), lst.close()


def _tcp_socket_to(port: int) -> int:
    """The fd of this process's tcp socket connected to ``port`` (the opener's end of
    a pair: the transport keeps it to itself)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with s:
            try:
                if s.type == socket.SOCK_STREAM and s.getpeername()[1] == port:
                    return int(name)
            except (OSError, IndexError, TypeError):
                pass
    raise AssertionError(f"no socket to port {port}")


def test_a_stray_byte_on_a_tcp_connection_does_not_make_waits_spin():
    """The same on tcp, where the socket is the data stream: a byte written into it
    from outside the transport is garbage in the peer's framing. The waiting side
    fails (PeerLost) or times out, without burning the wait's time in CPU."""
    from tests.support.helpers import make_pair

    a, b, lst = make_pair(provider="tcp", spin_us=0)
    try:
        port = int(lst.address.rsplit(":", 1)[1])
        with socket.socket(fileno=os.dup(_tcp_socket_to(port))) as s:
            s.send(b"!")
        t0 = time.monotonic()
        cpu0 = _cpu()
        with pytest.raises((rdmamw.PeerLost, rdmamw.Timeout)):
            b.recv(timeout=1.0)
        wall, cpu = time.monotonic() - t0, _cpu() - cpu0
        assert cpu < 0.3, f"a {wall:.2f} s wait used {cpu:.2f} s of CPU"
    finally:
        a.close(), b.close(), lst.close()


# ---- the worker's side: a server's malformed reply ------------------------------------


BAD_REPLIES = {
    "not msgpack": [b"\xc1"],
    "not a map": [_p([1])],
    "no op": [_p({"id": 0})],
    "end without version": [_p({"op": "end", "id": 0})],
    "end of a string id": [_p({"op": "end", "id": "0", "version": 1})],
    "end with a bad plan": [_p({"op": "end", "id": 0, "version": 1, "plan": [1, "x"]})],
    "err without msg": [_p({"op": "err"})],
    "val of an unhashable key": [_p({"op": "val", "k": [1], "o": 0}), F4],
    "val past the end": [_p({"op": "val", "k": "w", "o": 8}), F4],
    "val of a negative offset": [_p({"op": "val", "k": "w", "o": -4}), F4],
    "val not whole elements": [_p({"op": "val", "k": "w", "o": 0}), b"\0" * 6],
}


@pytest.mark.parametrize("frames", BAD_REPLIES.values(), ids=BAD_REPLIES)
def test_a_malformed_server_reply_is_a_protocol_error_on_the_worker(frames):
    """A worker reading a server's reply that does not fit (wrong types, a block past
    its array) raises ProtocolError, not a raw KeyError / TypeError / ValueError."""
    from rdmamw.ps import KVWorker

    w = KVWorker([FakeChannel()])
    dest = {"w": np.zeros(10, np.float32)}
    hdr: dict = {0: None}
    with pytest.raises(ProtocolError):
        for f in frames:
            w._take(0, memoryview(f), hdr, dest, 0)
