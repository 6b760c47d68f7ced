"""Numbers from ``RDMAMW_*`` environment variables: a bad value is a ConfigError that
names the variable (sizes with units: :func:`rdmamw.memory.units.parse_bytes`)."""

from __future__ import annotations

import os

from rdmamw.errors import ConfigError


def number(name: str, default: float, kind: type = float, minimum: float = 0) -> float:
    """``$name`` as ``kind`` (int or float), at least ``minimum``; ``default`` if unset."""
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value != value or value < minimum:      # (NaN != NaN)
        noun = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{name}={text!r} is not {noun} >= {minimum:g}")
    return value
