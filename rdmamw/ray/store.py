"""Where the Ray group "rdmamw" meets: Ray's key-value store (the GCS ``internal_kv``,
namespace ``rdmamw``), one attempt at a time.

A group's keys are ``group/NAME/...`` with NAME percent-encoded (``/`` as ``%2F``), so
no group's keys start with another's: group ``a`` clears ``group/a/``, never
``group/a%2Fb/``. Each attempt at making the group meets under an attempt id of its
own, ``group/NAME/ATTEMPT/...``, agreed through the store: rank 0 clears whatever
earlier attempts left under the name (a member died while joining), picks a random id
and answers every other rank's hello (a random nonce under ``hello/RANK``) with it
under ``answer/NONCE``, until each has said it is there (``ATTEMPT/here/RANK``). A
rank never reads another attempt's endpoints: a nonce or an attempt id cannot be
stale. Ray is imported when a store is used, not with this module."""

from __future__ import annotations

import secrets
import time
from typing import Any
from urllib.parse import quote

from rdmamw.bootstrap import ranklist
from rdmamw.errors import Timeout

#: the namespace of our keys in Ray's key-value store
NAMESPACE = "rdmamw"
POLL_MIN, POLL_MAX = 0.001, 0.05


def _internal_kv() -> Any:
    import ray.experimental.internal_kv as internal_kv
    return internal_kv


def _node_ip() -> str:
    import ray
    return str(ray.util.get_node_ip_address())


def group_root(name: str) -> str:
    """The prefix of group ``name``'s keys (no other group's keys start with it plus
    "/")."""
    return f"group/{quote(name, safe='')}"


class RayKV:
    """Ray's key-value store as the store ``rdmamw.bootstrap.kvstore.join`` needs
    (``set``, ``get``, ``check``), every key under ``prefix``. ``host``: this node's
    address, what the group's tcp listeners advertise (``local_ip`` reads it;
    default Ray's node IP)."""

    def __init__(self, prefix: str, host: str | None = None) -> None:
        self.prefix = prefix
        self.host = host if host is not None else _node_ip()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes) -> None:
        _internal_kv()._internal_kv_put(self._key(key), value, namespace=NAMESPACE)

    def get(self, key: str) -> bytes:
        v = _internal_kv()._internal_kv_get(self._key(key), namespace=NAMESPACE)
        if v is None:
            raise KeyError(key)
        return bytes(v)

    def check(self, keys: list[str]) -> bool:
        kv = _internal_kv()
        return all(kv._internal_kv_exists(self._key(k), namespace=NAMESPACE) for k in keys)

    def clear(self) -> None:
        """Remove every key under ``prefix`` + "/" (none of a prefixed name's)."""
        _internal_kv()._internal_kv_del(self.prefix + "/", del_by_prefix=True,
                                        namespace=NAMESPACE)

    def under(self, part: str) -> RayKV:
        """The store of the keys under ``prefix/part``."""
        return RayKV(f"{self.prefix}/{part}", self.host)


def _sleep(pause: float, deadline: float, what: str) -> float:
    if time.monotonic() >= deadline:
        raise Timeout(what)
    time.sleep(pause)
    return min(POLL_MAX, pause * 2)


def meet(name: str, rank: int, size: int, timeout: float) -> RayKV:
    """This rank's store for this attempt at making group ``name`` (module doc):
    ``group/NAME/ATTEMPT``. Timeout when the other ranks (or rank 0) do not come
    within ``timeout`` seconds."""
    root = RayKV(group_root(name))
    deadline, pause = time.monotonic() + timeout, POLL_MIN
    if rank == 0:
        root.clear()                    # what dead attempts left under the name
        attempt = secrets.token_hex(8)
        mine = root.under(attempt)
        answered: dict[int, bytes] = {}
        waiting = set(range(1, size))
        while waiting:
            for r in sorted(waiting):
                if mine.check([f"here/{r}"]):
                    waiting.discard(r)
                    continue
                try:
                    nonce = root.get(f"hello/{r}")
                except KeyError:
                    continue
                if answered.get(r) != nonce:
                    root.set(f"answer/{nonce.decode('ascii', 'replace')}", attempt.encode())
                    answered[r] = nonce
            if waiting:
                pause = _sleep(pause, deadline,
                               f"making Ray group {name!r}: ranks "
                               f"{ranklist.compact(sorted(waiting))} of {size} never "
                               f"came within {timeout:g} s")
        return mine
    nonce = secrets.token_hex(8).encode()
    root.set(f"hello/{rank}", nonce)
    while True:
        try:
            attempt = root.get(f"answer/{nonce.decode()}").decode("ascii", "replace")
            break
        except KeyError:
            pass
        try:                            # rank 0 clears the name's keys as it starts
            said = root.get(f"hello/{rank}")
        except KeyError:
            said = b""
        if said != nonce:
            root.set(f"hello/{rank}", nonce)
        pause = _sleep(pause, deadline, f"making Ray group {name!r}: rank 0 never "
                                        f"answered rank {rank} within {timeout:g} s")
    mine = root.under(attempt)
    mine.set(f"here/{rank}", b"1")
    return mine
