"""Stub of rdmamw/providers/tcp/_transport.pyx: the TCP transport and its shared
block; rdmamw/providers/tcp/provider.py drives it. Checked by stubtest (`make lint`)."""

from typing import Any

from rdmamw.transport._base import Transport

#: bytes of one frame header on the wire
FRAME_BYTES: int
#: frame type name -> its code on the wire
FRAME_TYPES: dict[str, int]
#: bytes of one operation's descriptor in an RCHAIN frame
RDESC_BYTES: int

class TcpTransport(Transport):
    def _attach(
        self,
        sock: int,
        evfd: int,
        block_addr: int,
        block_size: int,
        my_regions: tuple[Any, ...],
        peer_regions: tuple[Any, ...],
        heartbeat: float,
        peer_timeout: float,
        host_timeout: float = 0.0,
    ) -> None: ...
    def register_local(self, addr: int, length: int) -> int: ...
    def _set_region_ids(self, mine: int, peers: int) -> None: ...
    def region_ids(self) -> tuple[int, int]: ...
    def region_refusal(self, key: int, tag: int, addr: int, length: int, write: bool) -> int: ...
    @property
    def region_chain_max(self) -> int: ...
    def close(self) -> None: ...
    def error_detail(self) -> str | None: ...
    @property
    def error(self) -> str: ...
    def counters(self) -> dict[str, Any]: ...

def alloc_block(size: int) -> int: ...
def free_block(addr: int, size: int) -> None: ...
