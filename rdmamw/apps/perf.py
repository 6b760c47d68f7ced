"""``rdmamw perf``: perftest's ib_send_lat / ib_write_bw (or ucx_perftest) for rdmamw
channels, on every provider: a server on one end, a client on the other.

    rdmamw perf --server [ADDR | --bind HOST]   # prints the address it listens on
    rdmamw perf ADDR [-t lat|bw|rate|read|write|atomic] [-s SIZE[,SIZE..] | -a]
                     [-n ITERS] [--batch N] [--mode batched|ack|batched,ack]
                     [--provider SCHEME] [--json]

ADDR is ``HOST[:PORT]`` (tcp, verbs; port 18515 as perftest's), a name (shm), or a
whole address (``verbs://10.0.0.1:7000``). The client decides the test and sends its
parameters as the first message of each channel (one channel per mode, since the
opener chooses the mode); the server follows and exits after the client's last run.
The server answers the parameters: accepted, or refused with the reason (the client
raises it as ProtocolError). A client that sends bad parameters or a bad message (told
why), stalls or leaves mid-run is dropped (noted on the server's output) and the
server waits for the next. Like perftest's, the server
listens on every interface (0.0.0.0) unless ADDR or ``--bind HOST`` names one; it
says so when it starts.
``lat`` is a ping-pong (one message each way per iteration; latency = half the round
trip, as perftest's); ``bw`` and ``rate`` stream ``--batch`` messages per
``send_batch`` until the server has counted ``-n`` of them and answered (``rate``:
small messages by default, for messages per second). Each test has an untimed warm-up.
In ``bw``/``rate`` the latency columns are the time per message in the stream (time
between batches / batch). ``read``, ``write`` and ``atomic`` are one-sided: the server
exposes a buffer and the client reads, writes or fetch-adds it (``perf_rmem``). Every
wait is bounded by ``--timeout``."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import msgpack

import rdmamw
from rdmamw.apps import perf_rmem
from rdmamw.config import parse_bytes
from rdmamw.errors import MessageTooLarge, ProtocolError, RdmamwError
from rdmamw.memory.units import human
from rdmamw.providers import best, schemes
from rdmamw.providers import provider as lookup
from rdmamw.transport.wire import MODES

DEFAULT_PORT = 18515
TESTS = ("lat", "bw", "rate", *perf_rmem.TESTS)
DEFAULT_SIZE = {"lat": 8, "bw": 65536, "rate": 8, "read": 65536, "write": 65536,
                "atomic": perf_rmem.WORD}
DEFAULT_ITERS = {"lat": 1000, "bw": 5000, "rate": 100000, "read": 5000, "write": 5000,
                 "atomic": 10000}
MAX_BATCH = 4096
MAX_SIZES = 64
MAX_ITERS = 10 ** 9
MAX_SIZE = 1 << 30
PARAMS_VERSION = 2      # 2: the server answers the parameters (accepted or refused)


@dataclass(frozen=True)
class Params:
    """What the client asks the server to run on one channel."""

    test: str
    sizes: list
    iters: int
    warmup: int
    batch: int
    last: bool


def check_params(raw: bytes) -> Params:
    """The client's first message, read once into local values and checked before use."""
    try:
        d = msgpack.unpackb(raw)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise ProtocolError(f"perf parameters are not msgpack: {e}") from None
    if not isinstance(d, dict) or d.get("v") != PARAMS_VERSION:
        raise ProtocolError(f"perf parameters {d!r:.80} are not version {PARAMS_VERSION}")
    test, sizes, last = d.get("test"), d.get("sizes"), d.get("last")
    nums = {k: d.get(k) for k in ("iters", "warmup", "batch")}
    if test not in TESTS or not isinstance(last, bool) or not all(
            type(v) is int for v in nums.values()):
        raise ProtocolError(f"perf parameters {d!r:.120}: bad test, iters, warmup, batch "
                            f"or last")
    if not (isinstance(sizes, list) and 1 <= len(sizes) <= MAX_SIZES and all(
            type(s) is int and 1 <= s <= MAX_SIZE for s in sizes)):
        raise ProtocolError(f"perf sizes {sizes!r:.120}: 1..{MAX_SIZES} sizes of "
                            f"1..{MAX_SIZE} bytes")
    if not (1 <= nums["iters"] <= MAX_ITERS and 0 <= nums["warmup"] <= MAX_ITERS
            and 1 <= nums["batch"] <= MAX_BATCH):
        raise ProtocolError(f"perf parameters out of range: {nums}")
    return Params(test, list(sizes), nums["iters"], nums["warmup"], nums["batch"], last)


