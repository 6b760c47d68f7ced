"""Where each region lives inside an endpoint's registered block.

Both sides compute both layouts from the parameters exchanged at connect time, so a
peer never tells us an offset we would have to trust."""

from __future__ import annotations

from dataclasses import dataclass

from rdmamw import config
from rdmamw.errors import ProtocolError

PAGE = 4096
LINE = 64
SLOT_HEADER = 64          # bytes reserved before each slot's payload
CTRL_SIZE = PAGE          # control words, one per cache line
CTRL_CREDIT_WAIT = 0      # peer (as sender) waits for our reclaim write-back
CTRL_RX_SLEEP = 64        # peer (as receiver) sleeps; wake it after publishing arrivals
CTRL_CLOSED = 128         # peer closed the channel cleanly
MAX_SLOTS = 1 << 20
MAX_SLOT_SIZE = 1 << 30
#: the largest ring (slots x stride) a peer's hello may ask us to hold for it: our
#: staging copy of its ring (and on shm our mapping of its block) has that size
MAX_PEER_RING_ENV = "RDMAMW_MAX_PEER_RING"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def slot_stride(slot_size: int) -> int:
    """Bytes from one slot to the next: header line plus payload, cache-line rounded."""
    return SLOT_HEADER + _round_up(slot_size, LINE)


def bitmap_bytes(nslots: int) -> int:
    return _round_up((nslots + 63) // 64 * 8, LINE)


def check_ring(slots: int, slot_size: int) -> None:
    if not (1 <= slots <= MAX_SLOTS):
        raise ValueError(f"slots must be in [1, {MAX_SLOTS}], got {slots}")
    if not (64 <= slot_size <= MAX_SLOT_SIZE):
        raise ValueError(f"slot_size must be in [64, {MAX_SLOT_SIZE}], got {slot_size}")


def max_peer_ring() -> int:
    """RDMAMW_MAX_PEER_RING in bytes (default 256 MiB: the default 128 x 64 KiB ring,
    the parameter server's 16 x 1 MiB and 3 x 64 MiB eager rings fit), or ConfigError."""
    return config.get(MAX_PEER_RING_ENV)


def check_peer_ring(slots: int, slot_size: int) -> None:
    """The ring a peer's hello announces is valid and fits RDMAMW_MAX_PEER_RING, else
    ProtocolError: checked before anything is allocated for it (ConfigError for a bad
    setting)."""
    cap = max_peer_ring()
    try:
        check_ring(slots, slot_size)
    except ValueError as e:
        raise ProtocolError(f"peer ring: {e}") from None
    size = slots * slot_stride(slot_size)
    if size > cap:
        raise ProtocolError(f"peer ring: {slots} slots of {slot_size} bytes need {size} "
                            f"bytes, more than {MAX_PEER_RING_ENV} = {cap} allows")


@dataclass(frozen=True)
class Layout:
    """Offsets (bytes) of the four regions in one endpoint's block."""

    ctrl: int
    arrival: int
    arrival_len: int
    reclaim: int
    reclaim_len: int
    ring: int
    ring_len: int
    total: int

    def regions(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) of each region, in RM_REGION_* order (CTRL, ARRIVAL,
        RECLAIM, RING): what a provider's transport is wired with."""
        return ((self.ctrl, CTRL_SIZE), (self.arrival, self.arrival_len),
                (self.reclaim, self.reclaim_len), (self.ring, self.ring_len))


def endpoint_layout(my_slots: int, my_slot_size: int, peer_slots: int) -> Layout:
    """The block of the endpoint that receives on a ring of ``my_slots`` and sends into
    a peer ring of ``peer_slots``. The ring starts page-aligned."""
    check_ring(my_slots, my_slot_size)
    check_ring(peer_slots, 64)
    arrival = CTRL_SIZE
    arrival_len = bitmap_bytes(my_slots)
    reclaim = arrival + arrival_len
    reclaim_len = bitmap_bytes(peer_slots)
    ring = _round_up(reclaim + reclaim_len, PAGE)
    ring_len = my_slots * slot_stride(my_slot_size)
    total = _round_up(ring + ring_len, PAGE)
    return Layout(0, arrival, arrival_len, reclaim, reclaim_len, ring, ring_len, total)
