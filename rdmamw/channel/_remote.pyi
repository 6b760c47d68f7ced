"""Stub of rdmamw/channel/_remote.pyx: a channel endpoint's exposed regions and its
one-sided operations on the peer's (rdmamw/channel/remote.py drives it). Checked by
stubtest (`make lint`)."""

from typing import Any

from rdmamw.transport._base import Transport

ONE_CHECKED: int
OP_READ: int
OP_WRITE: int
OP_FETCH_ADD: int
OP_CMP_SWAP: int
OP_GATHER: int
OP_SCATTER: int

class Pieces:
    """The pieces of one array operation (Batch.gather / Batch.scatter), checked."""

    local: Any
    size: int
    count: int
    total: int
    lo: int
    hi: int
    nwr: int
    bad: int
    why: int

def pieces(local: Any, offsets: Any, lengths: Any | None, size: int,
           region_length: int) -> Pieces: ...

class Pinned:
    """A buffer held while it is exposed: the exposure keeps its memory alive, however
    the owner drops its own references."""

class RemoteOps:
    """One channel endpoint's regions and one-sided operations."""

    ops: int
    chains: int
    bytes_read: int
    bytes_written: int
    def __init__(self, tp: Transport, expose_cache: Any = None,
                 local_cache: Any = None, exact: bool = False) -> None: ...
    def expose(
        self, obj: Any, access: int, file: tuple[int, int] | None = None
    ) -> tuple[int, int, int, int, int]: ...
    def unexpose(self, key: int) -> int: ...
    def unexpose_all(self) -> int: ...
    @property
    def exposed(self) -> int: ...
    def post(self, ops: list[tuple[int, Any, int, int, int, int, int]],
             timeout: float | None = None) -> int: ...
    def one(self, write: bool, obj: Any, ref: Any, offset: int,
            timeout: float | None = None) -> int: ...
    def atomic(self, cas: bool, operands: Any, key: int, tag: int, addr: int,
               timeout: float | None = None) -> int: ...
