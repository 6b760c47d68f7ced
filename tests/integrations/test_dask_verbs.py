"""The ``rdmamw://`` comm across hosts: the listener's offer of a verbs side channel
(rdmamw/dask/offer.py, docs/dask.md "Across hosts: the offer").

No device needed: the offer's codec (round trip; hypothesis feeds it junk and
near-offers: an Offer or ProtocolError, nothing else), a listener without verbs
offering none (comms on tcp), hostile listeners driven by hand (malformed offers fail
typed and fast, an unreachable verbs port or silence never hang the connector), and
the whole move-remember-go-direct path on the host with the "verbs" route pointed at
a tcp listener. With a device (the soft-RoCE VM): a comm really on verbs, frames of
8 B, 64 KiB and 8 MiB whole, and the second connect straight to verbs."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

distributed = pytest.importorskip("distributed", reason="dask distributed is not installed "
                                  "(pip install rdmamw[dask])")
import dask  # noqa: E402
from distributed.comm import CommClosedError, connect, listen  # noqa: E402
from distributed.comm.core import FatalCommClosedError  # noqa: E402
from distributed.protocol import to_serialize  # noqa: E402

import rdmamw.dask  # noqa: E402
from rdmamw import errors  # noqa: E402
from rdmamw.aio import Channel  # noqa: E402
from rdmamw.aio import listen as aio_listen  # noqa: E402
from rdmamw.dask import comm as dcomm  # noqa: E402
from rdmamw.dask import offer  # noqa: E402
from rdmamw.providers.verbs import rank as verbs_rank  # noqa: E402
from rdmamw.providers.verbs.offer import SideOffer  # noqa: E402
from rdmamw.providers.verbs.rank import Port  # noqa: E402
from tests.support.dask_echo import echo  # noqa: E402
from tests.support.helpers import NO_DEVICE, VERBS_OK  # noqa: E402

#: an RDMA port as a RoCE host's descriptor gives it (its GID in its fabric)
GID = bytes(10) + b"\xff\xff" + bytes([10, 77, 0, 2])
PORT = Port("rxe0", 1, 1, GID, "ethernet", "roce:10.77.0.0/24")


@pytest.fixture(autouse=True)
def backend():
    rdmamw.dask.register()
    dcomm._routes = offer.Routes()      # each test learns its own routes
    yield


def run(coro, timeout=60):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def verbs_offer(ident: bytes, port: int, rdma: Port = PORT) -> offer.Offer:
    """An offer of verbs: the side channel's port and its RDMA port."""
    return offer.Offer(ident, "verbs", SideOffer(port, rdma))


def no_rdma(monkeypatch):
    """This process has no usable RDMA port (whatever the machine has)."""
    monkeypatch.setattr(verbs_rank, "local_ports", lambda: ([], "none (the test)"))


def no_shm(**more):
    return dask.config.set({"distributed.comm.rdmamw.shm": False, **more})


# ---- the codec -----------------------------------------------------------------------
def test_an_offer_round_trips_with_and_without_verbs():
    ident = offer.new_id()
    for o in (offer.Offer(ident), verbs_offer(ident, 40123)):
        data = offer.encode(o)
        assert data.startswith(offer.MAGIC) and len(data) <= offer.MAX_OFFER
        assert offer.decode(data) == o


def _raw(**body) -> bytes:
    return offer.MAGIC + msgpack.packb(body)


@pytest.mark.parametrize("data, why", [
    (b"", "bad magic"),
    (b"RDK2" + bytes(20), "bad magic"),                     # a comm header: not an offer
    (offer.MAGIC, "malformed"),
    (offer.MAGIC + b"\xc1", "malformed"),
    (offer.MAGIC + msgpack.packb([1, 2]), "not a map"),
    (offer.MAGIC + bytes(offer.MAX_OFFER), "limit"),
    (_raw(id=b"x" * 15), "16 bytes"),
    (_raw(id="x" * 16), "16 bytes"),
    (_raw(id=bytes(16), extra=1), "keys"),
    (_raw(id=bytes(16), port=1), "keys"),
    (_raw(id=bytes(16), port=0, ports=[PORT.as_dict()]), "1 .. 65535"),
    (_raw(id=bytes(16), port=65536, ports=[PORT.as_dict()]), "1 .. 65535"),
    (_raw(id=bytes(16), port=True, ports=[PORT.as_dict()]), "1 .. 65535"),
    (_raw(id=bytes(16), port=1, ports=[]), "one RDMA port"),
    (_raw(id=bytes(16), port=1, ports=[PORT.as_dict()] * 2), "one RDMA port"),
    (_raw(id=bytes(16), port=1, ports=[{**PORT.as_dict(), "fabric": "roce:10.9.0.0/24"}]),
     "does not hold"),
    (_raw(id=bytes(16), port=1, ports=[{**PORT.as_dict(), "gid": bytes(16)}]), "range"),
    (_raw(id=bytes(16), port=1, ports=[{**PORT.as_dict(), "link": "x"}]), "link layer"),
])
def test_a_malformed_offer_is_a_protocol_error_saying_what(data, why):
    with pytest.raises(errors.ProtocolError, match=why):
        offer.decode(data)


