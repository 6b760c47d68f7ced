"""A rank's health answer (``/health`` next to ``/metrics``, docs/metrics.md): who it
is, its channels by peer (open, or the peer lost), and which peers it waits on now and
for how long: a receive or send sleeping on the channel (its engine's wait flags,
``diagnostics()["waiting"]``) or a collective's step waiting past its first slice
(rdmamw.observe.waits). Plain Python, read when asked: nothing is kept for it."""

from __future__ import annotations

import os
import time
from typing import Any

from rdmamw import observe
from rdmamw.errors import RdmamwError
from rdmamw.metrics.readings import rank


def world_size() -> int | None:
    from rdmamw import bootstrap
    try:
        return int(bootstrap.world().world_size)
    except RdmamwError:
        return None


def health() -> dict[str, Any]:
    """``{"rank", "pid", "host", "world_size", "state": "up", "peers": [{"peer",
    "provider", "channels", "lost", "waiting": {"arrival"|"credit"|"collective":
    seconds}}], "waits_on": [peer, ...]}`` (``waits_on``: the peers waited on, the
    longest wait first)."""
    peers: dict[tuple[str, str], dict[str, Any]] = {}

    def entry(key: tuple[str, str]) -> dict[str, Any]:
        return peers.setdefault(key, {"peer": key[1], "provider": key[0], "channels": 0,
                                      "lost": False, "waiting": {}})

    for key, ch in observe.channels():
        p = entry(key)
        p["channels"] += 1
        try:
            lost = ch.peer_gone
            waiting = ch.diagnostics().get("waiting", {})
        except Exception:   # noqa: BLE001 - closed meanwhile: not open any more
            p["channels"] -= 1
            continue
        p["lost"] = p["lost"] or lost
        for what, s in waiting.items():
            p["waiting"][what] = max(p["waiting"].get(what, 0.0), s)
    now = time.monotonic()
    for peer, since in list(observe.waits.values()):
        keys = [k for k in peers if k[1] == str(peer)] or [("?", str(peer))]
        for k in keys:
            w = entry(k)["waiting"]
            w["collective"] = max(w.get("collective", 0.0), now - since)
    rows = [p for _, p in sorted(peers.items(), key=lambda kv: _order(kv[0][1]))]
    longest = sorted((p for p in rows if p["waiting"]),
                     key=lambda p: -max(p["waiting"].values()))
    return {"rank": rank(), "pid": os.getpid(), "host": os.uname().nodename,
            "world_size": world_size(), "state": "up", "peers": rows,
            "waits_on": list(dict.fromkeys(p["peer"] for p in longest))}


def _order(peer: str) -> tuple[int, str]:
    return (int(peer), "") if peer.isdigit() else (1 << 62, peer)
