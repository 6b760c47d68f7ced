"""Rendezvous configuration and destinations for a channel: the tuned thresholds and
pooled buffers of ``rdmamw.memory``, which the engine below does not import (the
channel hands it :func:`allocate` at set-up).

``resolve`` turns the ``rendezvous=`` / ``rndv_threshold=`` options of
``Channel.open`` into what the engine takes (a strategy of
``rdmamw.vocabulary.RNDV_STRATEGIES``, "off", "read" or "write", plus a threshold).
"auto" asks ``rdmamw.memory.thresholds.lookup(provider)`` (written by ``rdmamw tune``)
and otherwise uses READ above the eager limit. ``allocate`` gives a destination for a
rendezvous message that ``recv_batch`` receives without a posted buffer."""

from __future__ import annotations

import logging
from typing import Any

from rdmamw import providers as registry
from rdmamw.memory import pool, thresholds
from rdmamw.vocabulary import AUTO, READ, RNDV_STRATEGIES, check_rendezvous

DEFAULT = {"strategy": READ, "threshold": None}   # None: the peer's eager limit
log = logging.getLogger("rdmamw.channel")
_logged: set[tuple[str, str]] = set()


def tuned(provider: str) -> dict[str, Any]:
    """The measured strategy and threshold for ``provider``, or the built-in default."""
    got = dict(thresholds.lookup(provider, default=registry.provider(provider)
                                 .rendezvous_default) or {})
    source = str(got.get("source", "built-in defaults"))
    if (provider, source) not in _logged:       # once per provider and tuning file
        _logged.add((provider, source))
        log.info("rendezvous for %s: %s above %s B, from %s", provider, got.get("strategy"),
                 got.get("threshold"), source)
    thr = got.get("threshold")
    return {"strategy": got.get("strategy") or DEFAULT["strategy"],
            "threshold": thr if isinstance(thr, int) and not isinstance(thr, bool)
            and thr >= 0 else None}     # a negative threshold: "the eager limit"


def check(rendezvous: str, rndv_threshold: int | None) -> None:
    """A clear ValueError for a bad option (before any connection is made)."""
    check_rendezvous(rendezvous)
    if rndv_threshold is not None and (isinstance(rndv_threshold, bool)
                                       or not isinstance(rndv_threshold, int)
                                       or rndv_threshold < 0):
        raise ValueError(f"rndv_threshold must be an int >= 0 or None, not {rndv_threshold!r}")


def resolve(rendezvous: str, rndv_threshold: int | None, provider: str) -> tuple[str, int | None]:
    """(strategy, threshold) for the engine of a channel on ``provider``."""
    check(rendezvous, rndv_threshold)
    if rendezvous != AUTO:
        return rendezvous, rndv_threshold
    t = tuned(provider)
    strategy = t["strategy"] if t["strategy"] in RNDV_STRATEGIES else READ
    return strategy, rndv_threshold if rndv_threshold is not None else t["threshold"]


def allocate(nbytes: int) -> Any:
    """A writable buffer of ``nbytes`` for a received rendezvous message, from the
    ``rdmamw.memory`` pool; the returned Message keeps it alive."""
    return pool.allocate(nbytes)
