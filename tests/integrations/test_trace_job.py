"""The timeline of a running job (rdmamw.trace, docs/trace.md): 4 ranks of a shm job
(tests/support/trace_worker.py) record with RDMAMW_TRACE=…-%r.json, ``rdmamw trace
merge`` puts the files on one clock, and the merged file holds every rank's
collectives and steps in order, each step inside its collective, no message received
before it was sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rdmamw import cli
from rdmamw.bootstrap.launch import spawn
from tests.support import trace_worker
from tests.support.helpers import assert_ranks_ok
from tests.support.perfetto import query

jsonschema = pytest.importorskip("jsonschema")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "support", "trace_worker.py")
N = 4
#: the Chrome trace-event format's complete ("X"), thread-scoped instant ("i") and
#: metadata ("M") events, as Perfetto's JSON importer reads them (ts and dur in µs)
EVENT_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {"traceEvents": {"type": "array", "items": {"oneOf": [
        {"type": "object", "required": ["name", "cat", "ph", "ts", "dur", "pid", "tid"],
         "properties": {"name": {"type": "string"}, "cat": {"type": "string"},
                        "ph": {"const": "X"}, "ts": {"type": "number", "minimum": 0},
                        "dur": {"type": "number", "minimum": 0},
                        "pid": {"type": "integer"}, "tid": {"type": "integer"},
                        "args": {"type": "object"}}},
        {"type": "object", "required": ["name", "cat", "ph", "s", "ts", "pid", "tid"],
         "properties": {"name": {"type": "string"}, "cat": {"type": "string"},
                        "ph": {"const": "i"}, "s": {"const": "t"},
                        "ts": {"type": "number", "minimum": 0}, "pid": {"type": "integer"},
                        "tid": {"type": "integer"}, "args": {"type": "object"}}},
        {"type": "object", "required": ["name", "ph", "pid", "args"],
         "properties": {"ph": {"const": "M"}, "name": {"enum": [
             "process_name", "process_sort_index", "thread_name", "thread_sort_index"]}}},
    ]}}, "displayTimeUnit": {"enum": ["ms", "ns"]}},
}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    env = {"RDMAMW_TRACE": str(d / "trace-%r.json"),
           "RDMAMW_COLL_CONFIG": os.path.join(ROOT, "tests", "no-such-config.json")}
    procs = spawn(N, [sys.executable, WORKER], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert_ranks_ok(procs, outs)
    want = [float(sum(range(i, i + N))) for i in range(trace_worker.ALLREDUCES)]
    assert [json.loads(out)["results"] for out, _ in outs] == [want] * N
    files = [str(d / f"trace-{r}.json") for r in range(N)]
    assert cli.main(["trace", "merge", *files, "-o", str(d / "all.json")]) == 0
    with open(d / "all.json") as f:
        return str(d / "all.json"), json.load(f)


#: the categories of the channels' own records (rdmamw/trace/records.py)
CHANNEL_CATS = ("batch", "wait", "rendezvous")


def spans(doc: dict, pid: int, cat: str | None = None) -> list[dict]:
    """Rank ``pid``'s spans of category ``cat`` (None: those of the collectives' layer)."""
    return sorted((e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == pid
                   and (e["cat"] == cat if cat is not None else e["cat"] not in CHANNEL_CATS)),
                  key=lambda e: e["ts"])


def ring_steps(r: int) -> list[tuple[str, int, int | None]]:
    """(step, peer, bytes) of one ring allreduce of the worker's at rank ``r`` of N:
    the header round (dissemination: to r+1, from r-1, to r+2, from r-2), N-1 steps of
    reduce-scatter and N-1 of allgather (a quarter of the array each way), then the
    wait for each peer sent to. ("recv into", a receive straight into the result, is
    written "recv": one that a wait on another channel took early is a plain one.)"""
    nxt, prv, chunk = (r + 1) % N, (r - 1) % N, trace_worker.ELEMS * 4 // N
    head = [("send", nxt, 96), ("recv", prv, 96), ("send", (r + 2) % N, 96),
            ("recv", (r - 2) % N, 96)]
    ring = [("send", nxt, chunk), ("recv", prv, chunk)] * (2 * (N - 1))
    return head + ring + [("wait sent", nxt, None), ("wait sent", (r + 2) % N, None)]


def test_the_merged_file_is_trace_event_json(merged):
    _, doc = merged
    jsonschema.validate(doc, EVENT_SCHEMA)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(N)}
    assert [s["rank"] for s in doc["otherData"]["rdmamw"]["merged"]] == list(range(N))


def test_each_rank_has_its_collectives_and_their_steps_in_order(merged):
    _, doc = merged
    for r in range(N):
        mine = spans(doc, r)
        assert {(e["cat"], e["name"]) for e in mine} - {("step", "recv into")} == {
            ("channel", "connect"), ("collective", "allreduce"), ("step", "send"),
            ("step", "recv"), ("step", "wait sent")}
        colls = spans(doc, r, "collective")
        assert [(c["name"], c["args"]) for c in colls] == [
            ("allreduce", {"seq": i + 1, "dtype": "float32", "shape": [trace_worker.ELEMS],
                           "algorithm": "ring", "peers": [(r + 1) % N, (r - 1) % N],
                           "bytes": trace_worker.ELEMS * 4, "op": "sum"})
            for i in range(trace_worker.ALLREDUCES)]
        steps = spans(doc, r, "step")
        for c in colls:
            inside = [s for s in steps if s["args"]["seq"] == c["args"]["seq"]]
            assert all(c["ts"] <= s["ts"] and s["ts"] + s["dur"] <= c["ts"] + c["dur"]
                       for s in inside)
            got = [("recv" if s["name"] == "recv into" else s["name"], s["args"]["peer"],
                    s["args"].get("bytes")) for s in inside]
            assert got == ring_steps(r)
        # the channels open within the first collective, before its first step
        (connect,) = spans(doc, r, "channel")
        assert sorted(connect["args"]["peers"]) == sorted(set(range(N)) - {r})
        assert colls[0]["ts"] <= connect["ts"] and \
            connect["ts"] + connect["dur"] <= steps[0]["ts"]


def test_the_ranks_share_one_clock(merged):
    """Every collective is a barrier (its header round): all ranks are in it at once.
    And a header is received only after its sender sent it."""
    _, doc = merged
    for seq in range(1, trace_worker.ALLREDUCES + 1):
        c = [next(e for e in spans(doc, r, "collective") if e["args"]["seq"] == seq)
             for r in range(N)]
        assert max(e["ts"] for e in c) <= min(e["ts"] + e["dur"] for e in c)
        for r in range(N):
            frm = (r - 1) % N
            sent = next(s for s in spans(doc, frm, "step") if s["args"]["seq"] == seq
                        and s["name"] == "send" and s["args"]["peer"] == r)
            got = next(s for s in spans(doc, r, "step") if s["args"]["seq"] == seq
                       and s["name"].startswith("recv") and s["args"]["peer"] == frm)
            assert sent["ts"] <= got["ts"] + got["dur"]


def test_each_send_step_posts_its_batches_to_its_peer(merged):
    """The channels' batches (the compiled path's records) are on the ranks' clock too:
    each send step of a collective posts a batch on the channel to its peer, inside
    the step; and each rank's batches are on one track per peer."""
    _, doc = merged
    for r in range(N):
        lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
                 if e["ph"] == "M" and e["pid"] == r and e["name"] == "thread_name"
                 and e["args"]["name"].startswith("batches: ")}
        # (a ring allreduce sends to r+1; its header round to r+1 and r+2)
        assert sorted(lanes.values()) == sorted(f"batches: shm to rank {(r + k) % N}"
                                                for k in (1, 2))
        batches = spans(doc, r, "batch")
        assert {b["tid"] for b in batches} == set(lanes)
        for s in spans(doc, r, "step"):
            if s["name"] != "send":
                continue
            inside = [b for b in batches if s["ts"] <= b["ts"] <= s["ts"] + s["dur"]]
            assert {lanes[b["tid"]] for b in inside} == {f"batches: shm to rank "
                                                         f"{s['args']['peer']}"}
            assert sum(b["args"]["messages"] for b in inside) == s["args"]["messages"]