def _check(data: bytes) -> None:
    """The decoder's contract: an Offer whose fields are in range, or ProtocolError."""
    try:
        got = offer.decode(data)
    except errors.ProtocolError:
        return
    assert len(got.id) == offer.ID_BYTES
    assert (got.scheme is None and got.part is None) or (
        got.scheme == "verbs" and 0 < got.part.port < 65536
        and isinstance(got.part.rdma, Port))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=64).map(lambda b: offer.MAGIC + b),
                 st.binary(max_size=2 * offer.MAX_OFFER)))
def test_fuzz_bytes_after_the_magic(data):
    _check(data)


_ANY = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
                    | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_FIELDS = {"dev": st.text(max_size=70), "port": st.integers(-1, 300),
           "gid_index": st.integers(-1, 70000), "gid": st.binary(min_size=14, max_size=17),
           "link": st.sampled_from(["ethernet", "infiniband", "x"]),
           "fabric": st.sampled_from(["roce:10.77.0.0/24", "roce:10.77.0.0/33", "roce:x",
                                      "ib:" + GID[:8].hex(), "net:", "net:a\x00",
                                      "net:" + "n" * 70, "net:lab"])}


@st.composite
def near_offers(draw) -> bytes:
    """A valid offer with one to three mutations: a field of the body or of its RDMA
    port replaced by a near value or anything, a key dropped or added, the port list
    emptied or repeated."""
    port = dict(PORT.as_dict())
    body = {"id": bytes(16), "port": 4000, "ports": [port]}
    near = {"id": st.binary(min_size=15, max_size=17), "port": st.integers(-1, 70000),
            "ports": st.lists(st.just(port), max_size=3)}
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["body", "port", "drop", "drop-port", "add", "add-port"]))
        if what == "body":
            k = draw(st.sampled_from(sorted(near)))
            body[k] = draw(st.one_of(near[k], _ANY))
        elif what == "port":
            k = draw(st.sampled_from(sorted(_FIELDS)))
            port[k] = draw(st.one_of(_FIELDS[k], _ANY))
        elif what in ("drop", "drop-port"):
            d = body if what == "drop" else port
            if d:
                del d[draw(st.sampled_from(sorted(d)))]
        else:
            (body if what == "add" else port)[draw(st.text(max_size=5))] = draw(_ANY)
    return offer.MAGIC + msgpack.packb(body)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_offers())
def test_fuzz_near_offers(data):
    _check(data)


def test_routes_are_bounded_least_recently_used_first_out_and_failures_expire():
    r = offer.Routes(size=3, backoff=0.05)
    for i in range(4):
        r.remember(f"h:{i}", f"verbs://h:{i}", bytes(16))
    assert len(r) == 3 and r.direct("h:0") is None
    assert r.direct("h:1") == ("verbs://h:1", bytes(16))      # now the most recent
    r.remember("h:9", "verbs://h:9", bytes(16))
    assert r.direct("h:2") is None and r.direct("h:1") is not None
    r.failed("h:1")
    assert r.direct("h:1") is None and r.blocked("h:1")
    time.sleep(0.06)
    assert not r.blocked("h:1") and len(r) == 2


# ---- the two halves of the judgement (the device's own calls patched) ----------------
def test_the_listener_pins_its_first_rdma_port_and_offers_the_bound_port(monkeypatch):
    asked = []

    class Bound:
        address = "verbs://10.77.0.2:41234"

    def fake_listen(address, **ring):
        asked.append((address, ring))
        return Bound()
    other = Port("mlx5_0", 2, 3, GID, "ethernet", "roce:10.77.0.0/24")
    monkeypatch.setattr(verbs_rank, "local_ports", lambda: ([PORT, other], ""))
    monkeypatch.setattr(offer._sync, "listen", fake_listen)
    ident = offer.new_id()
    lst, got = offer.listen("0.0.0.0", {"slots": 8, "slot_size": 4096}, ident)
    assert asked == [("verbs://0.0.0.0:0?device=rxe0&port=1&gid_index=1",
                      {"slots": 8, "slot_size": 4096})]
    assert lst is not None and got == verbs_offer(ident, 41234)
    offer.listen("::", {}, ident)
    assert asked[-1][0].startswith("verbs://[::]:0?")


