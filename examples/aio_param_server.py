"""An asyncio parameter server: one process, one event loop, many workers.

The server holds a model (a few float32 tensors) and answers every worker's requests
on one event loop, a coroutine per worker channel and no thread per channel
(rdmamw.aio): ``pull`` returns every tensor (one batch, zero-copy from the arrays),
``push`` adds a gradient to one tensor. The workers here are processes using the
blocking API (they could be anything that opens a channel).

    python examples/aio_param_server.py --workers 8 --rounds 50

Each worker, every round, pulls the model and pushes a gradient of ones into each tensor; at the
end every tensor equals workers x rounds (the server checks it and prints one JSON
line: requests served, wall time, requests/s)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np

import rdmamw
import rdmamw.aio as aio

SHAPES = {"embed": (64, 32), "dense.w": (32, 32), "dense.b": (32,)}


async def serve(ch: aio.Channel, model: dict[str, np.ndarray], names: list[str]) -> int:
    """Answer one worker until it closes: b"pull" -> every tensor; b"push", name,
    gradient -> add it. Returns the requests served."""
    served = 0
    try:
        while True:
            req = await ch.recv_batch()
            i = 0
            while i < len(req):
                op = bytes(req[i])
                if op == b"pull":
                    await ch.send_batch([model[k] for k in names])
                    i += 1
                elif op == b"push":
                    # the gradient arrives in the same or the next batch
                    while len(req) < i + 3:
                        req += await ch.recv_batch()
                    name = bytes(req[i + 1]).decode()
                    model[name] += np.frombuffer(req[i + 2], np.float32).reshape(
                        model[name].shape)
                    i += 3
                else:
                    raise ValueError(f"unknown request {op!r}")
                served += 1
            for m in req:
                m.release()
    except rdmamw.ChannelClosed:
        ch.close()
    return served


async def server(address: str, workers: int) -> dict:
    model = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    names = list(SHAPES)
    async with await aio.listen(address) as lst:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", address, str(r),
                                   str(ARGS.rounds)]) for r in range(workers)]
        t0 = time.perf_counter()
        tasks = []
        for _ in range(workers):
            async with asyncio.timeout(60):
                ch = await lst.accept()
            tasks.append(asyncio.create_task(serve(ch, model, names)))
        served = sum(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t0
    for p in procs:
        if p.wait(60) != 0:
            raise SystemExit(f"a worker failed ({p.returncode})")
    want = float(workers * ARGS.rounds)
    ok = all(np.all(v == want) for v in model.values())
    return {"workers": workers, "requests": served, "wall_s": round(wall, 3),
            "requests_per_s": round(served / wall), "model_ok": ok}


def worker(address: str, rank: int, rounds: int) -> None:
    """A blocking worker: pull, push ones into every tensor, and pull again."""
    with rdmamw.Channel.open(address, timeout=30) as ch:
        for _ in range(rounds):
            ch.send(b"pull").wait()
            got: list = []
            while len(got) < len(SHAPES):
                got += ch.recv_batch()
            for name, shape in SHAPES.items():
                ch.send_batch([b"push", name.encode(), np.ones(shape, np.float32)]).wait()
            del got


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--address", default=f"shm://aio-ps-{os.getpid()}")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ARGS = ap.parse_args()
    if ARGS.worker:
        worker(ARGS.worker[0], int(ARGS.worker[1]), int(ARGS.worker[2]))
    else:
        result = asyncio.run(server(ARGS.address, ARGS.workers))
        print(json.dumps(result))
        sys.exit(0 if result["model_ok"] else 1)
