"""Dask distributed's comm layer, rdmamw:// against tcp:// and inproc:// (the ceiling:
no serialization, no copy), in one run (issue 31 item 4; docs/dask.md).

For each size (8 B, 64 KiB, 2 MiB, 64 MiB) a client in this process and an echo
server in another (inproc: the same process, another thread's loop is not needed)
exchange ``{"x": to_serialize(bytes-like)}`` through ``distributed.comm``'s public
``connect``/``listen``: round trip = write + read of the echo; throughput = the bytes
of both directions over the round trip. Reported: medians over ``--reps`` round trips
after a warm-up, and the ratios rdmamw/tcp. Only same-run ratios mean anything.

    python bench/dask_bench.py [--reps N] [--sizes 8,64K,2M,64M] [--json]
    python bench/dask_bench.py --no-shm    # rdmamw:// as across hosts: verbs, else tcp

The provider each rdmamw:// comm ran on (shm on one host by default; ``--no-shm``
sets ``distributed.comm.rdmamw.shm: false``, so the comm takes the listener's verbs
offer where there is a fabric, as between hosts) is printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.dask_echo import echo  # noqa: E402 - test-only, not in the package

SIZES = {"8B": 8, "64KiB": 64 << 10, "2MiB": 2 << 20, "64MiB": 64 << 20}


def _server(scheme: str, q, no_shm: bool = False) -> None:
    if no_shm:
        _no_shm()
    import rdmamw.dask
    rdmamw.dask.register()
    from distributed.comm import listen

    async def main():
        async with listen(f"{scheme}://127.0.0.1:0", echo) as lst:
            q.put(lst.contact_address)
            await asyncio.sleep(3600)
    asyncio.run(main())


#: the providers the rdmamw:// comms of this process ran on
PROVIDERS: set[str] = set()


async def _measure(addr: str, size: int, reps: int) -> list[float]:
    from distributed.comm import connect
    from distributed.protocol import to_serialize
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    msg = {"x": to_serialize(payload)}
    comm = await connect(addr)
    if addr.startswith("rdmamw://"):
        PROVIDERS.add(comm.extra_info.get("provider", "?"))
    times = []
    for i in range(reps + max(2, reps // 5)):
        t = time.perf_counter()
        await comm.write(msg)
        back = await comm.read()
        dt = time.perf_counter() - t
        if i >= max(2, reps // 5):
            times.append(dt)
    assert len(back["x"]) == size
    await comm.close()
    return times


def _no_shm() -> None:
    import dask
    dask.config.set({"distributed.comm.rdmamw.shm": False})


def run_scheme(scheme: str, sizes: dict[str, int], reps: dict[str, int],
               no_shm: bool = False) -> dict:
    out = {}
    if scheme == "inproc":
        from distributed.comm import listen

        async def main():
            async with listen("inproc://", echo) as lst:
                for name, n in sizes.items():
                    out[name] = await _measure(lst.contact_address, n, reps[name])
        asyncio.run(main())
        return out
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_server, args=(scheme, q, no_shm), daemon=True)
    p.start()
    try:
        addr = q.get(timeout=60)
        for name, n in sizes.items():
            out[name] = asyncio.run(_measure(addr, n, reps[name]))
    finally:
        p.kill()
        p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200, help="round trips per size (64 MiB: "
                    "a tenth, at least 5)")
    ap.add_argument("--sizes", default=",".join(SIZES), help="of " + ",".join(SIZES))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-shm", action="store_true",
                    help="rdmamw:// comms do not use shm (as between hosts: the verbs "
                         "offer where there is a fabric, else tcp)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import rdmamw.dask
    rdmamw.dask.register()
    sizes = {k: SIZES[k] for k in args.sizes.split(",")}
    reps = {k: args.reps if n < (8 << 20) else max(5, args.reps // 10)
            for k, n in sizes.items()}
    if args.no_shm:
        _no_shm()
    res = {s: run_scheme(s, sizes, reps, args.no_shm) for s in ("rdmamw", "tcp", "inproc")}
    rows = []
    for name, n in sizes.items():
        row = {"size": name}
        for s in res:
            med = statistics.median(res[s][name])
            row[f"{s}_rtt_us"] = med * 1e6
            row[f"{s}_MBps"] = 2 * n / med / 1e6
        row["rtt_tcp_over_rdmamw"] = row["tcp_rtt_us"] / row["rdmamw_rtt_us"]
        row["rdmamw_over_inproc_rtt"] = row["rdmamw_rtt_us"] / row["inproc_rtt_us"]
        rows.append(row)
    if args.json:
        print(json.dumps({"providers": sorted(PROVIDERS), "rows": rows}, indent=1))
        return
    print(f"rdmamw:// comms ran on: {', '.join(sorted(PROVIDERS))}")
    print(f"{'size':>6} | {'round trip, median (us)':^34} | {'throughput (MB/s, both ways)':^32} |"
          f" speed-up")
    print(f"{'':>6} | {'rdmamw':>10} {'tcp':>10} {'inproc':>10}  | {'rdmamw':>10} {'tcp':>10}"
          f" {'inproc':>10} |   vs tcp")
    for r in rows:
        print(f"{r['size']:>6} | {r['rdmamw_rtt_us']:>10.1f} {r['tcp_rtt_us']:>10.1f} "
              f"{r['inproc_rtt_us']:>10.1f}  | {r['rdmamw_MBps']:>10.1f} {r['tcp_MBps']:>10.1f} "
              f"{r['inproc_MBps']:>10.1f} | {r['rtt_tcp_over_rdmamw']:>6.2f}x")


if __name__ == "__main__":
    main()
