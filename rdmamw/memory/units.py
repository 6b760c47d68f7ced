"""Byte sizes and durations as users write them in environment variables and options
("64M", "1G", "0.5")."""

from __future__ import annotations

from rdmamw.errors import ConfigError

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str | int, what: str = "size") -> int:
    """``"4096"``, ``"64K"``, ``"64KiB"``, ``"1g"`` -> bytes (binary multiples).

    ``what`` names the setting in the error, so a bad environment variable is easy to
    find."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        unit = s[-1:] if s[-1:] in _SUFFIX and s[-1:] else ""
        digits = s[: len(s) - len(unit)].strip()
        try:
            value = int(float(digits) * _SUFFIX[unit]) if digits else -1
        except ValueError:
            value = -1
        if value < 0:
            raise ConfigError(f"{what}: {text!r} is not a byte size "
                              "(examples: 65536, 64K, 256M, 1G)")
    if value < 0:
        raise ConfigError(f"{what}: {text!r} must not be negative")
    return value


def parse_seconds(text: str | float, what: str = "duration") -> float:
    """``"10"``, ``"0.5"`` -> seconds, which must be positive and finite; else ConfigError
    naming ``what``."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConfigError(f"{what}: {text!r} is not a positive number of seconds")
    return value


def human(n: float) -> str:
    """4194304 -> '4 MiB' (tables and messages)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
