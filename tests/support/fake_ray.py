"""What rdmamw.ray.group needs of Ray and torch, for testing how a group meets without
a Ray cluster or torch: Ray's GCS key-value store as a dict (``internal_kv`` with
Ray's prefix deletion), stand-in modules when Ray is not installed, and a process
group that meets through the store as the torch backend's does (the same
``kvstore.join``) and whose barrier is a real one over rdmamw's collectives (stale
endpoints fail it)."""

from __future__ import annotations

import enum
import importlib
import sys
import threading
import types
from typing import Any

from rdmamw.bootstrap import kvstore
from rdmamw.collectives.api import barrier
from rdmamw.collectives.comm import Communicator


class InternalKV:
    """Ray's ``ray.experimental.internal_kv`` functions over one dict (keys as bytes,
    as the GCS keeps them; ``del_by_prefix`` deletes every key starting with the
    string, as Ray's does)."""

    def __init__(self) -> None:
        self.data: dict[tuple[str | None, bytes], bytes] = {}
        self.lock = threading.Lock()

    @staticmethod
    def _b(key: str | bytes) -> bytes:
        return key.encode() if isinstance(key, str) else key

    def _internal_kv_put(self, key: str | bytes, value: bytes, overwrite: bool = True,
                         namespace: str | None = None) -> bool:
        with self.lock:
            k = (namespace, self._b(key))
            there = k in self.data
            if overwrite or not there:
                self.data[k] = self._b(value)
            return there

    def _internal_kv_get(self, key: str | bytes, namespace: str | None = None
                         ) -> bytes | None:
        with self.lock:
            return self.data.get((namespace, self._b(key)))

    def _internal_kv_exists(self, key: str | bytes, namespace: str | None = None) -> bool:
        with self.lock:
            return (namespace, self._b(key)) in self.data

    def _internal_kv_del(self, key: str | bytes, del_by_prefix: bool = False,
                         namespace: str | None = None) -> int:
        with self.lock:
            b = self._b(key)
            gone = [k for k in self.data if k[0] == namespace and
                    (k[1].startswith(b) if del_by_prefix else k[1] == b)]
            for k in gone:
                del self.data[k]
            return len(gone)

    def _internal_kv_list(self, prefix: str | bytes, namespace: str | None = None
                          ) -> list[bytes]:
        with self.lock:
            b = self._b(prefix)
            return [k[1] for k in self.data if k[0] == namespace and k[1].startswith(b)]

    def keys(self) -> list[str]:
        with self.lock:
            return sorted(k[1].decode() for k in self.data)


FUNCTIONS = ("_internal_kv_put", "_internal_kv_get", "_internal_kv_exists",
             "_internal_kv_del", "_internal_kv_list")


def _module(monkeypatch: Any, name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    monkeypatch.setitem(sys.modules, name, m)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        monkeypatch.setattr(sys.modules[parent], child, m, raising=False)
    return m


class _ReduceOp(enum.Enum):
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3


class _BaseGroup:
    def __init__(self, world_size: int, rank: int, group_name: str) -> None:
        self._world_size, self._rank, self._group_name = world_size, rank, group_name

    @property
    def rank(self) -> int:
        return self._rank


class ProcessGroup:
    """The torch backend's ProcessGroupRdmamw as far as meeting goes: a join through
    the store (with the store's host), a barrier over the channels it opens.
    ``die``: the barrier fails (a member died while joining: the group's keys stay)."""

    die = False

    def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
        secs = timeout.total_seconds()
        self.store = store
        self.world = kvstore.join(store, rank, size, secs, store.host, "rdmamw/coll",
                                  launcher="torch")
        self.comm = Communicator(self.world, timeout=secs)

    def barrier(self, opts: Any) -> Any:
        die, comm = self.die, self.comm

        class Work:
            def wait(self) -> bool:
                if die:
                    from rdmamw.errors import Timeout
                    raise Timeout("barrier: a member died (simulated)")
                barrier(comm=comm)
                return True
        return Work()

    def shutdown(self) -> None:
        self.comm.close(linger=0.0)
        self.world.close()


def install(monkeypatch: Any, kv: InternalKV) -> types.ModuleType:
    """rdmamw.ray.group with Ray's store being ``kv`` and the stand-in process group;
    Ray's own modules when Ray is installed (their store functions replaced), stand-ins
    otherwise. Returns the group module."""
    try:
        import ray
        import ray.experimental.internal_kv as ikv
    except ImportError:
        ray = _module(monkeypatch, "ray")
        _module(monkeypatch, "ray.experimental")
        ikv = _module(monkeypatch, "ray.experimental.internal_kv")
        _module(monkeypatch, "ray.util")
        _module(monkeypatch, "ray.util.collective")
        _module(monkeypatch, "ray.util.collective.collective_group")
        _module(monkeypatch, "ray.util.collective.collective_group.base_collective_group",
                BaseGroup=_BaseGroup)
        _module(monkeypatch, "ray.util.collective.types", ReduceOp=_ReduceOp)
    for f in FUNCTIONS:
        monkeypatch.setattr(ikv, f, getattr(kv, f), raising=False)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1",
                        raising=False)
    try:
        importlib.import_module("rdmamw.torch")
    except ImportError:
        _module(monkeypatch, "rdmamw.torch")
    _module(monkeypatch, "rdmamw.torch.backend", ProcessGroupRdmamw=ProcessGroup)
    for name in [m for m in sys.modules if m == "rdmamw.ray" or m.startswith("rdmamw.ray.")]:
        monkeypatch.delitem(sys.modules, name)
    group = importlib.import_module("rdmamw.ray.group")
    monkeypatch.setattr(group, "_blocking", lambda kind, **fields: None)
    return group
