"""``rdmamw tune rndv``: measure eager vs rendezvous READ vs WRITE and store the threshold.

    rdmamw tune rndv                          # shm, two local processes, 4 KiB .. 64 MiB
    rdmamw tune rndv --provider tcp           # over loopback tcp
    rdmamw tune rndv --sizes 64K,1M,16M --out my.json --no-save

One receiver process and this one (the sender), each pinned to its own core, stream
messages of each size for every strategy; the receiver lands them in its own
preallocated buffer (``recv_into`` for eager and read, ``post_recv`` destinations for
write), which is what a training job does with gradients. The table gives the median
bandwidth per strategy; the **crossover** is the smallest size from which the best
rendezvous strategy is at least as fast as eager at every larger size. The provider's
``{"strategy", "threshold"}`` goes into the tuning file (rdmamw/memory/thresholds.py:
``$RDMAMW_TUNE_FILE`` or ``~/.config/rdmamw/rendezvous.json``), which ``Channel.open(...,
rendezvous="auto")`` reads. Eager is measured up to ``--eager-max`` (a ring with
slots that big, one channel per size); above the peer's slot size a channel always
uses rendezvous."""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from collections import deque
from typing import Any

import numpy as np

from rdmamw.config import parse_bytes
from rdmamw.memory import thresholds
from rdmamw.memory.pool import aligned_empty
from rdmamw.memory.units import human
from rdmamw.providers import best, local_address, schemes
from rdmamw.vocabulary import OFF, RNDV_TRANSFERS, WRITE

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
#: what is measured: eager copies (rendezvous off) and each rendezvous transfer
EAGER = "eager"
STRATEGIES = (EAGER, *RNDV_TRANSFERS)
POSTED_BYTES = 128 * MiB     # the write receiver posts up to this much ahead...
POSTED_MAX = 4               # ...in at most this many destinations (and at least 2):
                             # quad buffering. More posted buffers make more messages
                             # WRITEs, but each one lands in colder memory (32 x 4 MiB
                             # halved the 4 MiB figure); the rest go as READs.


