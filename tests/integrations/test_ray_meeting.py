"""How the Ray group "rdmamw" (rdmamw.ray.group) meets through Ray's key-value store,
without a Ray cluster or torch (tests/support/fake_ray.py: the GCS store as a dict
with Ray's prefix deletion, a process group joining through it as the torch backend's
does, with a real barrier over rdmamw's collectives): a group made again under the
name of an attempt that died meets afresh, and a group clears its own keys only,
never those of a group whose name it prefixes. tests/integrations/test_ray.py does
the same through real Ray actors."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tests.support import fake_ray


@pytest.fixture
def kv(monkeypatch):
    monkeypatch.setenv("RDMAMW_INIT_TIMEOUT", "5")
    before = {m for m in sys.modules if m.startswith("rdmamw.ray")}
    store = fake_ray.InternalKV()
    try:
        with monkeypatch.context() as m:
            yield store, fake_ray.install(m, store)
    finally:
        for name in [m for m in sys.modules if m.startswith("rdmamw.ray")]:
            if name not in before:
                del sys.modules[name]


def form(group, name: str, size: int = 2, first: int | None = None, pause: float = 0.3
         ) -> list:
    """Make group ``name`` in ``size`` threads (rank ``first`` a moment before the
    others); each rank's group, or the exception it raised."""
    out: list = [None] * size

    def member(rank: int) -> None:
        try:
            out[rank] = group.RdmamwGroup(size, rank, name)
        except BaseException as e:      # noqa: BLE001 - the outcome is the test
            out[rank] = e

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(size)]
    order = list(range(size)) if first is None else [first] + [r for r in range(size)
                                                               if r != first]
    for i, r in enumerate(order):
        threads[r].start()
        if i == 0 and first is not None:
            time.sleep(pause)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a member hangs"
    return out


def destroy(groups: list) -> None:
    for g in groups:
        if g is not None and not isinstance(g, BaseException):
            g.destroy_group()


def test_a_group_formed_again_after_an_attempt_died_meets_afresh(kv):
    """The first attempt's members publish their endpoints, then die in the first
    barrier (their keys stay); the group is made again under the same name, rank 1
    first: it must reach the new rank 0, not the dead attempt's endpoints."""
    store, group = kv
    fake_ray.ProcessGroup.die = True
    try:
        dead = form(group, "g")
    finally:
        fake_ray.ProcessGroup.die = False
    assert all(isinstance(e, Exception) for e in dead), dead
    assert store.keys(), "the dead attempt left no keys: nothing to test"
    got = form(group, "g", first=1)
    try:
        # each formed: its first barrier passed over the new attempt's channels
        assert not any(isinstance(g, BaseException) for g in got), got
    finally:
        destroy(got)


def test_stale_keys_of_many_dead_attempts_are_ignored(kv):
    store, group = kv
    for _ in range(2):
        fake_ray.ProcessGroup.die = True
        try:
            form(group, "many", first=0)
        finally:
            fake_ray.ProcessGroup.die = False
    for first in (1, 0):
        got = form(group, "many", first=first)
        try:
            assert not any(isinstance(g, BaseException) for g in got), got
        finally:
            destroy(got)


def test_a_group_clears_only_its_own_keys_not_a_prefixed_names(kv):
    """Group "a/b" is meeting (rank 1 has published its keys, rank 0 comes later)
    while group "a" forms and its rank 0 clears the keys of "a": those of "a/b" must
    survive, and "a/b" forms once its rank 0 comes."""
    store, group = kv
    late: list = [None, None]

    def member(rank: int) -> None:
        try:
            late[rank] = group.RdmamwGroup(2, rank, "a/b")
        except BaseException as e:      # noqa: BLE001 - the outcome is the test
            late[rank] = e

    one = threading.Thread(target=member, args=(1,), daemon=True)
    one.start()
    time.sleep(0.3)
    mine = {k for k in store.keys()}
    assert mine, "rank 1 of a/b published nothing"
    a = form(group, "a")
    try:
        assert not any(isinstance(g, BaseException) for g in a), a
        assert mine <= set(store.keys()), ("group a removed a/b's keys",
                                           sorted(mine - set(store.keys())))
        zero = threading.Thread(target=member, args=(0,), daemon=True)
        zero.start()
        zero.join(30)
        one.join(30)
        assert not any(isinstance(g, BaseException) for g in late), late
    finally:
        destroy(a)
        destroy(late)


def test_destroying_a_group_leaves_a_prefixed_names_keys(kv):
    """Groups "a" and "a/b" formed, each with a key written after forming (as the
    torch group's monitored barrier does); destroying "a" leaves "a/b"'s key."""
    store, group = kv
    ab = form(group, "a/b")
    a = form(group, "a")
    try:
        assert not any(isinstance(g, BaseException) for g in ab + a), ab + a
        ab[0]._pg.store.set("later", b"ab")
        a[0]._pg.store.set("later", b"a")
        kept = set(store.keys())
        destroy(a)
        a = []
        assert ab[0]._pg.store.get("later") == b"ab", store.keys()
        assert set(store.keys()) <= kept
    finally:
        destroy(a)
        destroy(ab)
