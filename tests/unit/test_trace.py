"""The timeline (rdmamw.trace, docs/trace.md) in one process: off, nothing is imported
nor recorded; RDMAMW_TRACE records from the job's start and writes at exit; record()
writes its block; merge puts files on the wall clock by their offsets; the parameter
server's rounds are spans. (A 4-rank job's collectives: tests/integrations/
test_trace_job.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rdmamw import observe
from rdmamw.errors import RdmamwError
from rdmamw.trace import record, start, stop
from rdmamw.trace.merge import merge
from rdmamw.trace.recorder import Tracer, expand

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RDMAMW_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_off_nothing_is_recorded_and_the_recorder_not_imported():
    """(rdmamw.trace itself is: it reads RDMAMW_TRACE when the process begins.)"""
    got = python("import sys, rdmamw\nfrom rdmamw import observe\nobserve.begin()\n"
                 "print(sorted(m for m in sys.modules if m.startswith('rdmamw.trace')),"
                 " observe.tracer)")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["['rdmamw.trace',", "'rdmamw.trace.settings']", "None"]


def test_the_setting_records_from_the_start_and_writes_at_exit(tmp_path):
    code = ("import os, rdmamw\nfrom rdmamw import observe\nobserve.begin()\n"
            "tr = observe.tracer\nt0 = tr.clock()\ntr.span('work', 'test', t0, {'n': 1})\n"
            "print(os.getpid())")
    got = python(code, RDMAMW_TRACE=str(tmp_path / "t-%r-%p.json"))
    assert got.returncode == 0, got.stderr
    pid = int(got.stdout)
    with open(tmp_path / f"t-pid{pid}-{pid}.json") as f:
        doc = json.load(f)
    assert [(e["name"], e["cat"], e["pid"], e["args"]) for e in doc["traceEvents"]
            if e["ph"] == "X"] == [("work", "test", pid, {"n": 1})]
    meta = doc["otherData"]["rdmamw"]
    assert (meta["rank"], meta["pid"], meta["dropped"]) == (None, pid, 0)


def test_record_writes_its_block_and_one_timeline_records_at_a_time(tmp_path):
    path = tmp_path / "block.json"
    with record(str(path)) as tr:
        assert observe.tracer is tr
        with pytest.raises(RdmamwError, match="recorded already"):
            start(str(tmp_path / "other.json"))
        t0 = tr.clock()
        tr.span("a", "test", t0, {})
    assert observe.tracer is None and stop() is None
    doc = json.loads(path.read_text())
    (a,) = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert a["name"] == "a" and a["dur"] >= 0 and a["ts"] == t0 / 1000
    assert not (tmp_path / "other.json").exists()


def test_spans_past_the_limit_are_counted_not_kept(tmp_path):
    tr = Tracer(str(tmp_path / "x.json"), 2)
    tr.span("a", "test", tr.clock(), {})
    tr.step(0, 3, [b"12345", np.zeros(4, np.float32)], None, 7, tr.clock())
    tr.span("c", "test", tr.clock(), {})
    tr.step(1, 3, None, [b"123"], 7, tr.clock())
    doc = tr.document(5)
    assert [(e["name"], e["args"]) for e in doc["traceEvents"] if e["ph"] == "X"] == [
        ("a", {}), ("send", {"peer": 3, "seq": 7, "bytes": 21, "messages": 2})]
    assert doc["otherData"]["rdmamw"]["dropped"] == 2


def test_paths_name_the_rank_and_the_pid():
    pid = os.getpid()
    assert expand("t-%r.%p-%%r.json", 3) == f"t-3.{pid}-%r.json"
    assert expand("t-%r%x", None) == f"t-pid{pid}%x"


def test_merge_puts_the_files_on_the_wall_clock(tmp_path):
    """Rank 1's clock reads 5 ms less than rank 0's at the same wall time: its span at
    clock 3 ms is wall-simultaneous with rank 0's at 8 ms."""
    paths = []
    for rank, (offset, t0) in enumerate([(10**18, 8_000_000), (10**18 + 5_000_000,
                                                                3_000_000)]):
        tr = Tracer("unused", 10)
        tr.offset_ns = offset
        tr.spans.append(("x", "test", t0, t0 + 2_000, 7, {}))
        tr.spans.append(("y", "test", t0 + 1_000_000, t0 + 1_000_500, 7, {}))
        doc = tr.document(rank)
        paths.append(str(tmp_path / f"{rank}.json"))
        with open(paths[-1], "w") as f:
            json.dump(doc, f)
    out = merge(paths)
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in out["traceEvents"]
            if e["ph"] == "X"] == [(0, "x", 0.0, 2.0), (0, "y", 1000.0, 0.5),
                                   (1, "x", 0.0, 2.0), (1, "y", 1000.0, 0.5)]
    assert out["otherData"]["rdmamw"]["wall_start_ns"] == 10**18 + 8_000_000
    with pytest.raises(ValueError, match="both process 0"):
        merge([paths[0], paths[0]])
    (tmp_path / "other.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match="not a timeline written by rdmamw"):
        merge([str(tmp_path / "other.json")])


def test_the_parameter_servers_rounds_are_spans(tmp_path):
    """BSP with 2 workers, 3 rounds: 3 round spans, one after the other, each merging
    both workers."""
    from tests.support.helpers import PSInProcess
    job = PSInProcess(2, consistency="bsp")
    try:
        for w in (0, 1):
            job.workers[w].init(["k"], [np.zeros(4, np.float32)])
        with record(str(tmp_path / "ps.json")):
            job.run(lambda w: [job.workers[w].push_pull(["k"], [np.ones(4, np.float32)],
                                                        [np.zeros(4, np.float32)])
                               for _ in range(3)])
    finally:
        job.close()
    doc = json.loads((tmp_path / "ps.json").read_text())
    rounds = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "ps"]
    lasts = [e["args"].pop("last") for e in rounds]     # (who came last: either)
    assert [(e["name"], e["args"]) for e in rounds] == [
        ("round", {"version": v, "merged": [0, 1], "left_out": []}) for v in (1, 2, 3)]
    assert all(w in (0, 1) for w in lasts)
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(rounds, rounds[1:], strict=False))