def schedule(sizes: list[int], bytes_per_run: int, runs: int,
             min_messages: int = 2) -> list[tuple[int, int, int]]:
    """``(size, messages per run, runs)`` for each size: every run moves about
    ``bytes_per_run``, and at least ``min_messages`` (the bench asks for 8, so a run
    of large messages measures the stream, not the two control messages around it)."""
    return [(s, max(min_messages, bytes_per_run // s), runs) for s in sizes]


def _pattern(size: int) -> np.ndarray:
    """Bytes 0, 1, ..., 255, 0, 1, ... (any prefix is the pattern of a smaller size),
    built without a temporary as large as the buffer (the RSS is measured)."""
    buf = aligned_empty(size)
    whole = size - size % 256
    buf[:whole].reshape(-1, 256)[:] = np.arange(256, dtype=np.uint8)
    buf[whole:] = np.arange(size - whole, dtype=np.uint8)
    return buf


def rss_now() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    """Peak resident bytes of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _slot_size(strategy: str, sizes: list[int]) -> int:
    if strategy != EAGER:
        return 64 * KiB
    return max(64 * KiB, -(-max(sizes) // 4096) * 4096)


def _channel_options(strategy: str, sizes: list[int]) -> dict[str, Any]:
    """Eager: rendezvous off. Otherwise every measured size goes by rendezvous (the
    one-byte control messages stay eager)."""
    if strategy == EAGER:
        return {"rendezvous": OFF}
    return {"rendezvous": strategy, "rndv_threshold": max(0, min(sizes) - 1)}


def posted(size: int, count: int) -> int:
    """Destinations the write receiver keeps posted for messages of ``size``."""
    return min(count, max(2, min(POSTED_MAX, POSTED_BYTES // size)))


def _pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})


def _receiver(address: str, strategy: str, plan: list[tuple[int, int, int]], core: int | None,
              ready: Any, out: Any) -> None:
    """Receive every run of ``plan`` into preallocated buffers, answer each run with
    one small message (it stops the sender's clock), then check the content of the
    run's last message."""
    import rdmamw
    _pin(core)
    sizes = [s for s, _, _ in plan]
    slot_size = _slot_size(strategy, sizes)
    slots = max(2, min(64, (64 * MiB) // slot_size))
    pattern = _pattern(max(sizes))
    arena = aligned_empty(max(posted(n, c) * n if strategy == WRITE else n
                              for n, c, _ in plan))
    arena.fill(0)                                           # touched: resident before rss0
    rss0 = rss_now()
    try:
        with rdmamw.listen(address, slots=slots, slot_size=slot_size,
                           **_channel_options(strategy, sizes)) as lst:
            ready.put(lst.address)
            ch = lst.accept(timeout=60)
            bad = []
            for size, count, runs in plan:
                want = pattern[:size]
                for _ in range(runs + 1):                   # run 0 warms up
                    if strategy == WRITE:
                        views = [arena[i * size:(i + 1) * size]
                                 for i in range(posted(size, count))]
                        for v in views:
                            ch.post_recv(v)
                        ch.send_batch([b"g"]).wait()        # go: destinations posted
                        dst = _recv_posted(ch, views, count)
                    else:
                        dst = arena[:size]
                        dst[:1] = ~want[:1]
                        ch.send_batch([b"g"]).wait()
                        for _ in range(count):
                            n = ch.recv_into(dst)
                            if n != size:
                                bad.append(f"{size}: received {n} bytes")
                    ch.send_batch([b"k"]).wait()            # the sender's clock stops
                    if not _same(dst, want):                # checked outside the timing
                        bad.append(f"{size}: content differs")
            out.put({"stats": ch.stats(), "bad": bad,
                     "rss": {"before": rss0, "peak": rss_peak()}})
            ch.recv_batch(timeout=30)                      # the sender's close
    except rdmamw.ChannelClosed:
        pass
    except BaseException as e:   # noqa: BLE001 - reported to the parent
        out.put({"error": f"{type(e).__name__}: {e}"})


def _recv_posted(ch: Any, views: list[np.ndarray], count: int) -> np.ndarray:
    """Receive ``count`` messages into the posted ``views`` (reposting each one when
    its message was consumed); the view that holds the last one."""
    for i in range(count):
        m = ch.recv()
        del m
        if i + len(views) < count:
            ch.post_recv(views[i % len(views)])
    return views[(count - 1) % len(views)]


def _same(a: np.ndarray, b: np.ndarray, chunk: int = 1 * MiB) -> bool:
    """``array_equal`` in slices, so checking 64 MiB does not add 64 MiB to the RSS."""
    return len(a) == len(b) and all(np.array_equal(a[i:i + chunk], b[i:i + chunk])
                                    for i in range(0, len(a), chunk))


def measure(strategy: str, plan: list[tuple[int, int, int]], provider: str | None = None,
            cores: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    """Stream ``plan`` with ``strategy`` to a receiver process; returns
    ``{"gbps": {size: median GB/s}, "runs": {size: [GB/s...]}, "sender": stats,
    "receiver": stats, "rss": {side: {"before", "peak"}}}`` (``before``: resident bytes
    with the buffers allocated, before the channel opened). Raises RuntimeError if the
    receiver saw wrong bytes."""
    import rdmamw
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    where = local_address(provider or best().scheme, f"rdmamw-tune-{os.getpid()}-{strategy}")
    proc = ctx.Process(target=_receiver, args=(where, strategy, plan, cores[1], ready, out))
    proc.start()
    mask = os.sched_getaffinity(0)
    try:
        address = ready.get(timeout=60)
        _pin(cores[0])
        pattern = _pattern(max(s for s, _, _ in plan))
        rss0 = rss_now()
        ch = rdmamw.Channel.open(address, timeout=60, slots=16, slot_size=4096,
                                 **_channel_options(strategy, [n for n, _, _ in plan]))
        result: dict[str, Any] = {"gbps": {}, "runs": {}}
        for size, count, runs in plan:
            src = pattern[:size]
            batch = max(1, min(64, (4 * MiB) // size))
            rates = []
            for r in range(runs + 1):
                handles: deque = deque()
                ch.recv(timeout=120)                       # go
                t0 = time.perf_counter()
                left = count
                while left:
                    k = min(batch, left)
                    handles.append(ch.send_batch([src] * k))
                    left -= k
                    if len(handles) > 8:
                        handles.popleft().wait()
                for h in handles:
                    h.wait()
                ch.recv(timeout=120)                       # the receiver has it all
                dt = time.perf_counter() - t0
                if r:
                    rates.append(count * size / dt / 1e9)
            result["gbps"][size] = statistics.median(rates)
            result["runs"][size] = rates
        result["sender"] = ch.stats()
        result["rss"] = {"sender": {"before": rss0, "peak": rss_peak()}}
        rep = out.get(timeout=120)
        ch.close()
    finally:
        os.sched_setaffinity(0, mask)       # later children must not inherit one core
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if "error" in rep:
        raise RuntimeError(f"{strategy} receiver: {rep['error']}")
    if rep["bad"]:
        raise RuntimeError(f"{strategy}: wrong data received: {rep['bad'][:3]}")
    result["receiver"] = rep["stats"]
    result["rss"]["receiver"] = rep["rss"]
    return result


def measure_all(strategy: str, plan: list[tuple[int, int, int]], provider: str | None = None,
                cores: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    """:func:`measure`, with eager in one channel per size: its ring is then shaped for
    the size (64 slots of 64 KiB for the small ones, as a default channel has, fewer
    and larger slots above), not for the largest message. Counters are summed."""
    if strategy != EAGER or len(plan) == 1:
        return measure(strategy, plan, provider, cores)
    parts = [measure(strategy, [p], provider, cores) for p in plan]
    out = dict(parts[-1])
    out["gbps"] = {k: v for r in parts for k, v in r["gbps"].items()}
    out["runs"] = {k: v for r in parts for k, v in r["runs"].items()}
    for side in ("sender", "receiver"):
        out[side] = {k: sum(r[side].get(k, 0) for r in parts)
                     for k, v in parts[-1][side].items() if isinstance(v, int)}
    return out


def choose(table: dict[str, dict[int, float]]) -> dict[str, Any]:
    """The rendezvous strategy and threshold from measured bandwidths
    ``{strategy: {size: GB/s}}`` (``"eager"`` plus any of ``"read"``, ``"write"``).

    strategy: the rendezvous strategy with the higher geometric-mean bandwidth over
    the sizes both measured, largest half of them (where rendezvous matters);
    crossover: the smallest size from which that strategy is at least as fast as
    eager at every larger size eager was measured at (None: eager always won);
    threshold: the largest measured size eager won at below the crossover (messages up
    to it stay eager), or the smallest measured size if rendezvous always won (nothing
    below what was measured is extrapolated)."""
    rndv = [s for s in RNDV_TRANSFERS if table.get(s)]
    if not rndv:
        raise ValueError("no rendezvous strategy was measured")
    common = sorted(set.intersection(*(set(table[s]) for s in rndv)))
    top = common[len(common) // 2:] or common

    def score(s: str) -> float:
        return sum(math.log(max(table[s][n], 1e-12)) for n in top) / len(top)

    strategy = max(rndv, key=score)
    best = table[strategy]
    eager = table.get(EAGER, {})
    sizes = sorted(best)
    if not eager:
        return {"strategy": strategy, "threshold": sizes[0], "crossover": sizes[0]}
    crossover = None
    for i, n in enumerate(sizes):
        if all(best[m] >= eager[m] for m in sizes[i:] if m in eager):
            crossover = n
            break
    if crossover is None:
        threshold = max(eager)
    else:
        below = [m for m in sizes if m < crossover and m in eager]
        threshold = max(below) if below else sizes[0]
    return {"strategy": strategy, "threshold": threshold, "crossover": crossover}


def format_table(table: dict[str, dict[int, float]], choice: dict[str, Any]) -> str:
    sizes = sorted(set().union(*(set(v) for v in table.values())))
    names = [s for s in STRATEGIES if s in table]
    lines = [f"{'size':>9} " + " ".join(f"{n + ' GB/s':>11}" for n in names) + "   fastest"]
    for n in sizes:
        cells = {s: table[s].get(n) for s in names}
        ok = {s: v for s, v in cells.items() if v is not None}
        lines.append(f"{human(n):>9} " + " ".join(
            f"{cells[s]:>11.2f}" if cells[s] is not None else f"{'-':>11}" for s in names)
            + f"   {max(ok, key=ok.get)}")
    cross = human(choice["crossover"]) if choice["crossover"] is not None else "none (eager won)"
    lines.append(f"crossover: {cross}; chosen: strategy {choice['strategy']!r}, "
                 f"eager up to {human(choice['threshold'])}")
    return "\n".join(lines)


def counter_lines(stats: dict[str, dict]) -> list[str]:
    """What each strategy really did, from the sender's counters: with ``write`` a
    message is written by the sender only if the receiver had posted a destination in
    time, else the receiver reads it."""
    out = []
    for s, st in stats.items():
        if s == EAGER:
            out.append(f"eager: {st.get('rndv_sends', 0)} rendezvous sends (expected 0)")
            continue
        sends, writes = st.get("rndv_sends", 0), st.get("rndv_writes", 0)
        share = f" ({writes / sends:.0%})" if sends else ""
        out.append(f"{s}: {sends} rendezvous sends, {writes} written by the sender{share}, "
                   f"{sends - writes} read by the receiver")
    return out


def run(sizes: list[int], provider: str, bytes_per_run: int, runs: int, eager_max: int,
        strategies: tuple[str, ...] = STRATEGIES, progress: bool = True) -> dict[str, Any]:
    """Measure every strategy; returns ``{"table", "choice", "stats"}``."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = (allowed[0], allowed[1]) if len(allowed) > 1 else (None, None)
    table: dict[str, dict[int, float]] = {}
    stats: dict[str, Any] = {}
    for strategy in strategies:
        ss = [s for s in sizes if strategy != EAGER or s <= eager_max]
        if not ss:
            continue
        if progress:
            print(f"  measuring {strategy:5s} {human(ss[0])} .. {human(ss[-1])}",
                  file=sys.stderr, flush=True)
        res = measure_all(strategy, schedule(ss, bytes_per_run, runs), provider, cores)
        table[strategy] = res["gbps"]
        stats[strategy] = {k: v for k, v in res["sender"].items() if k.startswith("rndv")}
    return {"table": table, "choice": choose(table), "stats": stats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rdmamw tune rndv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", default=None, choices=schemes(),
                    help="transport to measure (default: the best usable one between two "
                         "local processes, shm)")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="comma-separated message sizes (64K, 4M, ... accepted)")
    ap.add_argument("--eager-max", default="16M",
                    help="largest eager size measured (the ring's slot size; default 16M)")
    ap.add_argument("--bytes-per-run", default="256M", help="data per timed run (default 256M)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per size (median)")
    ap.add_argument("--out", default=None,
                    help=f"tuning file (default ${thresholds.FILE_ENV} or "
                         "~/.config/rdmamw/rendezvous.json)")
    ap.add_argument("--no-save", action="store_true", help="print only")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    a.provider = a.provider or best().scheme
    sizes = sorted(parse_bytes(s, "--sizes") for s in a.sizes.split(",") if s.strip())
    if not sizes or min(sizes) <= 0:
        ap.error("--sizes needs positive sizes")
    load = os.getloadavg()
    print(f"rdmamw tune rndv: provider {a.provider}, {len(sizes)} sizes, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    res = run(sizes, a.provider, parse_bytes(a.bytes_per_run, "--bytes-per-run"), a.runs,
              parse_bytes(a.eager_max, "--eager-max"), progress=not a.quiet)
    print(format_table(res["table"], res["choice"]))
    for line in counter_lines(res["stats"]):
        print("  " + line)
    if not a.no_save:
        c = res["choice"]
        measured = {s: {str(k): round(v, 3) for k, v in t.items()}
                    for s, t in res["table"].items()}
        path = thresholds.save(a.provider, c["strategy"], c["threshold"],
                               {"gbps": measured, "crossover": c["crossover"],
                                "load_average": load[0]}, a.out)
        print(f"written: {path}  (override: {thresholds.STRATEGY_ENV}, "
              f"{thresholds.THRESHOLD_ENV}, or Channel.open(rendezvous=..., rndv_threshold=...))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
