"""A shrink's note in the job's store that the dropped ranks may re-join
(rdmamw/bootstrap/kvstore.py, StoreWorld.depart): written when the store answers, and
never what fails or holds up the shrink when it does not (torch's store lives on
rank 0: a lost rank 0 takes it along, a stopped one leaves it silent)."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

from rdmamw.bootstrap import kvstore
from rdmamw.bootstrap.kvstore import StoreWorld


class _KV:
    def __init__(self, fail: BaseException | None = None, block: bool = False) -> None:
        self.kv: dict[str, bytes] = {}
        self.fail, self.block, self.release = fail, block, threading.Event()

    def set(self, key: str, value: bytes) -> None:
        if self.block:
            self.release.wait(30)
        if self.fail is not None:
            raise self.fail
        self.kv[key] = value


def _world(kv: _KV) -> SimpleNamespace:
    return SimpleNamespace(_kv=kv, _prefix="p", rank=1, gen=lambda r: 3)


def test_the_note_names_each_dropped_rank_but_this_one_with_its_generation():
    kv = _KV()
    StoreWorld.depart(_world(kv), {0, 1, 2})
    assert kv.kv == {"p/gone/0": b"3", "p/gone/2": b"3"}


def test_a_store_whose_host_died_is_a_warning_not_an_error(caplog):
    kv = _KV(fail=RuntimeError("Broken pipe"))
    with caplog.at_level(logging.WARNING, "rdmamw.bootstrap"):
        StoreWorld.depart(_world(kv), {0})
    assert "cannot re-join" in caplog.text and "Broken pipe" in caplog.text


def test_a_store_that_does_not_answer_holds_the_shrink_up_at_most_its_bound(
        caplog, monkeypatch):
    monkeypatch.setattr(kvstore, "DEPART_WAIT", 0.2)
    kv = _KV(block=True)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "rdmamw.bootstrap"):
        StoreWorld.depart(_world(kv), {0})
    assert time.monotonic() - t0 < 5.0
    assert "no answer in 0.2 s" in caplog.text
    kv.release.set()
