"""Byte counts as people read them in tables and messages (parsing is in
rdmamw/config.py, with every setting)."""

from __future__ import annotations


def human(n: float) -> str:
    """4194304 -> '4 MiB' (tables and messages)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
