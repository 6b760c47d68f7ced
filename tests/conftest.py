"""Shared fixtures: channel pairs in one process (a thread accepts) and helpers for
tests that need a second process."""

from __future__ import annotations

import itertools
import os
import threading

import pytest

import rdmamw

_names = itertools.count()


def unique_name(tag: str = "t") -> str:
    return f"{tag}-{os.getpid()}-{next(_names)}"


def make_pair(mode: str = "batched", slots: int = 16, slot_size: int = 4096,
              peer_slots: int | None = None, peer_slot_size: int | None = None,
              spin_us: float = 50.0):
    """(opener, acceptor, listener): the opener receives on slots x slot_size, the
    acceptor on peer_slots x peer_slot_size (default: the same)."""
    name = unique_name()
    lst = rdmamw.listen(f"shm://{name}", slots=peer_slots or slots,
                        slot_size=peer_slot_size or slot_size, spin_us=spin_us)
    got: dict = {}

    def accept() -> None:
        try:
            got["ch"] = lst.accept(timeout=10)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            got["err"] = e

    t = threading.Thread(target=accept)
    t.start()
    a = rdmamw.Channel.open(f"shm://{name}", mode=mode, timeout=10, slots=slots,
                            slot_size=slot_size, spin_us=spin_us)
    t.join(10)
    if "err" in got:
        raise got["err"]
    return a, got["ch"], lst


@pytest.fixture(params=["batched", "ack"])
def mode(request):
    return request.param


@pytest.fixture
def pair(mode):
    a, b, lst = make_pair(mode)
    yield a, b
    a.close()
    b.close()
    lst.close()


def shm_entries() -> set[str]:
    """What rdmamw could have left in /dev/shm (it should never leave anything)."""
    try:
        return {n for n in os.listdir("/dev/shm") if "rdmamw" in n}
    except FileNotFoundError:
        return set()
