"""Parsing of peer addresses: ``shm://NAME``, ``tcp://HOST:PORT``, ``verbs://HOST:PORT``."""

from __future__ import annotations


def split_address(address: object) -> tuple[str, str]:
    """``"shm://job1"`` -> ``("shm", "job1")``; a clear ValueError otherwise."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str like 'shm://NAME', not {type(address).__name__}")
    scheme, sep, rest = address.partition("://")
    if not sep or not scheme or not rest:
        raise ValueError(f"address {address!r} is not of the form SCHEME://WHERE "
                         f"(e.g. shm://job1)")
    return scheme.lower(), rest