# ---- server ------------------------------------------------------------------------

def _report(ch, n: int, nbytes: int) -> None:
    ch.send(msgpack.packb({"n": n, "bytes": nbytes}))


def _sink(ch, count: int, timeout: float) -> None:
    """Receive and release ``count`` messages (bw, rate), then say how many and bytes."""
    n = nbytes = 0
    recv_batch = ch.recv_batch
    while n < count:
        msgs = recv_batch(timeout=timeout)
        n += len(msgs)
        nbytes += sum(map(len, msgs))
        del msgs
    _report(ch, n, nbytes)


def _echo(ch, reply: memoryview, count: int, timeout: float) -> None:
    """Answer each of ``count`` messages with one of its size (lat); then the report."""
    nbytes = 0
    for _ in range(count):
        m = ch.recv(timeout=timeout)
        size = len(m)
        m.release()
        ch.send(reply[:size], timeout=timeout)
        nbytes += 2 * size
    _report(ch, 2 * count, nbytes)


def _serve_one(ch, timeout: float) -> Params:
    """One client's channel: its parameters (answered: accepted, or refused by the
    caller), every run they ask for, its close."""
    m = ch.recv(timeout=timeout)
    try:
        p = check_params(bytes(m))
    finally:
        m.release()
    ch.send(msgpack.packb({"accepted": True}), timeout=timeout)
    try:
        if p.test in perf_rmem.TESTS:
            perf_rmem.serve(ch, p.test, p.sizes, 2 * len(p.sizes), timeout)
        else:
            _serve_messages(ch, p, timeout)
    except MemoryError:
        raise ProtocolError(f"perf: {human(max(p.sizes))} cannot be allocated here") from None
    # the client closes first: its last report must not race our close; after a
    # one-sided run, its check of our revoke ends a verbs connection (the NIC refused)
    gone = (rdmamw.ChannelClosed, rdmamw.PeerLost) if p.test in perf_rmem.TESTS else (
        rdmamw.ChannelClosed,)
    try:
        ch.recv(timeout=timeout)
    except gone:
        pass
    return p


def _serve_messages(ch, p: Params, timeout: float) -> None:
    reply = memoryview(bytearray(max(p.sizes) if p.test == "lat" else 1))
    for _size in p.sizes:
        for count in (p.warmup, p.iters):
            if p.test == "lat":
                _echo(ch, reply, count, timeout)
            else:
                _sink(ch, count, timeout)


#: what one client can do to its own channel (bad parameters, a stall, leaving mid-run):
#: that channel is dropped and the server serves the next
CLIENT_FAILURES = (ProtocolError, rdmamw.PeerLost, rdmamw.ChannelClosed, rdmamw.Timeout,
                   MessageTooLarge)


def exposure_note(address: str) -> str:
    """What to say of a server listening on every interface (else "")."""
    host = address.partition("://")[2].rpartition(":")[0].strip("[]")
    if host not in ("0.0.0.0", "::", ""):
        return ""
    return (f"rdmamw perf: listening on every interface ({host or '*'}), as perftest does; "
            f"--bind HOST listens on one")


