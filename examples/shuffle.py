"""Data shuffle: every rank sends each of its samples to the rank that owns it next
epoch (an all-to-all exchange of variable-sized parts), as a data loader does
between epochs.

    python -m rdmamw.bootstrap.launch -n 4 -- python examples/shuffle.py --rows 200000
    mpirun -n 4 python examples/shuffle.py          # or torchrun, srun

The counts go first (one allgather), then n - 1 pairwise steps: in step s, rank r
sends its part for rank r + s while receiving rank r - s's part, pipelined in
chunks of the eager limit with a bounded window (Communicator.exchange), so no ring
ever fills and nothing deadlocks. Each rank checks that it received exactly the
samples destined to it (every row carries its source, index and destination) and
prints one JSON line."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import rdmamw
import rdmamw.collectives as coll

ID_COLS = 3          # source rank, row index, destination rank


def make_rows(rank: int, size: int, rows: int, features: int, epoch: int) -> np.ndarray:
    """This rank's samples; the destination of each is a seeded function of
    (epoch, source, index), so any rank can recompute where a row should go."""
    data = np.random.default_rng(rank).standard_normal((rows, ID_COLS + features))
    data = data.astype(np.float32)
    data[:, 0], data[:, 1] = rank, np.arange(rows)
    data[:, 2] = np.random.default_rng([epoch, rank]).integers(0, size, rows)
    return data


def shuffle(data: np.ndarray, comm: coll.Communicator) -> np.ndarray:
    """All-to-all: return the rows of every rank whose destination is this rank."""
    n, r, cols = comm.size, comm.rank, data.shape[1]
    dest = data[:, 2].astype(np.int64)
    order = np.argsort(dest, kind="stable")
    counts = np.bincount(dest, minlength=n).astype(np.int64)
    parts = np.split(data[order], np.cumsum(counts)[:-1])
    incoming = coll.allgather(counts, comm=comm)[:, r]           # rows each rank sends me
    out = np.empty((int(incoming.sum()), cols), data.dtype)
    starts = np.concatenate([[0], np.cumsum(incoming)[:-1]])
    out[starts[r]:starts[r] + incoming[r]] = parts[r]
    flat = out.reshape(-1)
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        base = int(starts[frm]) * cols

        def into(start: int, stop: int, view: np.ndarray, base: int = base) -> None:
            flat[base + start:base + stop] = view

        src = np.ascontiguousarray(parts[to]).reshape(-1)
        header = ["alltoall", data.dtype.str, [cols], "", s, ""]       # same on every rank
        comm.run(header, [to, frm], lambda src=src, to=to, frm=frm, into=into: comm.exchange(
            to, src, frm, int(incoming[frm]) * cols, into, data.dtype))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100000, help="samples per rank")
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--epoch", type=int, default=1, help="seeds the destinations")
    a = ap.parse_args()
    w = rdmamw.init()
    comm = coll.Communicator()
    data = make_rows(w.rank, w.world_size, a.rows, a.features, a.epoch)
    total_in = coll.allreduce(np.array([data[:, ID_COLS:].sum(dtype=np.float64)]), comm=comm)
    coll.barrier(comm=comm)
    t0 = time.perf_counter()
    got = shuffle(data, comm)
    dt = time.perf_counter() - t0
    # what arrived: only rows meant for me, each once, and everything somewhere
    ok = bool((got[:, 2] == w.rank).all())
    keys = got[:, 0].astype(np.int64) * a.rows + got[:, 1].astype(np.int64)
    ok &= len(np.unique(keys)) == len(keys)
    expect = sum(int((make_rows(src, w.world_size, a.rows, 0, a.epoch)[:, 2] == w.rank).sum())
                 for src in range(w.world_size))
    ok &= len(got) == expect
    total_out = coll.allreduce(np.array([got[:, ID_COLS:].sum(dtype=np.float64)]), comm=comm)
    ok &= bool(np.isclose(total_in[0], total_out[0], rtol=1e-9))
    line = json.dumps({"rank": w.rank, "rows_in": len(got), "ok": ok, "seconds": dt,
                       "mb_per_s": data.nbytes * (w.world_size - 1) / w.world_size / dt / 1e6})
    sys.stdout.write(line + "\n")             # one write: the ranks share the pipe
    sys.stdout.flush()
    comm.close()


if __name__ == "__main__":
    main()
