"""The shm provider's settings, declared into the one table of rdmamw/config.py when the
provider's package is imported; ``rdmamw info --config`` lists them under [shm]."""

from __future__ import annotations

from rdmamw.config import G, K, M, declare
from rdmamw.errors import ConfigError


def _uid_list(value: str, what: str) -> frozenset[int] | None:
    if value.lower() in ("any", "*"):
        return None
    try:
        uids = frozenset(int(u) for u in value.split(",") if u.strip())
    except ValueError:
        uids = frozenset([-1])
    if any(u < 0 for u in uids):
        raise ConfigError(f"{what}: {value!r} is not a comma list of uids or 'any'")
    return uids


declare("shm", "RDMAMW_SHM_STAGING", "bytes", G,
        "size of the staging area for rendezvous when CMA is not permitted (the largest "
        "rendezvous message then; a peer takes at most 1 TiB)", minimum=1, maximum=1 << 40)
declare("shm", "RDMAMW_SHM_CMA", "bool", True,
        "use process_vm_readv/writev (CMA) for rendezvous between processes")
declare("shm", "RDMAMW_SHM_ASSIST", "bytes", M,
        "messages from this size on are copied with the peer's help")
declare("shm", "RDMAMW_SHM_ASSIST_CHUNK", "bytes", 256 * K, "piece of an assisted copy",
        minimum=1)
declare("shm", "RDMAMW_SHM_ASSIST_STALL", "seconds", 10.0,
        "seconds an assisted copy may make no progress before it fails", minimum=1e-3)
declare("shm", "RDMAMW_SHM_ALLOW_UIDS", "str", "",
        "other users' uids that may connect (comma list, or 'any'); our own always may",
        check=_uid_list)