def serve(address: str, timeout: float, out=sys.stdout) -> int:
    """Serve clients' runs until one says it was the last; the number of runs. A
    client's failure (:data:`CLIENT_FAILURES`) drops its channel, noted on ``out``."""
    runs = 0
    with rdmamw.listen(address) as lst:
        print(f"rdmamw perf: listening on {lst.address}", file=out, flush=True)
        note = exposure_note(lst.address)
        if note:
            print(note, file=sys.stderr, flush=True)
        while True:
            with lst.accept(timeout=timeout) as ch:
                try:
                    p = _serve_one(ch, timeout)
                except CLIENT_FAILURES as e:
                    if isinstance(e, ProtocolError):
                        perf_rmem.refuse(ch, e)         # the client gets the reason
                    print(f"rdmamw perf: client {ch.peer} dropped: {type(e).__name__}: {e}",
                          file=out, flush=True)
                    continue
            runs += 1
            if p.last:
                return runs


# ---- client ------------------------------------------------------------------------

@dataclass
class Row:
    """One line of the table: a size in a mode."""

    mode: str
    size: int
    iters: int
    seconds: float
    bw_MBps: float
    msg_rate: float
    lat_typical_us: float
    lat_avg_us: float
    lat_p99_us: float
    server_messages: int
    server_bytes: int
    doorbells_per_msg: float
    signaled_per_msg: float


def _server_report(ch, timeout: float) -> dict:
    d = perf_rmem.message(ch, timeout)      # a refusal: ProtocolError with its reason
    if not (type(d.get("n")) is int and type(d.get("bytes")) is int):
        raise ProtocolError(f"server report {d!r:.80} is not {{n, bytes}}")
    return d


def _lat(ch, buf: memoryview, count: int, timeout: float, times: list | None) -> dict:
    send, recv, clock = ch.send, ch.recv, time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        send(buf, timeout=timeout)
        recv(timeout=timeout).release()
        if times is not None:
            times.append((clock() - t0) / 2000)      # one way, microseconds
    return _server_report(ch, timeout)


def _stream(ch, buf: memoryview, count: int, batch: int, timeout: float,
            times: list | None) -> dict:
    msgs = [buf] * batch
    send_batch, clock = ch.send_batch, time.perf_counter_ns
    sent, last = 0, clock()
    while sent < count:
        k = min(batch, count - sent)
        send_batch(msgs if k == batch else msgs[:k], timeout=timeout)
        sent += k
        if times is not None:
            now = clock()
            times.append((now - last) / 1000 / k)     # microseconds per message
            last = now
    return _server_report(ch, timeout)