def test_the_connector_routes_to_the_dialed_host_with_its_own_port_on_the_fabric(
        monkeypatch):
    from rdmamw.providers.verbs.address import parse_where
    o = verbs_offer(offer.new_id(), 41234)
    elsewhere = Port("mlx5_0", 1, 0, bytes(10) + b"\xff\xff" + bytes([192, 168, 1, 5]),
                     "ethernet", "roce:192.168.1.0/24")
    mine = Port("mlx5_1", 2, 3, bytes(10) + b"\xff\xff" + bytes([10, 77, 0, 9]),
                "ethernet", "roce:10.77.0.0/24")
    monkeypatch.setattr(verbs_rank, "local_ports", lambda: ([elsewhere, mine], ""))
    address, why = offer.route("10.0.0.7", o)
    assert why == "" and address == \
        "verbs://10.0.0.7:41234?device=mlx5_1&port=2&gid_index=3"
    w = parse_where(address.partition("://")[2])
    assert (w.host, w.port, w.opts["device"], w.opts["port"], w.opts["gid_index"]) == \
        ("10.0.0.7", 41234, "mlx5_1", 2, 3)
    assert offer.route("fe80::1", o)[0].startswith("verbs://[fe80::1]:41234?")
    monkeypatch.setattr(verbs_rank, "local_ports", lambda: ([elsewhere], ""))
    assert offer.route("10.0.0.7", o) == (None, offer.route("10.0.0.7", o)[1])
    assert "no common fabric" in offer.route("10.0.0.7", o)[1]
    monkeypatch.setattr(verbs_rank, "local_ports", lambda: ([], "no device"))
    assert offer.route("10.0.0.7", o) == (None, "no device")
    assert offer.route("10.0.0.7", offer.Offer(o.id))[0] is None


# ---- a listener without verbs ---------------------------------------------------------
@pytest.mark.parametrize("verbs", [True, False], ids=["verbs-on", "verbs-off"])
def test_a_listener_without_verbs_offers_none_and_comms_run_on_tcp(verbs, monkeypatch):
    """No RDMA port here (or ``distributed.comm.rdmamw.verbs: false``): the listener
    still sends its offer, naming no verbs, and every comm runs on tcp."""
    no_rdma(monkeypatch)
    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            host, port = lst.get_host_port()
            raw = await Channel.open(f"tcp://{host}:{port}", timeout=5)    # a bare peer
            first = await raw.recv()
            got = offer.decode(bytes(first))
            first.release()
            raw.close()
            assert got.scheme is None and got == lst._offer
            before = offer.COUNTS["offers"]
            for i in range(3):
                comm = await connect(lst.contact_address)
                assert comm.extra_info["provider"] == "tcp" and not comm.same_host
                await comm.write({"i": i})
                assert await comm.read() == {"i": i}
                await comm.close()
            assert offer.COUNTS["offers"] - before == 3     # no route: each reads one

    with no_shm(**{"distributed.comm.rdmamw.verbs": verbs}):
        run(main())
    assert len(dcomm._routes) == 0


# ---- hostile listeners, driven by hand ------------------------------------------------
async def hand_listener(first: bytes | None, serve: bool = True):
    """A plain rdmamw tcp listener that sends ``first`` (None: nothing) to each peer,
    then echoes Dask messages; (listener, its task)."""
    lst = await aio_listen("tcp://127.0.0.1:0", slots=8, slot_size=64 << 10)

    async def one(ch):
        if first is not None:
            await ch.send(first)
        if not serve:
            await asyncio.sleep(30)
            return
        await echo(dcomm.RdmamwComm(ch, "rdmamw://127.0.0.1:0", "rdmamw://peer:0"))

    async def loop():
        tasks = set()
        while True:
            ch = await lst.accept()
            t = asyncio.ensure_future(one(ch))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    return lst, asyncio.ensure_future(loop())


def _target(lst) -> str:
    return "rdmamw://" + lst.address.partition("://")[2]


