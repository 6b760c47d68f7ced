"""rdmamw.aio on shm against the blocking API and pyzmq's zmq.asyncio (issue 17).

In one run, interleaved, medians of ``--repeats``:

* 8 B ping-pong round trip (two processes): rdmamw blocking, rdmamw.aio (both sides on
  an event loop), zmq.asyncio DEALER/ROUTER... as PAIR sockets over ipc://;
* 100 channels served by one event loop (a server process) against a client process
  that keeps one 8 B request in flight per channel: aggregate requests/s and the
  server's CPU per request;
* the same server idle with 100 channels awaiting: its CPU in % of a core.

    python bench/aio_bench.py [--seconds 1] [--repeats 5] [--json FILE]

Needs pyzmq (``pip install "pyzmq>=25"``; it is in pyproject's ``bench`` extra). Run it
on a quiet machine: every figure here moves with other load (``uptime`` is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import rdmamw
import rdmamw.aio as aio

PAYLOAD = b"x" * 8


# ---- the serving side (a child process) -----------------------------------------------
def serve_blocking(address: str) -> None:
    with rdmamw.listen(address) as lst:
        print("ready", flush=True)
        ch = lst.accept(timeout=60)
        try:
            while True:
                ch.send_batch(ch.recv_batch())
        except rdmamw.ChannelClosed:
            ch.close()


async def serve_aio(address: str, n: int, idle: float) -> None:
    async with await aio.listen(address) as lst:
        print("ready", flush=True)
        chans = [await lst.accept() for _ in range(n)]

        async def echo(ch: aio.Channel) -> int:
            k = 0
            try:
                while True:
                    msgs = await ch.recv_batch()
                    await ch.send_batch(msgs)
                    k += len(msgs)
            except rdmamw.ChannelClosed:
                ch.close()
            return k
        if idle:
            t0, c0 = time.monotonic(), _cpu()
            waits = [asyncio.create_task(ch.recv_batch()) for ch in chans]
            await asyncio.sleep(idle)
            print(json.dumps({"idle_cpu": (_cpu() - c0) / (time.monotonic() - t0)}),
                  flush=True)
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        c0 = _cpu()
        counts = await asyncio.gather(*(echo(ch) for ch in chans))
        print(json.dumps({"cpu": _cpu() - c0, "served": sum(counts)}), flush=True)


async def serve_zmq(address: str) -> None:
    import zmq
    import zmq.asyncio
    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.PAIR)
    s.bind(address)
    print("ready", flush=True)
    while True:
        m = await s.recv()
        if m == b"":
            break
        await s.send(m)
    s.close(0)
    ctx.term()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---- the measuring side ------------------------------------------------------------------
def child(*args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, __file__, "--serve", *args], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def pingpong_blocking(seconds: float, name: str) -> float:
    addr = f"shm://aio-bench-b-{os.getpid()}-{name}"
    p = child("blocking", addr)
    ch = rdmamw.Channel.open(addr, timeout=30)
    for _ in range(2000):
        ch.send(PAYLOAD)
        ch.recv()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            ch.send(PAYLOAD)
            ch.recv()
        n += 100
    rtt = (time.perf_counter() - t0) / n
    ch.close()
    p.wait(30)
    return rtt


async def _round_trips(send, recv, seconds: float, warmup: int = 2000) -> int:
    """Round trips of PAYLOAD through ``send``/``recv`` (coroutines) for ``seconds``
    after ``warmup`` of them; how many."""
    for _ in range(warmup):
        await send(PAYLOAD)
        await recv()
    n, stop = 0, time.perf_counter() + seconds
    while time.perf_counter() < stop:
        for _ in range(100):
            await send(PAYLOAD)
            await recv()
        n += 100
    return n


async def _pingpong_aio(addr: str, seconds: float) -> float:
    async with await aio.Channel.open(addr, timeout=30) as ch:
        await _round_trips(ch.send, ch.recv, 0, 2000)
        t0 = time.perf_counter()
        n = await _round_trips(ch.send, ch.recv, seconds, 0)
        return (time.perf_counter() - t0) / n


def pingpong_aio(seconds: float, name: str) -> float:
    addr = f"shm://aio-bench-a-{os.getpid()}-{name}"
    p = child("aio", addr, "1", "0")
    rtt = asyncio.run(_pingpong_aio(addr, seconds))
    p.stdout.readline()
    p.wait(30)
    return rtt


async def _pingpong_zmq(addr: str, seconds: float) -> float:
    import zmq
    import zmq.asyncio
    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.PAIR)
    s.connect(addr)
    await _round_trips(s.send, s.recv, 0, 2000)
    t0 = time.perf_counter()
    n = await _round_trips(s.send, s.recv, seconds, 0)
    rtt = (time.perf_counter() - t0) / n
    await s.send(b"")
    s.close(0)
    ctx.term()
    return rtt


def pingpong_zmq(seconds: float, name: str) -> float:
    addr = f"ipc:///tmp/aio-bench-z-{os.getpid()}-{name}"
    p = child("zmq", addr)
    rtt = asyncio.run(_pingpong_zmq(addr, seconds))
    p.wait(30)
    return rtt


async def _many(chans: list[aio.Channel], seconds: float) -> tuple[int, float]:
    """Every channel keeps one request in flight for ``seconds``: (requests, seconds)."""
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(_round_trips(ch.send, ch.recv, seconds, 0)
                                    for ch in chans))
    el = time.perf_counter() - t0
    for ch in chans:
        ch.close()
    return sum(counts), el


def many_channels(n: int, seconds: float, idle: float, name: str) -> dict:
    """A server process serves ``n`` channels on one loop (idle for ``idle`` s first,
    measuring its CPU); this process drives them from one loop."""
    addr = f"shm://aio-bench-m-{os.getpid()}-{name}"
    p = child("aio", addr, str(n), str(idle))

    async def run() -> tuple[int, float, dict]:
        chans = [await aio.Channel.open(addr, timeout=30) for _ in range(n)]
        idle_st = json.loads(await asyncio.to_thread(p.stdout.readline)) if idle else {}
        return (*await _many(chans, seconds), idle_st)

    done, el, idle_st = asyncio.run(run())
    st = json.loads(p.stdout.readline())
    p.wait(30)
    return {"rate": done / el, "cpu_per_msg_us": st["cpu"] / max(1, st["served"]) * 1e6,
            **idle_st}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--channels", type=int, default=100)
    ap.add_argument("--idle", type=float, default=5.0, help="idle measurement, seconds")
    ap.add_argument("--json")
    ap.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        kind, addr, *rest = a.serve
        if kind == "blocking":
            serve_blocking(addr)
        elif kind == "aio":
            asyncio.run(serve_aio(addr, int(rest[0]), float(rest[1])))
        else:
            asyncio.run(serve_zmq(addr))
        return
    print("load:", os.getloadavg())
    res: dict[str, list] = {"blocking": [], "aio": [], "zmq": [], "many": []}
    for r in range(a.repeats):
        res["blocking"].append(pingpong_blocking(a.seconds, f"{r}"))
        res["aio"].append(pingpong_aio(a.seconds, f"{r}"))
        res["zmq"].append(pingpong_zmq(a.seconds, f"{r}"))
        res["many"].append(many_channels(a.channels, a.seconds,
                                         a.idle if r == 0 else 0.0, f"{r}"))
    med = {k: statistics.median(v) for k, v in res.items() if k != "many"}
    rate = statistics.median(m["rate"] for m in res["many"])
    cpu = statistics.median(m["cpu_per_msg_us"] for m in res["many"])
    idle = res["many"][0].get("idle_cpu")
    print(f"8 B ping-pong round trip (median of {a.repeats}):")
    for k in ("blocking", "aio", "zmq"):
        print(f"  {k:9s} {med[k] * 1e6:8.1f} us")
    print(f"  aio / blocking = {med['aio'] / med['blocking']:.2f}x (target <= 3x)")
    print(f"  zmq.asyncio / aio = {med['zmq'] / med['aio']:.2f}x (target >= 10x)")
    print(f"{a.channels} channels on one loop: {rate:,.0f} requests/s, server CPU "
          f"{cpu:.1f} us per request; idle: {idle * 100 if idle is not None else -1:.2f} % "
          f"of a core (target < 1 %)")
    print("load:", os.getloadavg())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"raw": res, "median": med, "rate": rate, "cpu_per_msg_us": cpu,
                       "idle_cpu": idle, "load": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
