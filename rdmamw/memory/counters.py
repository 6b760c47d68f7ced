"""The memory counters ``Channel.stats()`` merges in: one function, so the engine
does not need to know how the cache and the pools count."""

from __future__ import annotations

from collections.abc import Iterable

from rdmamw.memory import pool as _pool
from rdmamw.memory.pool import BufferPool
from rdmamw.memory.regcache import RegCache


def channel_stats(cache: RegCache | Iterable[RegCache | None] | None = None,
                  pool: BufferPool | None = None) -> dict[str, int]:
    """``registrations`` / ``deregistrations`` (cache and pool together),
    ``regcache_hits`` / ``_misses`` / ``_evictions`` / ``_invalidations``,
    ``bytes_pinned`` (registered now: cached buffers plus the pool's, if it registers)
    and the pool's
    ``pool_acquires`` / ``pool_reuses`` / ``pool_overflows`` / ``pool_bytes``.

    ``pool`` defaults to the process-wide pool of received rendezvous messages (if it
    was ever used); a channel passes its own ``cache``, or its caches (verbs: one for
    sources, one for READ destinations), whose counters are summed."""
    if pool is None:
        pool = _pool._default
    caches = [cache] if isinstance(cache, RegCache) else list(cache or ())
    c: dict[str, int] = {}
    for one in caches:
        if one is not None:
            for k, v in one.stats().items():
                c[k] = c.get(k, 0) + v
    p = pool.stats() if pool is not None else {}
    return {
        "registrations": c.get("registrations", 0) + p.get("registrations", 0),
        "deregistrations": c.get("deregistrations", 0) + p.get("deregistrations", 0),
        "regcache_hits": c.get("hits", 0),
        "regcache_misses": c.get("misses", 0),
        "regcache_evictions": c.get("evictions", 0),
        "regcache_invalidations": c.get("invalidations", 0),
        "bytes_pinned": c.get("bytes_pinned", 0) + (
            p.get("bytes_pooled", 0) if pool is not None and pool.registering else 0),
        "pool_acquires": p.get("acquires", 0),
        "pool_reuses": p.get("reuses", 0),
        "pool_overflows": p.get("overflows", 0),
        "pool_bytes": p.get("bytes_pooled", 0),
    }
