"""The channels' records into trace events (rdmamw/trace/records.py), from records made
here: a batch span ends at the completion of its last chain (verbs: after its call
returned), overlapping batches of one channel go to a second track of the same name so
that each track nests, each doorbell on its batch's track; a batch whose completion
was not seen ends with its posting and says so."""

from __future__ import annotations

from typing import Any

import numpy as np

from rdmamw.trace import records

K = records.K


def recs(*rows: tuple[Any, ...]) -> np.ndarray:
    """Records of (kind, chan, t0, t1, a, b, c, d[, e]), tid 7."""
    out = np.zeros(len(rows), records.DTYPE)
    for i, (kind, chan, t0, t1, a, b, c, d, *e) in enumerate(rows):
        out[i] = (t0, t1, a, b, c, chan, K[kind], 7, d, e[0] if e else 0, 1)
    return out


def test_overlapping_batches_of_a_channel_go_to_two_tracks_that_each_nest() -> None:
    got = records.events(recs(
        ("doorbell", 3, 5_000, 5_000, 2, 1, 1, 0),
        ("batch", 3, 1_000, 10_000, 2, 16, 1, 1),         # chain 1: 2 messages
        ("doorbell", 3, 25_000, 25_000, 1, 1, 2, 0),
        ("batch", 3, 20_000, 30_000, 1, 8, 2, 1),         # chain 2, before 1 completed
        ("completed", 3, 50_000, 50_000, 0, 0, 1, 0),
        ("completed", 3, 60_000, 60_000, 0, 0, 2, 0),
        ("batch", 3, 70_000, 80_000, 4, 32, 3, 1),        # chain 3: never completed
        ("doorbell", 3, 75_000, 75_000, 4, 1, 3, 0),
    ), pid=0, names={3: "verbs to rank 1"})
    tracks = {e["tid"]: e["args"]["name"] for e in got if e["name"] == "thread_name"}
    assert sorted(tracks.values()) == ["batches: verbs to rank 1",
                                       "batches: verbs to rank 1 (2)"]
    first = next(t for t, n in tracks.items() if not n.endswith("(2)"))
    spans = [(tracks[e["tid"]] == tracks[first], e["ts"], e["dur"], e["args"]["messages"],
              e["args"]["completed"]) for e in got if e["name"] == "batch"]
    assert spans == [(True, 1.0, 49.0, 2, True), (False, 20.0, 40.0, 1, True),
                     (True, 70.0, 10.0, 4, False)]
    bells = [(e["tid"], e["ts"], e["args"]["chain"]) for e in got if e["name"] == "doorbell"]
    batch_tid = {e["args"]["messages"]: e["tid"] for e in got if e["name"] == "batch"}
    assert bells == [(batch_tid[2], 5.0, 1), (batch_tid[1], 25.0, 2), (batch_tid[4], 75.0, 3)]


def test_waits_are_spans_of_the_waiting_thread() -> None:
    got = records.events(recs(
        ("credit wait", 2, 1_000, 9_000, 0, 0, 0, 1),
        ("sleep", 2, 2_000, 8_000, 20, 0, 0, 1),
        ("arrival wait", 2, 10_000, 11_000, 3, 0, 0, 0xFFFFFFFF),
    ), pid=0, names={})
    assert [(e["name"], e["tid"], e["ts"], e["dur"], e["args"]) for e in got] == [
        ("credit wait", 7, 1.0, 8.0, {"channel": 2, "result": 1, "for": "slots"}),
        ("sleep", 7, 2.0, 6.0, {"channel": 2, "timeout_ms": 20, "result": 1}),
        ("arrival wait", 7, 10.0, 1.0, {"channel": 2, "result": -1})]


def test_a_batch_whose_chain_completed_within_its_call_ends_there() -> None:
    """One record for a batch posted in one chain that completed within its post (shm,
    tcp): its span ends at its doorbell, the doorbell on its track; a batch record
    that says its last chain had completed by its end (e = 1) ends there too, without
    a completion record; one that does not waits for one."""
    got = records.events(recs(
        ("batch one", 4, 1_000, 3_000, 2, 16, 1, 1),      # chain 1: 2 messages, 1 slot
        ("doorbell", 4, 5_000, 5_000, 3, 2, 2, 0),
        ("doorbell", 4, 6_000, 6_000, 1, 1, 3, 0),
        ("batch", 4, 4_000, 7_000, 4, 32, 3, 2, 1),       # chains 2, 3: done by t1
        ("doorbell", 4, 9_000, 9_000, 1, 1, 4, 0),
        ("batch", 4, 8_000, 10_000, 1, 8, 4, 1, 0),       # chain 4: done later
        ("completed", 4, 12_000, 12_000, 0, 0, 4, 0),
    ), pid=0, names={4: "shm to rank 1"})
    spans = [(e["ts"], e["dur"], e["args"]["messages"], e["args"]["doorbells"],
              e["args"]["posting_us"], e["args"]["completed"], e["tid"])
             for e in got if e["name"] == "batch"]
    tid = spans[0][-1]
    assert spans == [(1.0, 2.0, 2, 1, 2.0, True, tid), (4.0, 3.0, 4, 2, 3.0, True, tid),
                     (8.0, 4.0, 1, 1, 2.0, True, tid)]
    bells = [(e["tid"], e["ts"], e["args"]) for e in got if e["name"] == "doorbell"]
    assert bells == [
        (tid, 3.0, {"channel": 4, "messages": 2, "slots": 1, "chain": 1}),
        (tid, 5.0, {"channel": 4, "messages": 3, "slots": 2, "chain": 2}),
        (tid, 6.0, {"channel": 4, "messages": 1, "slots": 1, "chain": 3}),
        (tid, 9.0, {"channel": 4, "messages": 1, "slots": 1, "chain": 4})]