def _quantile(sorted_values: list, q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def measure(address: str, test: str, sizes: list, iters: int, batch: int, mode: str,
            last: bool, timeout: float) -> list[Row]:
    """One channel in ``mode``: every size, warm-up then timed; one Row per size."""
    warmup = min(iters, 100) if test == "lat" else min(iters, max(batch, iters // 10))
    rows = []
    with rdmamw.Channel.open(address, mode=mode, timeout=timeout) as ch:
        ch.send(msgpack.packb({"v": PARAMS_VERSION, "test": test, "sizes": sizes,
                               "iters": iters, "warmup": warmup, "batch": batch,
                               "last": last}))
        if perf_rmem.message(ch, timeout).get("accepted") is not True:
            raise ProtocolError("perf: the server neither accepted nor refused the test")
        buf = memoryview(bytearray(max(sizes)))
        ref = perf_rmem.open_ref(ch, timeout) if test in perf_rmem.TESTS else None
        word = 0
        for size in sizes:
            for seed, (count, times) in enumerate(((warmup, None), (iters, [])), 1):
                before = ch.stats()
                t0 = time.perf_counter()
                if ref is not None:
                    word = perf_rmem.run(ch, test, ref, size, count, batch, seed, word,
                                         timeout, times)
                    rep = _rmem_report(test, before, ch.stats(), count, size)
                elif test == "lat":
                    rep = _lat(ch, buf[:size], count, timeout, times)
                else:
                    rep = _stream(ch, buf[:size], count, batch, timeout, times)
                seconds = time.perf_counter() - t0
                after = ch.stats()
            expect = iters * (2 if test == "lat" else 1)
            if rep["n"] != expect or rep["bytes"] != expect * size:
                raise ProtocolError(f"the server counted {rep['n']} messages / {rep['bytes']} "
                                    f"bytes of {size}, expected {expect} / {expect * size}")
            times.sort()
            rows.append(Row(
                mode, size, iters, seconds, iters * size / seconds / 1e6, iters / seconds,
                _quantile(times, 0.5), sum(times) / len(times), _quantile(times, 0.99),
                rep["n"], rep["bytes"],
                (after["doorbells"] - before["doorbells"]) / iters,
                (after["signaled_completions"] - before["signaled_completions"]) / iters))
        if ref is not None:
            perf_rmem.finish(ch, test, ref, timeout)
    return rows


def _rmem_report(test: str, before: dict, after: dict, count: int, size: int) -> dict:
    """A one-sided run's counts, the server's CPU taking no part: the channel's for
    read and write; for atomic ``count`` adds (each checked by ``perf_rmem.run``)."""
    if test == "atomic":
        return {"n": count, "bytes": count * size}
    key = "rmem_bytes_read" if test == "read" else "rmem_bytes_written"
    return {"n": after["rmem_ops"] - before["rmem_ops"], "bytes": after[key] - before[key]}


# ---- the command -------------------------------------------------------------------

def default_provider() -> str:
    """The network provider of the highest preference that works here."""
    return best(network=True).scheme


def resolve(addr: str | None, provider: str | None, server: bool,
            bind: str | None = None) -> str:
    """The channel address for ADDR, --provider and --bind (see the module docstring)."""
    if bind is not None:
        if not server:
            raise ValueError("--bind is the server's (the client connects to ADDR)")
        if addr:
            raise ValueError("give the server ADDR or --bind HOST, not both")
        if not bind.strip():
            raise ValueError("--bind needs a host")
        addr = bind
    if addr and "://" in addr:
        scheme = addr.partition("://")[0]
        if provider and provider != scheme:
            raise ValueError(f"--provider {provider} but the address is {scheme}://")
        return addr
    provider = provider or default_provider()
    if not lookup(provider).network:       # a name on this host, not HOST:PORT
        if bind is not None:
            raise ValueError(f"--bind is for network providers, not {provider}")
        return f"{provider}://{addr or 'rdmamw-perf'}"
    if not addr:
        if not server:
            raise ValueError("the client needs the server's ADDR")
        addr = "0.0.0.0"
    host_only = addr.startswith("[") and addr.endswith("]") or addr.count(":") != 1
    if host_only and not (addr.startswith("[") and "]:" in addr):
        addr = f"{addr}:{DEFAULT_PORT}"
    return f"{provider}://{addr}"


def table(test: str, address: str, batch: int, rows: list[Row]) -> str:
    lines = []
    for mode in dict.fromkeys(r.mode for r in rows):
        head = (f" {'#bytes':<10} {'#iterations':>11} {'BW average[MB/sec]':>19} "
                f"{'MsgRate[Mpps]':>14} {'t_typical[usec]':>16} {'t_avg[usec]':>12} "
                f"{'t_99%[usec]':>12}")
        rule = "-" * len(head)
        what = {"lat": "ping-pong", "atomic": "one fetch_add at a time"}.get(
            test, f"batch {batch}")
        lines += [rule, f" rdmamw perf {test} | {address} | mode {mode} | {what}", rule, head]
        for r in rows:
            if r.mode == mode:
                lines.append(f" {r.size:<10} {r.iters:>11} {r.bw_MBps:>19.2f} "
                             f"{r.msg_rate / 1e6:>14.6f} {r.lat_typical_us:>16.2f} "
                             f"{r.lat_avg_us:>12.2f} {r.lat_p99_us:>12.2f}")
        lines.append(rule)
    return "\n".join(lines)


def ratios(rows: list[Row]) -> dict:
    """size -> batched / ack messages per second, for the sizes run in both modes."""
    rate = {(r.mode, r.size): r.msg_rate for r in rows}
    return {str(s): rate[("batched", s)] / rate[("ack", s)]
            for m, s in rate if m == "batched" and ("ack", s) in rate}


def _sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    try:
        if args.all:
            top = parse_bytes(args.max_size, "--max-size")
            return [1 << k for k in range(1, max(1, top.bit_length() - 1) + 1) if 1 << k <= top]
        if args.size:
            sizes = [parse_bytes(s, "size") for s in args.size.split(",")]
        else:
            sizes = [DEFAULT_SIZE[args.test]]
    except RdmamwError as e:
        parser.error(str(e))
    if not sizes or not all(1 <= s <= MAX_SIZE for s in sizes) or len(sizes) > MAX_SIZES:
        parser.error(f"size: 1..{MAX_SIZES} sizes of 1 B..{human(MAX_SIZE)} each")
    return sizes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdmamw perf", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("address", nargs="?", metavar="ADDR",
                   help="the server (client); where to listen (server)")
    p.add_argument("--server", action="store_true", help="be the server")
    p.add_argument("--bind", metavar="HOST",
                   help="the server's interface (default 0.0.0.0: every interface)")
    p.add_argument("-t", "--test", choices=TESTS, default="bw",
                   help="default bw; read, write, atomic: one-sided remote memory")
    sz = p.add_mutually_exclusive_group()
    sz.add_argument("-s", "--size", help="message size(s), e.g. 8 or 64K or 8,4K,1M "
                                         "(default: 8 for lat and rate, 64K for bw)")
    sz.add_argument("-a", "--all", action="store_true",
                    help="sweep sizes 2 B .. --max-size in powers of two")
    p.add_argument("--max-size", default="1M", help="top of the -a sweep (default 1M)")
    p.add_argument("-n", "--iters", type=int,
                   help="timed iterations per size (default lat 1000, bw 5000, rate 100000)")
    p.add_argument("--batch", type=int, default=64,
                   help=f"messages per send_batch in bw/rate, operations per chain in "
                        f"read/write (1..{MAX_BATCH}, default 64)")
    p.add_argument("--mode", default="batched",
                   help="batched, ack, or both comma-separated for a ratio in one run")
    p.add_argument("--provider", choices=schemes(),
                   help="default: verbs where a device is usable, else tcp")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="bound of every wait in seconds: connect, accept, each receive "
                        "(default 60)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    modes = args.mode.split(",")
    for m in modes:
        if m not in MODES:
            p.error(f"--mode {m!r}: known modes {', '.join(MODES)}")
    if args.iters is not None and not 1 <= args.iters <= MAX_ITERS:
        p.error(f"-n must be 1..{MAX_ITERS}")
    if not 1 <= args.batch <= MAX_BATCH:
        p.error(f"--batch must be 1..{MAX_BATCH}")
    if not args.timeout > 0:
        p.error("--timeout must be positive")
    sizes = _sizes(p, args)
    if args.test == "atomic" and sizes != [perf_rmem.WORD]:
        p.error(f"-t atomic: the size is {perf_rmem.WORD} (64-bit words)")
    iters = args.iters or DEFAULT_ITERS[args.test]
    try:
        address = resolve(args.address, args.provider, args.server, args.bind)
    except ValueError as e:
        p.error(str(e))
    try:
        if args.server:
            serve(address, args.timeout)
            return 0
        rows = []
        for i, mode in enumerate(modes):
            rows += measure(address, args.test, sizes, iters, args.batch, mode,
                            i == len(modes) - 1, args.timeout)
    except RdmamwError as e:
        print(f"rdmamw perf: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump({"tool": "rdmamw perf", "version": rdmamw.__version__, "test": args.test,
                   "provider": address.partition("://")[0], "address": address,
                   "modes": modes, "sizes": sizes, "iters": iters, "batch": args.batch,
                   "results": [asdict(r) for r in rows], "ratio_msg_rate": ratios(rows)},
                  sys.stdout, indent=1)
        print()
        return 0
    print(table(args.test, address, args.batch, rows))
    for size, ratio in ratios(rows).items():
        rate = {r.mode: r.msg_rate for r in rows if r.size == int(size)}
        print(f"batched/ack message rate at {human(int(size))}: {ratio:.1f}x "
              f"(batched {rate['batched'] / 1e6:.4f} Mpps, ack {rate['ack'] / 1e6:.4f} Mpps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
