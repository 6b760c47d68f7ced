"""Which ranks share fast links: a group id per rank, the same list on every rank.

Sources, in the order a user reaches for them:

* ``"host"`` (default): ranks whose channels use shm share a group (same kernel and
  network namespace, from the descriptors ``rdmamw.init()`` exchanged);
* ``"hostname"``: ranks with the same ``socket.gethostname()``;
* a list of labels, one per rank (``["a", "a", "b", "b"]``), a dict rank -> label, or
  the string ``"a,a,b,b"`` (also from ``RDMAMW_COLL_TOPOLOGY``);
* ``"probe"``: measure the bandwidth of every pair of ranks and split the job where
  it drops (more than 4x between the fastest and slowest pairs)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rdmamw import config
from rdmamw.errors import ConfigError

PROBE_BYTES = 1 << 20
PROBE_REPEAT = 5
SPREAD = 4.0


def labels_to_groups(labels: list[Any]) -> list[int]:
    """Group ids numbered by first appearance, so every rank computes the same list."""
    ids: dict[Any, int] = {}
    return [ids.setdefault(lab, len(ids)) for lab in labels]


def resolve(comm: Any, spec: Any, allgather: Callable[..., np.ndarray]) -> list[int]:
    """Group id per rank from ``spec`` (labels, "host", "hostname" or "probe"; default
    RDMAMW_COLL_TOPOLOGY); ``allgather(array, comm=comm)`` is the collective a probe
    shares its measurements with (passed in: probing sits above the communicator)."""
    if spec is None:
        spec = config.get("RDMAMW_COLL_TOPOLOGY") or "host"
    n = comm.size
    if isinstance(spec, dict):
        spec = [spec[r] for r in range(n)]
    if isinstance(spec, str) and "," in spec:
        spec = spec.split(",")
    if isinstance(spec, list | tuple):
        if len(spec) != n:
            raise ConfigError(f"topology has {len(spec)} labels for {n} ranks")
        return labels_to_groups(list(spec))
    if spec in ("host", "hostname"):
        return labels_to_groups([comm.world.peers[comm.members[r]].get(spec)
                                 for r in range(n)])
    if spec == "probe":
        return groups_from_bandwidth(probe(comm, allgather))
    raise ConfigError(f"unknown topology {spec!r}: use 'host', 'hostname', 'probe' or labels")


def probe(comm: Any, allgather: Callable[..., np.ndarray],
          nbytes: int = PROBE_BYTES) -> np.ndarray:
    """Bandwidth (bytes/s) between every pair: the two send ``nbytes`` to each other
    at once, best of a few, one pair at a time (concurrent pairs would share cores
    and links and blur the picture); returns the full matrix, the same on every rank."""
    n, me = comm.size, comm.rank
    row = np.zeros(n, dtype=np.float64)
    buf = np.zeros(nbytes // 8, dtype=np.float64)
    for a in range(n):
        for b in range(a + 1, n):
            if me in (a, b):
                other = b if me == a else a
                comm.run(["probe", "float64", [a, b], "", -1, ""], [other],
                         lambda o=other: _measure(comm, o, buf, row))
            else:
                comm.run(["probe", "float64", [a, b], "", -1, ""], [], lambda: None)
    return allgather(row, comm=comm).reshape(n, n)


def _measure(comm: Any, other: int, buf: np.ndarray, row: np.ndarray) -> None:
    best = math.inf
    for _ in range(PROBE_REPEAT):
        t0 = time.perf_counter()
        comm.exchange(other, buf, other, len(buf), None, buf.dtype)
        best = min(best, time.perf_counter() - t0)
    row[other] = buf.nbytes / best


def groups_from_bandwidth(bw: np.ndarray, spread: float = SPREAD) -> list[int]:
    """Connected components of the pairs faster than the geometric middle of the
    fastest and slowest pair; one group when all pairs are within ``spread``. A pair
    counts at the better of its two ends' measurements (a preempted rank makes one
    end look slow; a slow link makes both)."""
    n = len(bw)
    if n == 1:
        return [0]
    sym = np.maximum(bw, bw.T)
    off = sym[~np.eye(n, dtype=bool)]
    hi, lo = float(off.max()), float(off.min())
    if lo > 0 and hi / lo < spread:
        return [0] * n
    cut = math.sqrt(hi * max(lo, 1.0))
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            a = parent[a]
        return a

    for a in range(n):
        for b in range(a + 1, n):
            if sym[a, b] >= cut:
                parent[find(b)] = find(a)
    return labels_to_groups([find(r) for r in range(n)])
