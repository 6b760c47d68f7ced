"""``rdmamw tune rndv`` (rdmamw/apps/tune_rndv.py): the choice from a table, the command."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

import rdmamw
from rdmamw.apps import tune_rndv as tune
from rdmamw.memory import thresholds

K, M = 1 << 10, 1 << 20


def test_crossover_is_where_rendezvous_wins_from_then_on():
    table = {"eager": {4 * K: 9.0, 64 * K: 8.0, 1 * M: 5.0, 4 * M: 4.0},
             "read": {4 * K: 1.0, 64 * K: 8.5, 1 * M: 4.9, 4 * M: 9.0, 64 * M: 8.0},
             "write": {4 * K: 0.5, 64 * K: 2.0, 1 * M: 3.0, 4 * M: 7.0, 64 * M: 7.5}}
    c = tune.choose(table)
    # read wins at 64K but loses at 1M again: the crossover is 4M, eager up to 1M
    assert c == {"strategy": "read", "threshold": 1 * M, "crossover": 4 * M}


def test_write_chosen_when_faster_at_the_large_sizes():
    table = {"eager": {4 * K: 9.0, 64 * K: 6.0},
             "read": {4 * K: 1.0, 64 * K: 5.0, 16 * M: 6.0, 64 * M: 6.0},
             "write": {4 * K: 1.0, 64 * K: 7.0, 16 * M: 9.0, 64 * M: 9.0}}
    assert tune.choose(table) == {"strategy": "write", "threshold": 4 * K, "crossover": 64 * K}


def test_rendezvous_always_faster_or_never_faster():
    always = {"eager": {64 * K: 1.0, 1 * M: 1.0}, "read": {64 * K: 2.0, 1 * M: 2.0}}
    assert tune.choose(always) == {"strategy": "read", "threshold": 64 * K,
                                   "crossover": 64 * K}
    never = {"eager": {64 * K: 3.0, 1 * M: 3.0}, "read": {64 * K: 2.0, 1 * M: 2.0}}
    assert tune.choose(never) == {"strategy": "read", "threshold": 1 * M, "crossover": None}
    with pytest.raises(ValueError):
        tune.choose({"eager": {1: 1.0}})


def test_table_and_schedule():
    table = {"eager": {4 * K: 9.0}, "read": {4 * K: 1.0, 4 * M: 9.5}}
    text = tune.format_table(table, tune.choose(table))
    assert "4 KiB" in text and "4 MiB" in text and "crossover: 4 MiB" in text
    assert tune.schedule([4 * K, 64 * M], 256 * M, 3) == [(4 * K, 65536, 3), (64 * M, 4, 3)]
    assert tune.schedule([64 * M], 1 * M, 1) == [(64 * M, 2, 1)]
    assert tune.schedule([64 * M], 256 * M, 1, min_messages=8) == [(64 * M, 8, 1)]


def test_cli_dispatch_keeps_the_collectives_tune():
    out = subprocess.run([sys.executable, "-m", "rdmamw.cli", "tune", "rndv", "-h"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--provider" in out.stdout
    out = subprocess.run([sys.executable, "-m", "rdmamw.cli", "tune", "-h"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--nprocs" in out.stdout and "tune rndv" in out.stdout


HAS_RNDV = "rendezvous" in inspect.signature(rdmamw.Channel.open).parameters


@pytest.mark.skipif(not HAS_RNDV, reason="the rendezvous API (branch rdv) is not in this build")
@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_tune_rndv_measures_and_saves(tmp_path, provider):
    out = tmp_path / "rndv.json"
    r = subprocess.run([sys.executable, "-m", "rdmamw.cli", "tune", "rndv", "--provider",
                        provider, "--sizes", "4K,256K,1M", "--eager-max", "1M",
                        "--bytes-per-run", "2M", "--runs", "1", "--out", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "crossover" in r.stdout
    saved = json.loads(out.read_text())["providers"][provider]
    assert saved["strategy"] in ("read", "write")
    assert set(saved["measured"]["gbps"]) == {"eager", "read", "write"}
    got = thresholds.lookup(provider, out)
    assert (got["strategy"], got["threshold"]) == (saved["strategy"], saved["threshold"])


def test_counter_lines_say_what_really_happened():
    lines = tune.counter_lines({"eager": {"rndv_sends": 0},
                                "write": {"rndv_sends": 10, "rndv_writes": 4}})
    assert lines == ["eager: 0 rendezvous sends (expected 0)",
                     "write: 10 rendezvous sends, 4 written by the sender (40%), "
                     "6 read by the receiver"]


def test_pattern_prefixes_agree():
    import numpy as np
    for n in (1, 255, 256, 1000, 70000):
        assert np.array_equal(tune._pattern(n), (np.arange(n) % 256).astype(np.uint8))


def test_same_compares_in_slices():
    import numpy as np
    a = np.zeros(3 * M + 5, np.uint8)
    b = a.copy()
    assert tune._same(a, b, chunk=M)
    b[-1] = 1
    assert not tune._same(a, b, chunk=M) and not tune._same(a, b[:-1], chunk=M)