@pytest.mark.parametrize("first", [b"hello", offer.MAGIC + b"\xc1",
                                   offer.MAGIC + bytes(4000),
                                   _raw(id=bytes(16), port=1, ports=[])],
                         ids=["junk", "bad-msgpack", "oversized", "bad-ports"])
def test_a_malformed_offer_fails_the_connect_typed_and_fast(first):
    async def main():
        lst, task = await hand_listener(first)
        try:
            t0 = time.monotonic()
            with pytest.raises(FatalCommClosedError, match="offer"):
                await dcomm.RdmamwConnector().connect(_target(lst))
            # distributed's connect does not retry it until its timeout either
            with pytest.raises(FatalCommClosedError):
                await connect(_target(lst), timeout=20)
            assert time.monotonic() - t0 < 5
        finally:
            task.cancel()
            lst.close()

    with no_shm():
        run(main(), timeout=30)


def test_a_silent_listener_is_comm_closed_at_the_connect_timeout():
    async def main():
        lst, task = await hand_listener(None, serve=False)
        try:
            t0 = time.monotonic()
            with pytest.raises(CommClosedError, match="no offer"):
                await dcomm.RdmamwConnector().connect(_target(lst))
            assert time.monotonic() - t0 < 5
        finally:
            task.cancel()
            lst.close()

    with no_shm(**{"distributed.comm.timeouts.connect": "1s"}):
        run(main(), timeout=30)


def _unreachable_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]       # closed again: nobody listens there


@pytest.mark.parametrize("here", ["no-rdma-here", "same-fabric"])
def test_an_offer_naming_an_unreachable_verbs_port_leaves_the_comm_on_tcp(
        here, monkeypatch):
    """Well-formed but useless: this process has no RDMA port (the host), or claims one
    on the offered fabric (patched) and the verbs open fails. The comm works on tcp,
    and the target stays on tcp (no verbs attempt per comm) for the backoff."""
    opened = []
    if here == "same-fabric":
        monkeypatch.setattr(verbs_rank, "local_ports", lambda: ([PORT], ""))
    else:
        no_rdma(monkeypatch)
    real = dcomm._open

    async def counting_open(address, timeout):
        opened.append(address)
        return await real(address, timeout)
    monkeypatch.setattr(dcomm, "_open", counting_open)

    async def main():
        lst, task = await hand_listener(offer.encode(
            verbs_offer(offer.new_id(), _unreachable_port())))
        target = _target(lst).partition("://")[2]
        try:
            for i in range(2):
                t0 = time.monotonic()
                comm = await dcomm.RdmamwConnector().connect(_target(lst))
                assert time.monotonic() - t0 < 8
                assert comm.extra_info["provider"] == "tcp"
                await comm.write({"i": i})
                assert await comm.read() == {"i": i}
                await comm.close()
        finally:
            task.cancel()
            lst.close()
        return target

    with no_shm():
        target = run(main(), timeout=40)
    verbs_tries = [a for a in opened if a.startswith("verbs://")]
    if here == "same-fabric":
        assert len(verbs_tries) == 1, opened        # the second comm: straight to tcp
        assert verbs_tries[0].startswith("verbs://127.0.0.1:")      # the dialed host
        assert "device=rxe0" in verbs_tries[0]                      # our port's options
    else:
        assert verbs_tries == []
    assert dcomm._routes.blocked(target)


# ---- the route, on the host: "verbs" pointed at a tcp side listener ------------------
@pytest.fixture
def fake_verbs(monkeypatch):
    """The listener offers a side channel that is really tcp (this host has no
    device), and the connector's route to it is that tcp address: the comm's logic
    (move, check the listener's id, remember, go direct, fall back) runs as on verbs."""
    sides = []

    def listen_side(host, ring, ident, base=None):
        lst = rdmamw.listen("tcp://127.0.0.1:0", **ring)
        sides.append(lst)
        return lst, verbs_offer(ident, int(lst.address.rpartition(":")[2]))

    def route(host, o):
        return f"tcp://{host}:{o.part.port}", ""

    monkeypatch.setattr(offer, "listen", listen_side)
    monkeypatch.setattr(offer, "route", route)
    return sides


