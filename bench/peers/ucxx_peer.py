"""ucxx (RAPIDS' Python binding of UCX) on host memory: the Python UCX peer of
bench/run.py, beside UCX's own C benchmark.

Usage (started by bench/run.py under the ucxx venv of bench/setup.sh): ucxx_peer.py
a|b CONFIG_JSON. Role b listens on ``cfg["port"]`` and serves (echo / count); role a
connects and drives every phase. Its asyncio API is the one ucxx documents (tag
``send``/``recv`` of numpy arrays on an endpoint; the progress thread is its default).
A tag receive is posted with the message's size, so the end of a phase cannot be a
shorter message: every message's first byte says whether more follow (1) or the phase
ends (0). A "batch of k" is k sends awaited together (``asyncio.gather``): ucxx has no
batch call for independent messages. No GPU is needed: the wheel (``ucxx-cu12``)
imports and runs on DRAM; UCX picks its shared-memory transports on one host.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np
import ucxx
from common import aligned, emit, latency_summary, load_config, pin, rate_summary, run_phases

OP_DONE, OP_LAT, OP_STREAM = 0, 1, 2


async def serve(cfg: dict) -> None:
    """Role b: obey the client's headers ([op, size, batch]) until OP_DONE."""
    done = asyncio.Event()

    async def client(ep) -> None:
        hdr = np.empty(3, np.int64)
        while True:
            await ep.recv(hdr)
            op, size = int(hdr[0]), int(hdr[1])
            if op == OP_DONE:
                break
            buf = aligned(size)
            n = 0
            while True:
                await ep.recv(buf)
                if buf[0] == 0:
                    break
                if op == OP_LAT:
                    await ep.send(buf)
                n += 1
            if op == OP_STREAM:
                await ep.send(np.array([n], np.int64))
        await ep.close()
        done.set()

    listener = ucxx.create_listener(client, port=cfg["port"])
    await done.wait()
    listener.close()


async def connect(cfg: dict):
    """The endpoint to role b, which may still be starting."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await ucxx.create_endpoint("127.0.0.1", cfg["port"])
        except Exception:           # (ucxx raises its own errors: not listening yet)
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def ping_pong(ep, size: int, cfg: dict) -> dict:
    """Time-bounded ping-pong; every round trip is stamped."""
    buf, back = aligned(size, fill=1), aligned(size)
    await ep.send(np.array([OP_LAT, size, 1], np.int64))
    stamps = []
    clock = time.perf_counter_ns
    t = clock()
    stamps.append(t)
    deadline = t + int((cfg["lat_warmup_seconds"] + cfg["lat_seconds"]) * 1e9)
    left = cfg["lat_max_iters"]
    while t < deadline and left:
        await ep.send(buf)
        await ep.recv(back)
        t = clock()
        stamps.append(t)
        left -= 1
    buf[0] = 0
    await ep.send(buf)
    return latency_summary(stamps, int(cfg["lat_warmup_seconds"] * 1e9))


async def stream_once(ep, buf: np.ndarray, k: int, seconds: float) -> dict:
    """Batches of k for ``seconds``, then the end; time until b's count arrives."""
    await ep.send(np.array([OP_STREAM, buf.nbytes, k], np.int64))
    clock = time.perf_counter
    t0 = clock()
    deadline = t0 + seconds
    sent = 0
    while True:
        await asyncio.gather(*[ep.send(buf) for _ in range(k)])
        sent += k
        if clock() >= deadline:
            break
    end = buf.copy()
    end[0] = 0
    await ep.send(end)
    count = np.empty(1, np.int64)
    await ep.recv(count)
    return {"messages": int(count[0]), "sent": sent, "seconds": clock() - t0}


async def stream(ep, size: int, k: int, runs: int, seconds: float) -> dict:
    """One discarded warm-up run, then ``runs`` measured runs."""
    buf = aligned(size, fill=1)
    await stream_once(ep, buf, k, min(seconds, 0.1))
    return rate_summary([await stream_once(ep, buf, k, seconds) for _ in range(runs)], size)


def drive(cfg: dict) -> None:
    """Role a: run the phases (each on the one event loop) and print the result."""
    loop = asyncio.new_event_loop()
    ep = loop.run_until_complete(connect(cfg))
    out: dict = {"system": "ucxx", "version": ucxx.__version__,
                 "batch_semantics": "k sends awaited together (asyncio.gather)"}
    out.update(run_phases(
        cfg, lambda size: loop.run_until_complete(ping_pong(ep, size, cfg)),
        lambda *a: loop.run_until_complete(stream(ep, *a))))
    loop.run_until_complete(ep.send(np.array([OP_DONE, 0, 0], np.int64)))
    loop.run_until_complete(ep.close())
    emit(out)


def main() -> None:
    """Entry point: pin, then serve (b) or drive (a)."""
    role = sys.argv[1]
    cfg = load_config()
    pin(0 if role == "a" else 1)
    if role == "a":
        drive(cfg)
    else:
        asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
