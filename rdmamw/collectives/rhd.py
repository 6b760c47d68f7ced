"""Recursive halving-doubling allreduce (Rabenseifner): reduce-scatter by recursive
halving, allgather by recursive doubling. 2 log2(p) steps moving the same bytes as
the ring, so it wins when latency matters (small and mid sizes, many ranks).

For n not a power of two (p = largest power of two <= n, r = n - p), the MPICH
fix-up: each of the first r even ranks hands its whole vector to the odd rank above
it and sits out; the p remaining ranks run the power-of-two algorithm; the odd ranks
then hand the result back."""

from __future__ import annotations

import numpy as np

from rdmamw.collectives._kernels import Copier, bounds, reducer
from rdmamw.collectives.comm import Communicator, Steps


def _shape(n: int) -> tuple[int, int]:
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def _newrank(i: int, rem: int) -> int:
    if i < 2 * rem:
        return i // 2 if i % 2 else -1
    return i - rem


def _real(nr: int, rem: int) -> int:
    return nr * 2 + 1 if nr < rem else nr + rem


def peers(comm: Communicator, members: list[int]) -> list[int]:
    n, i = len(members), members.index(comm.rank)
    p, rem = _shape(n)
    out = []
    if i < 2 * rem:
        out.append(members[i ^ 1])
    nr = _newrank(i, rem)
    if nr >= 0:
        mask = 1
        while mask < p:
            out.append(members[_real(nr ^ mask, rem)])
            mask <<= 1
    return out


def allreduce(comm: Communicator, x: np.ndarray, res: np.ndarray, op: np.ufunc,
              members: list[int]) -> Steps:
    n, i, N, dt = len(members), members.index(comm.rank), len(x), x.dtype
    p, rem = _shape(n)
    src = x
    if i < 2 * rem:                                   # fix-up in
        if i % 2 == 0:
            yield from comm.exchange_steps(members[i + 1], x, None, 0, None, dt)
        else:
            yield from comm.exchange_steps(None, None, members[i - 1], N,
                                           reducer(op, x, res, 0), dt)
            src = res
    nr = _newrank(i, rem)
    if nr >= 0:
        b = bounds(N, p)
        lo, hi, mask = 0, p, p >> 1
        while mask:                                   # recursive halving
            partner = members[_real(nr ^ mask, rem)]
            mid = lo + mask
            keep, give = ((mid, hi), (lo, mid)) if nr & mask else ((lo, mid), (mid, hi))
            ks, ke = b[keep[0]], b[keep[1]]
            yield from comm.exchange_steps(partner, src[b[give[0]]:b[give[1]]], partner,
                                           ke - ks, reducer(op, src, res, ks), dt)
            src = res
            lo, hi = keep
            mask >>= 1
        if src is not res:                            # p == 1: nothing was reduced
            np.copyto(res, src)
        mask = 1
        while mask < p:                               # recursive doubling
            partner = members[_real(nr ^ mask, rem)]
            other = (lo - mask, lo) if nr & mask else (hi, hi + mask)
            yield from comm.exchange_steps(partner, res[b[lo]:b[hi]], partner,
                                           b[other[1]] - b[other[0]],
                                           Copier(res, b[other[0]]), dt)
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1
    if i < 2 * rem:                                   # fix-up out
        if i % 2:
            yield from comm.exchange_steps(members[i - 1], res, None, 0, None, dt)
        else:
            yield from comm.exchange_steps(None, None, members[i + 1], N, Copier(res, 0), dt)
