"""Every message that names ranks, servers or workers names them compactly and
boundedly (issue 29): with 100000 of them missing it stays a line, not a list of
100000 numbers (rdmamw/bootstrap/ranklist.py)."""

from __future__ import annotations

import asyncio
import logging
import types

import pytest

from rdmamw.errors import Timeout

N = 100_000
SHORT = 300         # characters a message may take, whatever the world size


def _short(text: str) -> str:
    assert len(text) < SHORT and "... and" in text, text[:500]
    return text


class _Store:
    """The store surface monitored_barrier uses, in memory."""

    def __init__(self, **kv: bytes) -> None:
        self.kv = dict(kv)

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)


def _group(rank: int, store: _Store) -> types.SimpleNamespace:
    return types.SimpleNamespace(_monitored=0, _store=store, _rank=rank, _size=2 * N + 1,
                                 timeout=0.2)


def test_monitored_barrier_names_a_large_world_of_missing_ranks_in_a_line():
    pytest.importorskip("torch")
    from rdmamw.torch.backend import ProcessGroupRdmamw

    store = _Store(**{f"rdmamw/monitored/1/{r}": b"1" for r in range(0, 2 * N + 1, 2)})
    with pytest.raises(Timeout) as e:       # rank 0: every odd rank is missing
        ProcessGroupRdmamw.monitored_barrier(_group(0, store), wait_all_ranks=True)
    said = _short(str(e.value))
    assert said.startswith("monitored_barrier: ranks [1, 3, 5,") and f"{N - 16} more" in said
    assert len(store.kv["rdmamw/monitored/1/done"]) < SHORT   # what the others read
    with pytest.raises(Timeout) as e2:      # another rank: rank 0's verdict, as is
        ProcessGroupRdmamw.monitored_barrier(_group(2, store), wait_all_ranks=True)
    assert str(e2.value) == str(e.value)


def test_new_group_names_two_long_rank_lists_in_a_line():
    pytest.importorskip("torch")
    from rdmamw.errors import ConfigError
    from rdmamw.torch.backend import _same_members

    theirs = list(range(0, 2 * N, 2))
    store = _Store(**{"rdmamw/ranks/0": ",".join(map(str, theirs)).encode()})
    with pytest.raises(ConfigError) as e:
        _same_members(store, 1, 1, list(range(1, 2 * N, 2)))
    said = str(e.value)
    assert len(said) < 2 * SHORT and "first different at position 0" in said, said[:500]


def test_p2p_recv_from_any_source_names_its_peers_in_a_line():
    pytest.importorskip("torch")
    import numpy as np
    import torch

    from rdmamw.torch.p2p import PointToPoint

    p = PointToPoint(types.SimpleNamespace(close=lambda: None), 0.2)  # type: ignore[arg-type]
    peers = list(range(1, 2 * N, 2))
    p._chans = dict.fromkeys(peers)
    p._busy = lambda peer: True     # every peer's next message is someone else's
    try:
        with pytest.raises(Timeout) as e:
            p.recv_any(np.empty(1, np.float32), torch.float32, (1,), peers, 0).wait(30)
        _short(str(e.value))
    finally:
        p._chans = {}
        p.close()


def test_a_round_closed_by_timeout_names_its_missing_workers_in_a_line(caplog):
    from rdmamw.ps.consistency import Consistency

    policy = Consistency.parse("bsp").policy(list(range(0, 2 * N, 2)))
    policy.timeout = 0.0
    policy.on_push(0, 0, 0.0)
    with caplog.at_level(logging.WARNING, "rdmamw.ps"):
        assert policy.close_due(1.0)
    said = _short(caplog.records[-1].getMessage())
    assert "without workers [2, 4, 6," in said


class _Silent:
    """A server channel that never answers."""

    def recv_batch(self, *a, **kw):
        raise Timeout("nothing")


def test_a_pull_names_the_servers_that_did_not_reply_in_a_line():
    from rdmamw.ps.worker import KVWorker

    w = KVWorker.__new__(KVWorker)
    w.timeout, w.chans, w._until = 0.2, dict.fromkeys(range(N), _Silent()), None
    with pytest.raises(Timeout) as e:
        w.receive_pull({s: 1 for s in range(0, N, 2)}, None)
    _short(str(e.value))


def test_an_awaited_pull_names_the_servers_that_did_not_reply_in_a_line():
    from rdmamw.aio.ps import KVWorker

    class Never:
        async def recv_batch(self):
            await asyncio.sleep(60)

    w = KVWorker.__new__(KVWorker)
    w.sync = types.SimpleNamespace(timeout=0.5)
    w.chans = dict.fromkeys(range(0, 2 * N, 2), Never())
    with pytest.raises(Timeout) as e:
        asyncio.run(w._replies({s: 1 for s in range(0, 2 * N, 2)}, None))
    _short(str(e.value))


def test_a_handle_keeps_the_collectives_own_timeout():
    """A collective (or a receive from any source) that ends with its own Timeout is
    that Timeout at the handle, not "still running" (both are TimeoutErrors)."""
    from rdmamw.collectives.progress import Progress

    def times_out() -> None:
        raise Timeout("its own message")

    p = Progress("rdmamw-test")
    try:
        with pytest.raises(Timeout, match="its own message"):
            p.submit(times_out).wait(5)
    finally:
        p.stop()
