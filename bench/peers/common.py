"""Helpers shared by every peer process.

Kept in one place so that all systems are pinned, timed, summarised and reported
the same way; only the transport loops differ between the peer modules.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys

import numpy as np

STOP = b"\x01"  # 1-byte sentinel: never a measured size, so one len() check suffices
PAGE = 4096


def pin(index: int) -> int:
    """Pin this process to one core so the two peers never share (or migrate) a core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def load_config(argv: list[str] | None = None) -> dict:
    """Read the JSON config the orchestrator passes as the last argument."""
    argv = sys.argv if argv is None else argv
    return json.loads(argv[-1])


def emit(result: dict) -> None:
    """Print the result as one JSON line; the orchestrator parses the last such line."""
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def aligned(nbytes: int, offset: int = 0, fill: int = 0) -> np.ndarray:
    """Page-aligned uint8 buffer (plus `offset`), so copies avoid accidental 4K aliasing."""
    raw = np.empty(nbytes + 2 * PAGE + offset, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE + offset
    buf = raw[start : start + nbytes]
    buf.fill(fill)
    return buf


def latency_summary(stamps_ns: list[int], warmup_ns: int) -> dict:
    """One-way latency from consecutive round-trip end stamps (one-way = RTT / 2).

    Round trips that ended within `warmup_ns` of the start (at least 100, at most a
    tenth of all) are warm-up and dropped: caches, page faults and lazy connects.
    """
    stamps = np.asarray(stamps_ns, dtype=np.int64)
    skip = int(np.searchsorted(stamps, stamps[0] + warmup_ns))
    skip = max(skip, min(100, stamps.size // 10))
    rtt = np.diff(stamps)[skip:]
    if rtt.size == 0:
        return {"n": 0}
    one_way_us = rtt / 2e3
    return {
        "n": int(rtt.size),
        "median_us": float(np.median(one_way_us)),
        "p99_us": float(np.percentile(one_way_us, 99)),
        "min_us": float(one_way_us.min()),
        "mean_us": float(one_way_us.mean()),
    }


def rate_summary(runs: list[dict], size: int) -> dict:
    """Median over runs of msgs/s (and GB/s for the given message size)."""
    rates = [r["messages"] / r["seconds"] for r in runs]
    med = statistics.median(rates)
    return {
        "runs": runs,
        "msgs_per_s": med,
        "gb_per_s": med * size / 1e9,
        "spread": (max(rates) - min(rates)) / med if med else None,
    }


def cpu_seconds() -> float:
    """User + system CPU of this process (all threads), for the idle-receiver check.

    getrusage has microsecond resolution; os.times() only counts 10 ms ticks.
    """
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_phases(cfg: dict, ping_pong, stream) -> dict:
    """The latency, rate and bandwidth phases every system runs, in the same order.

    ``ping_pong(size)`` returns a latency summary; ``stream(size, k, runs, seconds)`` a
    rate summary. Only the transport-specific loops live in the peer modules."""
    out: dict = {}
    phases = cfg["phases"]
    if "lat" in phases:
        out["latency"] = {str(s): ping_pong(s) for s in cfg["lat_sizes"]}
    if "rate" in phases:
        out["rate"] = {
            str(k): stream(cfg["rate_size"], k, cfg["rate_runs"], cfg["rate_seconds"])
            for k in cfg["rate_batches"]
        }
    if "bw" in phases:
        out["bw"] = stream(cfg["bw_size"], cfg["bw_batch"], cfg["bw_runs"], cfg["bw_seconds"])
    if "bw_sizes" in phases:        # large messages (bench/rendezvous_bench.py)
        out["bw_sizes"] = {
            str(s): stream(s, max(1, min(cfg["bw_batch"], cfg["bw_batch_bytes"] // s)),
                           cfg["bw_runs"], cfg["bw_seconds"])
            for s in cfg["bw_sizes"]
        }
    return out
