"""The verbs provider's settings, declared into the one table of rdmamw/config.py when
the provider's package is imported; ``rdmamw info --config`` lists them under [verbs].
A ``verbs://`` address's options override some of them (address.py)."""

from __future__ import annotations

from rdmamw.config import declare

declare("verbs", "RDMAMW_VERBS_LIBRARY", "str", "libibverbs.so.1",
        "the libibverbs to dlopen: a name or a path")
declare("verbs", "RDMAMW_VERBS_FABRIC", "str", "",
        "declare this rank's fabric (net:NAME) instead of deriving it from its GID")
declare("verbs", "RDMAMW_VERBS_DEVICE", "str", "", "RDMA device name (default: the first usable)")
declare("verbs", "RDMAMW_VERBS_PORT", "int", 0, "device port (0: the first active)", maximum=255)
declare("verbs", "RDMAMW_VERBS_GID_INDEX", "int", -1, "GID index (-1: chosen by link layer)",
        minimum=-1, maximum=(1 << 16) - 1)
declare("verbs", "RDMAMW_VERBS_SQ_DEPTH", "int", 256, "send queue depth of a channel's QP",
        minimum=1, maximum=1 << 16)
declare("verbs", "RDMAMW_VERBS_RQ_DEPTH", "int", 0, "receive queue depth (0: from the ring)",
        maximum=1 << 16)
declare("verbs", "RDMAMW_VERBS_INLINE", "int", 256, "bytes sent inline in a work request",
        maximum=4096)
declare("verbs", "RDMAMW_VERBS_EVENT", "int", 1,
        "1: a sleeper is woken by completion events (the peer's WRITE_WITH_IMM); 0: it also "
        "re-checks every RDMAMW_VERBS_POLL_MS", maximum=1)
declare("verbs", "RDMAMW_VERBS_PINNED_BYTES", "bytes", 0,
        "registered (pinned) bytes the process's verbs channels may hold; 0: half the memory, "
        "at most `ulimit -l`", maximum=1 << 50)
declare("verbs", "RDMAMW_VERBS_RING_START", "bytes", 64 << 10,
        "bytes of a channel's receive ring registered at connect (at least one slot); when "
        "the peer runs short the device thread registers what it asks for in one grant (its "
        "send, or the whole ring when it sends faster than we read). 0: the whole ring at "
        "once", maximum=1 << 40)
declare("verbs", "RDMAMW_VERBS_WINDOWS", "int", 1,
        "1: the keys a peer gets are type-2 memory windows bound to its channel's queue pair, "
        "where the device has them; 0: keys of MRs with remote access", maximum=1)
declare("verbs", "RDMAMW_VERBS_POLL_MS", "int", 1, "re-check interval of a sleeper without events",
        maximum=60000)
declare("verbs", "RDMAMW_VERBS_READ_CHUNK", "bytes", None,
        "longest RDMA READ one work request asks for; a longer one goes as several (0: no "
        "limit; default: 512 KiB on soft-RoCE devices, whose READ retry can stall, else no "
        "limit)", maximum=1 << 31)
declare("verbs", "RDMAMW_VERBS_TIMEOUT", "int", 14,
        "QP local ACK timeout exponent (4.096 us x 2^n)", maximum=31)
