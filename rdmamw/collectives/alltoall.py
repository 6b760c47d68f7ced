"""alltoall: block j of every rank's array goes to rank j, even or uneven sizes.

Pairwise schedule: in step s (1..n-1) rank i sends its block for ``i + s`` and
receives the block from ``i - s``; each step is a permutation of the ranks (rings),
so the windowed exchange of comm.py cannot deadlock, and every pair's channel carries
exactly one transfer each way.

Uneven: the row counts each rank sends are traded first (one small message per
pair); when the caller also gave the counts it expects to receive, every rank checks
them against the senders' and a disagreement anywhere makes every rank raise
CollectiveMismatch (a second header round) before any data moves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rdmamw.collectives._kernels import Copier
from rdmamw.collectives.api import Plan, _input, _output, default_comm
from rdmamw.collectives.comm import CollectiveMismatch, Communicator, Steps
from rdmamw.collectives.ops import dtype_name


def pairwise(comm: Communicator, send: list[np.ndarray], recv_lens: list[int],
             out: np.ndarray, recv_offsets: list[int]) -> Steps:
    """Flat 1-d blocks: ``send[j]`` to rank j, ``recv_lens[j]`` elements from rank j
    into ``out[recv_offsets[j]:]``; our own block is copied."""
    n, i = comm.size, comm.rank
    np.copyto(out[recv_offsets[i]:recv_offsets[i] + recv_lens[i]], send[i])
    for s in range(1, n):
        to, frm = (i + s) % n, (i - s) % n
        yield from comm.exchange_steps(to, send[to], frm, recv_lens[frm],
                                       Copier(out, recv_offsets[frm]), out.dtype)


def _offsets(lens: Sequence[int]) -> list[int]:
    return [int(v) for v in np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])]


def _counts(name: str, counts: Sequence[int], n: int) -> list[int]:
    c = [int(v) for v in counts]
    if len(c) != n or any(v < 0 for v in c):
        raise ValueError(f"{name} needs {n} non-negative row counts, not {list(counts)}")
    return c


def alltoall(array: np.ndarray, send_counts: Sequence[int] | None = None,
             recv_counts: Sequence[int] | None = None, out: np.ndarray | None = None, *,
             comm: Communicator | None = None, async_op: bool = False,
             timeout: float | None = None) -> Any:
    """Even (no counts): ``array`` of shape ``(size * m, *rest)``; rows ``[j*m, (j+1)*m)``
    go to rank j, and the result (same shape) holds rank j's block for us at rows
    ``[j*m, (j+1)*m)``.

    Uneven: ``send_counts[j]`` rows (axis 0, summing to ``shape[0]``) go to rank j; the
    result holds ``recv_counts[j]`` rows from rank j, in rank order. ``recv_counts``
    may be omitted (learnt from the senders); if given and wrong, every rank raises."""
    return plan_alltoall(comm or default_comm(), array, send_counts, recv_counts,
                         out).call(async_op, timeout)


def plan_alltoall(comm: Communicator, array: np.ndarray, send_counts: Sequence[int] | None,
                  recv_counts: Sequence[int] | None, out: np.ndarray | None) -> Plan:
    a = _input(array)
    n = comm.size
    if a.ndim == 0:
        raise ValueError("alltoall needs an array of at least one dimension")
    row = int(np.prod(a.shape[1:], dtype=np.int64))
    x = np.ascontiguousarray(a).reshape(-1)
    if send_counts is None:
        if recv_counts is not None:
            raise ValueError("alltoall: recv_counts without send_counts")
        if a.shape[0] % n:
            raise ValueError(f"alltoall: {a.shape[0]} rows do not split evenly over {n} "
                             f"ranks; pass send_counts")
        res = _output(a, out, a.shape)
        m = a.shape[0] // n * row
        lens = [m] * n

        def even() -> Steps:
            yield from pairwise(comm, [x[j * m:(j + 1) * m] for j in range(n)], lens,
                                res.reshape(-1), _offsets(lens))
            return res

        return Plan(comm, ["alltoall", dtype_name(a.dtype), list(a.shape), "", -1, ""],
                    list(range(n)), even)
    sc = _counts("send_counts", send_counts, n)
    if sum(sc) != a.shape[0]:
        raise ValueError(f"send_counts sum to {sum(sc)} rows, the array has {a.shape[0]}")
    rc = None if recv_counts is None else _counts("recv_counts", recv_counts, n)
    if rc is not None:
        res0 = _output(a, out, (sum(rc), *a.shape[1:]))
    elif out is not None:
        raise ValueError("alltoall: out= needs recv_counts (its shape depends on them)")
    so = _offsets([c * row for c in sc])

    def uneven() -> Steps:
        got = yield from _trade_counts(comm, sc)
        if rc is not None:
            yield from _agree_counts(comm, rc, got)
            res = res0
        else:
            res = _output(a, None, (sum(got), *a.shape[1:]))
        lens = [c * row for c in got]
        yield from pairwise(comm, [x[so[j]:so[j + 1]] for j in range(n)], lens,
                            res.reshape(-1), _offsets(lens))
        return res

    return Plan(comm, ["alltoall", dtype_name(a.dtype), ["*", *a.shape[1:]], "", -1, "uneven"],
                list(range(n)), uneven)


def _trade_counts(comm: Communicator, sc: list[int]) -> Steps:
    """What each rank sends us (the even alltoall of one int64 per pair)."""
    n = comm.size
    got = np.empty(n, np.int64)
    yield from pairwise(comm, [np.array([c], np.int64) for c in sc], [1] * n, got,
                        list(range(n + 1)))
    return [int(v) for v in got]


def _agree_counts(comm: Communicator, rc: list[int], got: list[int]) -> Steps:
    """Every rank raises if any rank's recv_counts differ from what its senders send."""
    bad = [j for j in range(comm.size) if rc[j] != got[j]]
    verdict = (f"recv_counts {rc} but the senders send {got}" if bad else "counts agree")
    try:
        yield from comm.agree([comm.seq, "alltoall", "-", [], verdict, -1, "uneven"])
    except CollectiveMismatch as e:
        raise CollectiveMismatch(f"alltoall: row counts disagree: {e}") from None
