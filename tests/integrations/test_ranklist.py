"""Missing ranks are named compactly and boundedly (issue 29, left item 2): rank 0's
init Timeout listed every missing rank, about a million numbers at the largest world
size; now runs (``[3-17, 20, 40-1023]``), at most ``ranklist.SHOWN`` of them, then
"... and N more" (rdmamw/bootstrap/ranklist.py, rdmamw/bootstrap/store.py)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import rdmamw
from rdmamw import config
from rdmamw.bootstrap import ranklist, store
from tests.support.helpers import init_some_ranks

BIG = int(config.setting("RDMAMW_WORLD_SIZE").maximum)


@pytest.mark.parametrize("ranks, text", [
    ([], "[]"), ([7], "[7]"), ([1, 3], "[1, 3]"), ([3, 4, 5], "[3-5]"),
    ([20, *range(3, 18), *range(40, 1024), 20], "[3-17, 20, 40-1023]"),
    (range(0, 40, 2), "[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, "
                      "... and 4 more]"),
])
def test_compact(ranks, text):
    assert ranklist.compact(ranks) == text


def test_gaps_are_the_complement_without_walking_the_range():
    assert list(ranklist.gaps([0, 5, 7], 10)) == [(1, 4), (6, 6), (8, 9)]
    assert list(ranklist.gaps([], 3)) == [(0, 2)]
    assert list(ranklist.gaps(range(3), 3)) == []
    assert list(ranklist.gaps([2, 2, 0], 4)) == [(1, 1), (3, 3)]
    assert list(ranklist.gaps([0, 1], BIG)) == [(2, BIG - 1)]
    present = {0, *range(1, BIG, 2)}                 # every other rank of the largest job
    text = ranklist.compact_runs(ranklist.gaps(present, BIG))
    assert text.startswith("[2, 4, 6, ") and text.endswith(f"... and {BIG // 2 - 1 - 16} more]")
    assert len(text) < 200


def test_a_store_timeout_names_many_gaps_in_one_bounded_line():
    """Rank 0's store with ranks 2, 4, ..., 40 of 100 joined: the 59 + 20 missing runs
    come as 16 runs and a count, on rank 0 and on every rank that joined."""
    sock = store.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    got: dict = {}

    def rank(r):
        try:
            store.join("127.0.0.1", port, r, None, lambda ip: {"host": f"h{r}"}, 100, 20)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2, 41, 2)]
    for t in threads:
        t.start()
    with pytest.raises(rdmamw.Timeout) as e0:
        store.serve(sock, 100, {"host": "h0"}, 2.0)
    for t in threads:
        t.join(10)
    want = ("79 of 100 ranks never joined", "ranks [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, "
            "25, 27, 29, 31, ... and 63 more]")
    for e in (e0.value, *got.values()):
        assert isinstance(e, rdmamw.Timeout), e
        assert all(w in str(e) for w in want), str(e)
    assert len(got) == 20


def test_init_of_the_largest_world_with_ranks_missing_says_so_in_a_line():
    """A real init: ranks 0 and 2 of a job of 2^20 ranks; both time out quickly, naming
    the 2^20 - 2 missing ranks in a few characters."""
    for code, err in init_some_ranks(BIG, (0, 2), 2):
        assert code != 0
        last = err.strip().splitlines()[-1]
        assert "Timeout" in last and f"{BIG - 2} of {BIG} ranks never joined" in last, err
        assert last.endswith(f"ranks [1, 3-{BIG - 1}]") or f"ranks [1, 3-{BIG - 1}]" in last
        assert len(err) < 4000, len(err)


def test_a_store_join_through_another_store_names_the_missing_ranks_compactly():
    """The same through a key-value store (rdmamw/bootstrap/kvstore.py, torch's
    stores): of a world of 2^20 only ranks 0 and 2 published, the Timeout is a line."""
    from rdmamw.bootstrap import kvstore

    class KV:
        def check(self, keys):
            return keys[0] in ("p/desc/0", "p/desc/2", "p/job")

    keys = {r: f"p/desc/{r}" for r in range(BIG)}
    with pytest.raises(rdmamw.Timeout) as e:
        kvstore._await(KV(), keys, time.monotonic(), "joining", BIG, 1.0)
    assert f"ranks [1, 3-{BIG - 1}] of {BIG} never published" in str(e.value), str(e.value)
    assert f"({BIG - 2} ranks" in str(e.value) and len(str(e.value)) < 300


def test_a_joining_rank_repeats_at_most_a_line_of_rank_0s_list():
    """A rank 0 (of our token) that answers a join with a list of a million characters:
    the joining rank's Timeout repeats 400 of them."""
    from rdmamw import auth
    from rdmamw.transport.wire import recv_frame, send_frame

    sock = socket.create_server(("127.0.0.1", 0))

    def rank0():
        conn, _ = sock.accept()
        with conn:
            auth.accept_side(conn)
            recv_frame(conn, store.JOIN_LIMIT)
            send_frame(conn, {"ok": False, "missing": "[" + "7, " * 333_333 + "]",
                              "missing_count": 333_333})
    t = threading.Thread(target=rank0)
    t.start()
    try:
        with pytest.raises(rdmamw.Timeout) as e:
            store.join("127.0.0.1", sock.getsockname()[1], 1, None, lambda ip: {"host": "h"},
                       BIG, 10)
    finally:
        t.join(10)
        sock.close()
    assert "333333 of" in str(e.value) and len(str(e.value)) < 600, len(str(e.value))
