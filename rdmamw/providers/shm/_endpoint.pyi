"""Stub of rdmamw/providers/shm/_endpoint.pyx: the shared-memory endpoint's set-up,
its cross-process (CMA) probe and counters; rdmamw/providers/shm/provider.py drives
it. Checked by stubtest (`make lint`)."""

from typing import Any

from rdmamw.transport._base import Transport

#: bytes of one side's exposure table in the shared block
XTAB_BYTES: int

def cma_probe(pid: int, addr: int) -> int: ...

class ShmEndpoint(Transport):
    n_assist_jobs: int
    n_assist_chunks_got: int
    bytes_assist_given: int
    n_mapped_ops: int
    def _attach(
        self,
        sock: int,
        my_memfd: int,
        my_size: int,
        peer_memfd: int,
        peer_size: int,
        my_evfd: int,
        peer_evfd: int,
        my_regions: tuple[Any, ...],
        peer_regions: tuple[Any, ...],
    ) -> None: ...
    def _attach_rendezvous(
        self, my_xtab_off: int, peer_xtab_off: int, peer_pid: int, pidfd: int
    ) -> None: ...
    def _attach_staging(
        self, my_arena_fd: int, my_arena_size: int, peer_arena_fd: int, peer_arena_size: int
    ) -> None: ...
    def _set_region_id(self, ident: int) -> None: ...
    def region_ids(self) -> tuple[int, int]:
        """(this endpoint's identity, the peer's): 0 for a peer without regions."""
    def region_refusal(
        self, key: int, tag: int, addr: int, length: int, write: bool, atomic: bool = False
    ) -> int:
        """Why the peer's mirror refuses a region request (rm_region.h RM_RWHY_*: 0 it
        does not, 1 not exposed under that key and tag, 2 outside it, 3 access; an
        ``atomic``'s word unaligned: 3)."""
    def expose_shared(
        self, addr: int, length: int, access: int, fd: int, offset: int
    ) -> tuple[int, int]:
        """Expose a region (``access`` with its tag, as expose()) that lies at
        ``offset`` of the memfd ``fd`` of this process, so the peer can map it (for
        atomics, and to copy through): (0, key) or (the transport's error code, 0)."""
    @property
    def region_atomics(self) -> bool:
        """fetch_add / compare_swap on regions exposed "atomic" in shared memory: the
        peer's memfds are reachable (pidfd_getfd: a pidfd and cross-memory attach)."""
    def _set_probe(self, word: int) -> None: ...
    def _probe_address(self) -> int: ...
    def _peer_probe_word(self) -> int: ...
    def _set_cma(self, mine: bool, peers: bool) -> None: ...
    def _set_assist(self, min_bytes: int, chunk: int, stall_s: float = 10.0) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    def counters(self) -> dict[str, Any]: ...
    @property
    def cma_modes(self) -> tuple[bool, bool]:
        """(I read the peer by CMA, the peer reads me by CMA)."""
