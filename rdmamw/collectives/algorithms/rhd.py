"""Recursive halving-doubling (Rabenseifner, rdmamw/collectives/rhd.py): 2 log2(p)
steps moving the ring's bytes, with the MPICH fix-up when n is not a power of two."""

from __future__ import annotations

from rdmamw.collectives import rhd
from rdmamw.collectives.algorithms import Algorithm
from rdmamw.collectives.policy import Model, step


def cost(nbytes: float, groups: list[int], model: Model) -> float:
    n = len(groups)
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    t = 0.0
    if rem:
        t += step(model, groups, [(2 * k, 2 * k + 1, nbytes) for k in range(rem)], nbytes)
        t += step(model, groups, [(2 * k + 1, 2 * k, nbytes) for k in range(rem)])

    def real(nr: int) -> int:
        return nr * 2 + 1 if nr < rem else nr + rem

    mask = p >> 1
    while mask:
        size = nbytes * mask / p
        sends = [(real(r), real(r ^ mask), size) for r in range(p)]
        t += step(model, groups, sends, size) + step(model, groups, sends)
        mask >>= 1
    return t


ALGORITHM = Algorithm(
    "rhd", cost,
    peers=lambda comm, members, groups: rhd.peers(comm, members),
    run=lambda comm, x, res, op, members, groups: rhd.allreduce(comm, x, res, op, members),
    tie=0)
