"""The parameter server's messages: a small msgpack header, then (for data) one raw
payload message of at most the channel's eager limit, so big tensors go as blocks
and the receiver reads each block straight from the ring."""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Iterator

import msgpack
import numpy as np

#: header ops. worker -> server: INIT (+payload), SYNC, GRAD (+payload), CLOCK, PULL,
#: BYE (acknowledged with OK). server -> worker: OK, VAL (+payload), END (a pull is complete), ERR.
INIT, SYNC, GRAD, CLOCK, PULL, BYE = "init", "sync", "grad", "clock", "pull", "bye"
OK, VAL, END, ERR = "ok", "val", "end", "err"
WITH_PAYLOAD = (INIT, GRAD, VAL)


def pack(op: str, **fields: object) -> bytes:
    fields["op"] = op
    return msgpack.packb(fields, use_bin_type=True)


def unpack(msg: object) -> dict:
    return msgpack.unpackb(memoryview(msg), raw=False, strict_map_key=False)  # type: ignore[arg-type]


def shard(key: Hashable, nservers: int) -> int:
    """The server that owns ``key``: stable across processes (not Python's hash)."""
    return zlib.crc32(repr(key).encode()) % nservers


def blocks(flat: np.ndarray, limit: int) -> Iterator[tuple[int, np.ndarray]]:
    """(offset in elements, block) pieces of a 1-D array, each at most ``limit`` bytes."""
    step = max(1, limit // flat.itemsize)
    for o in range(0, max(flat.size, 1), step):
        yield o, flat[o:o + step]
