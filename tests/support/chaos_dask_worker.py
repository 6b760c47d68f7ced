"""A rank of a chaos trial in the ``dask`` layer (bench/chaos.py): Dask distributed's
``rdmamw://`` comm (rdmamw.dask). Rank 0 listens at ``rdmamw://MASTER_ADDR:MASTER_PORT``
and echoes every message on every comm; the other ranks connect and loop: write a
numbered message of 10 B to 1.2 MiB (eager and rendezvous frames), read it back,
check it byte for byte.

docs/dask.md "Errors" promises: a peer that closed or died fails ``read``/``write``
with ``CommClosedError`` (never another type, never a hang). The comm has no deadline
of its own (as tcp://: Dask's own timeouts bound it), so a stopped peer is not
promised to fail anything: the driver stops clients only, whose peers go on.

* a client prints ``{"rank", "ready"}`` after its first echo, then loops; after
  SIGUSR2 (the driver's "report") ``{"rank", "t", "calls", "wrong", "error": None,
  "t_last"}`` and closes its comm; on an error ``{"rank", "t", "calls", "wrong",
  "error", "msg"}``;
* the server prints ``{"rank", "ready"}``; after SIGUSR2 ``{"rank", "t", "error":
  None, "closed": [...], "odd": [...]}``: how each comm that ended ended
  (``CommClosedError``, or anything else, "odd");
* SIGUSR1 (the ``close`` fault): a client aborts its comm, the server its listener
  and every comm, at once (the loop's signal handler); then either idles, alive.

argv: ``dask SEED TIMEOUT STREAM_TIMEOUT`` (only the seed is used)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any

from distributed.comm import CommClosedError, connect, listen, registry

from rdmamw.dask.comm import RdmamwBackend

SIZES = (10, 3000, 70_000, 1_200_000)


def message(rank: int, i: int, size: int) -> bytes:
    return bytes([(rank * 37 + i * 11) % 251 + 1]) * size


def say(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


class Signals:
    """SIGUSR1 (close) and SIGUSR2 (report) as flags and an event of the loop."""

    def __init__(self) -> None:
        self.close, self.report = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.close.set)
        loop.add_signal_handler(signal.SIGUSR2, self.report.set)


async def idle(me: int) -> None:
    say({"rank": me, "closed": time.time()})
    while True:
        await asyncio.sleep(3600)


async def serve(address: str, me: int) -> None:
    sig = Signals()
    comms: set[Any] = set()
    closed: list[str] = []
    odd: list[str] = []

    async def echo(comm: Any) -> None:
        comms.add(comm)
        try:
            while True:
                await comm.write(await comm.read())
        except CommClosedError:
            closed.append("CommClosedError")
        except Exception as e:  # noqa: BLE001 - what the promise rules out
            odd.append(f"{type(e).__name__}: {e}"[:200])
        finally:
            comms.discard(comm)

    lst = listen(address, echo)
    await lst.start()
    say({"rank": me, "ready": True})
    done = asyncio.ensure_future(sig.report.wait())
    close = asyncio.ensure_future(sig.close.wait())
    await asyncio.wait([done, close], return_when=asyncio.FIRST_COMPLETED)
    if sig.close.is_set():
        lst.stop()
        for c in list(comms):
            c.abort()
        await idle(me)
    await asyncio.sleep(0.5)          # (a comm that ended just now is counted)
    say({"rank": me, "t": time.time(), "error": None, "closed": closed, "odd": odd})
    lst.stop()


async def client(address: str, me: int, seed: int) -> None:
    sig = Signals()
    rng = random.Random(seed + me)
    comm = await connect(address, timeout=60)
    calls = wrong = 0
    t_last = time.time()
    try:
        while not sig.report.is_set():
            if sig.close.is_set():
                comm.abort()
                await idle(me)
            b = message(me, calls, rng.choice(SIZES))
            await comm.write({"i": calls, "b": b})
            got = await comm.read()
            calls += 1
            wrong += got != {"i": calls - 1, "b": b}
            t_last = time.time()
            if calls == 1:
                say({"rank": me, "ready": True})
    except Exception as e:  # noqa: BLE001 - typed or not, the driver judges
        say({"rank": me, "t": time.time(), "calls": calls, "wrong": wrong,
             "error": type(e).__name__, "msg": str(e)[:300]})
        return
    say({"rank": me, "t": time.time(), "calls": calls, "wrong": wrong, "error": None,
         "t_last": t_last})
    await comm.close()


def main() -> None:
    registry.backends.setdefault("rdmamw", RdmamwBackend())
    me = int(os.environ["RANK"])
    address = f"rdmamw://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    asyncio.run(serve(address, me) if me == 0 else client(address, me, int(sys.argv[2])))


if __name__ == "__main__":
    main()