def test_the_comm_moves_to_the_offered_channel_and_goes_there_directly_next(fake_verbs):
    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            side = fake_verbs[0].address.partition("://")[2]
            offers, direct = offer.COUNTS["offers"], offer.COUNTS["direct"]
            for i in range(3):
                comm = await connect(lst.contact_address)
                assert comm.peer_address == lst.contact_address
                await comm.write({"i": i, "x": to_serialize(np.arange(100_000))})
                back = await comm.read()
                assert back["i"] == i and np.array_equal(back["x"], np.arange(100_000))
                await comm.close()
            assert offer.COUNTS["offers"] - offers == 1         # the first comm only
            assert offer.COUNTS["direct"] - direct == 2
            assert dcomm._routes.direct(f"127.0.0.1:{lst.get_host_port()[1]}")[0] == \
                f"tcp://{side}"

    with no_shm():
        run(main())


def test_local_peers_still_use_shm_and_the_switch_keeps_comms_on_tcp(fake_verbs):
    """A remembered route does not take a local peer off shm; with
    ``distributed.comm.rdmamw.verbs: false`` a connector reads the offer and stays on
    tcp (no route learned, none used)."""
    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            target = f"127.0.0.1:{lst.get_host_port()[1]}"
            with no_shm():
                comm = await connect(lst.contact_address)
                await comm.close()
            assert dcomm._routes.direct(target) is not None
            offers, direct = offer.COUNTS["offers"], offer.COUNTS["direct"]
            comm = await connect(lst.contact_address)          # shm on (the default)
            assert comm.extra_info["provider"] == "shm" and comm.same_host
            await comm.close()
            dcomm._routes.forget(target)
            with no_shm(**{"distributed.comm.rdmamw.verbs": False}):
                for _ in range(2):
                    comm = await connect(lst.contact_address)
                    assert comm.extra_info["provider"] == "tcp"
                    assert comm._ch.peer == f"tcp://{target}"     # not the side channel
                    await comm.write("x")
                    assert await comm.read() == "x"
                    await comm.close()
            assert offer.COUNTS["offers"] - offers == 2
            assert offer.COUNTS["direct"] == direct
            assert dcomm._routes.direct(target) is None

    run(main())


def test_a_stale_route_falls_back_to_the_offer_over_tcp(fake_verbs):
    """The remembered side port now held by another listener (its offer's id differs),
    then by nobody: each connect still works, through tcp and a fresh offer, which
    puts the right route back."""
    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as a, \
                listen("rdmamw://127.0.0.1:0", echo):
            side_a, side_b = (s.address.partition("://")[2] for s in fake_verbs)
            target = f"127.0.0.1:{a.get_host_port()[1]}"
            comm = await connect(a.contact_address)
            await comm.close()
            _, ident = dcomm._routes.direct(target)
            for stale in (f"tcp://{side_b}", f"tcp://127.0.0.1:{_unreachable_port()}"):
                dcomm._routes.remember(target, stale, ident)
                offers, direct = offer.COUNTS["offers"], offer.COUNTS["direct"]
                comm = await connect(a.contact_address)
                await comm.write(stale)
                assert await comm.read() == stale
                await comm.close()
                assert offer.COUNTS["offers"] - offers == 1, stale
                assert offer.COUNTS["direct"] == direct, stale
                assert dcomm._routes.direct(target) == (f"tcp://{side_a}", ident), stale

    with no_shm(**{"distributed.comm.timeouts.connect": "5s"}):
        run(main())


# ---- with a device (the soft-RoCE VM) -------------------------------------------------
@pytest.mark.device
@pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE)
def test_a_comm_runs_on_verbs_frames_whole_and_the_second_connect_goes_direct():
    rng = np.random.default_rng(7)
    frames = [rng.integers(0, 255, n, dtype=np.uint8) for n in (8, 64 << 10, 8 << 20)]

    async def main():
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            assert lst._offer.scheme is not None, "the listener offers no verbs"
            offers, direct = offer.COUNTS["offers"], offer.COUNTS["direct"]
            for round_ in range(2):
                comm = await connect(lst.contact_address, timeout=60)
                assert comm.extra_info["provider"] == "verbs", comm.extra_info
                assert not comm.same_host
                for f in frames:
                    await comm.write({"f": to_serialize(f), "n": f.nbytes})
                    back = await comm.read()
                    assert back["n"] == f.nbytes and np.array_equal(back["f"], f)
                await comm.close()
                assert offer.COUNTS["offers"] - offers == 1, round_   # the first only
            assert offer.COUNTS["direct"] - direct == 1

    # a verbs attempt may take up to 5 s (min(5, connect timeout / 10)): a slow VM
    with no_shm(**{"distributed.comm.timeouts.connect": "60s"}):
        run(main(), timeout=300)