def test_perfettos_trace_processor_reads_every_rank(merged):
    path, doc = merged
    rows = query(path, "select p.pid as pid, s.name as name, s.ts as ts, s.dur as dur "
                 "from slice s join thread_track tt on s.track_id = tt.id join thread "
                 "using(utid) join process p using(upid) order by p.pid, s.ts")
    got = [(row.pid, row.name) for row in rows]
    want = [(e["pid"], e["name"]) for e in doc["traceEvents"] if e["ph"] in "Xi"]
    assert sorted(got) == sorted(want)
    for r in range(N):
        assert [n for p, n in got if p == r and n == "allreduce"] == \
            ["allreduce"] * trace_worker.ALLREDUCES


def test_plot_draws_every_rank_of_a_collective_into_a_png(merged, tmp_path):
    """``rdmamw trace plot`` of the merged file: a PNG with each rank's steps and
    batches of collective #2 (their colours are in it), and a collective the file does
    not have is an error, no PNG."""
    mpimg = pytest.importorskip("matplotlib.image")
    from matplotlib.colors import to_rgb

    from rdmamw.trace import plot
    path, doc = merged
    out = str(tmp_path / "c2.png")
    assert cli.main(["trace", "plot", path, "-o", out, "--collective", "2"]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(out)[:, :, :3]
    img = img[: int(img.shape[0] * 0.75)]          # the lanes (the legend is below)

    def pixels(colour: str) -> int:
        return int((abs(img - to_rgb(colour)).max(axis=2) < 0.02).sum())

    for colour in (plot.BATCH_COLOUR, plot.STEP_COLOURS["send"], plot.STEP_COLOURS["recv"]):
        assert pixels(colour) > 50, colour
    with pytest.raises(SystemExit) as e:
        cli.main(["trace", "plot", path, "-o", str(tmp_path / "no.png"), "--collective",
                  "99"])
    assert e.value.code == 2 and not os.path.exists(tmp_path / "no.png")
