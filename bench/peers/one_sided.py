"""What the one-sided peers of bench/rmem_bench.py share (mooncake_peer.py,
nixl_peer.py): the owner process and its one line, the seeded bytes a read is checked
against, the timing loop. Imported by those scripts under the peers' own Python."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO

import numpy as np

OWNER = "owner"     # argv[1] of a peer script run as the owner


def seeded(n: int) -> np.ndarray:
    """The owner's buffer of ``n`` bytes (a reader checks its first read against it)."""
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)


def announce(info: dict) -> None:
    """The owner's one line: what the reader needs to reach its buffers."""
    print("OWNER " + json.dumps(info), flush=True)


def owner_info(out: IO[str], who: str) -> dict:
    """The owner's ``OWNER {json}`` line; other lines (a library's log) are skipped."""
    for line in out:
        if line.startswith("OWNER "):
            return json.loads(line[6:])
    raise RuntimeError(f"{who} owner exited before it registered its buffers")


@contextlib.contextmanager
def owner(script: str, sizes: list[int], who: str, env: dict | None = None) -> Iterator[dict]:
    """Run ``script`` as the owner of one buffer per size; its line; stopped at exit
    (its stdin closed, as it waits for that)."""
    proc = subprocess.Popen([sys.executable, script, OWNER, ",".join(map(str, sizes))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        yield owner_info(proc.stdout, who)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check_read(got: np.ndarray, who: str) -> None:
    if not np.array_equal(got, seeded(got.size)):
        raise RuntimeError(f"{who} read of {got.size} B: not the owner's bytes")


def mean_s(fn: Callable[[], None], iters: int) -> float:
    """Seconds per call of ``fn``, the mean of ``iters`` calls."""
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def iterations(cfg: dict, n: int) -> int:
    return int(cfg.get("iters") or max(8, cfg["bytes_per_rep"] // n))


def main(own: Callable[[list[int]], None], measure: Callable[[dict], dict]) -> None:
    """A peer script's entry: the owner (``OWNER SIZES``) or the reader (``CONFIG_JSON``:
    its one ``RESULT {json}`` line)."""
    if sys.argv[1] == OWNER:
        own([int(s) for s in sys.argv[2].split(",")])
    else:
        print("RESULT " + json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
