"""Single-thread numpy.copyto: the memory (and Python call) limit of this machine.

A shared-memory transport copies each payload at least once, so one core's copy
speed bounds its bandwidth, and the cost of one tiny copyto call is roughly the
floor for any per-message Python call. Destination offsets are varied because
4K aliasing (same offset modulo 4 KiB plus a few bytes) slows 64 KiB copies
several-fold here; the best offset is the limit, the aliased one is reported too.

Usage (started by bench/run.py): memcpy.py CONFIG_JSON
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from common import aligned, emit, load_config, pin

DST_OFFSETS = {"page_aligned": 0, "cacheline_64": 64, "half_page": 2048, "aliased_8": 8}


def copy_rate(size: int, dst_offset: int, runs: int, seconds: float) -> dict:
    """Median copies/s of np.copyto(dst, src) over `runs` time-bounded loops."""
    src, dst = aligned(size, fill=7), aligned(size, offset=dst_offset)
    copyto = np.copyto
    clock = time.perf_counter
    rates = []
    for i in range(runs + 1):
        n, t0 = 0, clock()
        deadline = t0 + seconds
        while True:
            for _ in range(256):
                copyto(dst, src)
            n += 256
            t1 = clock()
            if t1 >= deadline:
                break
        if i:  # run 0 is warm-up
            rates.append(n / (t1 - t0))
    med = statistics.median(rates)
    return {
        "copies_per_s": med,
        "gb_per_s": med * size / 1e9,
        "ns_per_copy": 1e9 / med,
        "runs": rates,
    }


def main() -> None:
    """Measure each size at each destination offset; the best offset is the limit."""
    cfg = load_config()
    pin(0)
    runs, seconds = cfg["memcpy_runs"], cfg["memcpy_seconds"]
    out: dict = {"system": "memcpy", "sizes": {}}
    for size in cfg["memcpy_sizes"]:
        by_offset = {name: copy_rate(size, off, runs, seconds) for name, off in DST_OFFSETS.items()}
        best = max(by_offset, key=lambda name: by_offset[name]["copies_per_s"])
        out["sizes"][str(size)] = {"best_offset": best, **by_offset[best], "offsets": by_offset}
    emit(out)


if __name__ == "__main__":
    main()
