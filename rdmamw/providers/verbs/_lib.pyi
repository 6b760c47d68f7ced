"""Stub of rdmamw/providers/verbs/_lib.pyx: libibverbs, dlopen()ed on first use.
Checked by stubtest (`make lint`)."""

from typing import Any

def load() -> str:
    """dlopen libibverbs; the path of the library loaded (OSError if it is missing)."""

def fork_safety() -> str:
    """rdma-core's fork rule: "disabled", "enabled" or "unneeded"."""

def probe(max_gids: int = 32) -> list[dict[str, Any]]:
    """Devices, ports and non-zero GIDs as libibverbs reports them (no pyverbs)."""
