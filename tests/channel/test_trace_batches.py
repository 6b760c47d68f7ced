"""The channels' batches in the timeline (rdmamw/trace/records.py, docs/trace.md): two
channels of a pair send to each other while rdmamw.trace records; the file's batch
spans, per channel, are as many and carry as many messages and bytes as the
channels' own stats() count, in the JSON and as Perfetto's trace processor reads it;
each batch's doorbells are on its track, inside it (a batch of more slots than the
ring: several); a full ring's wait for credit is a span of the sending thread."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import numpy as np
import pytest

import rdmamw.trace
from rdmamw.engine import _engine
from rdmamw.trace import records
from tests.support.helpers import make_pair, provider_param
from tests.support.perfetto import query

ROUNDS = 40


#: the providers with rendezvous (tcp has none)
RENDEZVOUS = ("shm", "verbs")


@pytest.fixture(params=["shm", "tcp", provider_param("verbs")])
def traced(request, tmp_path):
    """(the file, {trace_id: stats()} of both channels, the thread id of the sender
    into a full ring): a pair (8 slots) that sends
    batches of 1 to 5 messages both ways, and rendezvous messages on shm and verbs,
    while a timeline records; then one side sends a batch of more slots than the ring
    (several chains) and 64 batches the other drains late (credit waits). On verbs a
    batch completes when the device reports it, after its send call returned: its span
    ends there."""
    rndv = request.param in RENDEZVOUS
    a, b, lst = make_pair(provider=request.param, slots=8, slot_size=4096,
                          rendezvous="read" if rndv else "off")
    path = str(tmp_path / "t-%p.json")
    tids: dict[str, int] = {}
    try:
        with rdmamw.trace.record(path) as tr:
            for i in range(ROUNDS):
                for x, y in ((a, b), (b, a)):
                    batch = [bytes([i]) * (1 + (i * 7) % 300)] * (1 + i % 5)
                    if rndv and i % 10 == 9:
                        batch.append(np.zeros(20000, np.uint8))     # by rendezvous
                    x.send_batch(batch)
                    got = 0
                    while got < len(batch):
                        ms = y.recv_batch(timeout=10)
                        got += len(ms)
                        for m in ms:
                            m.release()
            drain = threading.Thread(target=_drain, args=(b, 64 + len(LONG)))
            sender = threading.Thread(target=_send, args=(a, 64, tids))
            sender.start()
            threading.Event().wait(0.05)        # the ring fills up first
            drain.start()
            sender.join(30)
            drain.join(30)
        out = tr.path.replace("%p", str(os.getpid()))
        yield out, {a.trace_id: a.stats(), b.trace_id: b.stats()}, tids["sender"]
    finally:
        a.close()
        b.close()
        lst.close()


#: the full ring's sender's first batch: more slots than the ring's 8 (several chains)
LONG = [b"y" * 3000] * 20


def _send(ch, n: int, tids: dict[str, int]) -> None:
    tids["sender"] = threading.get_native_id()
    ch.send_batch(LONG)
    for i in range(n):
        ch.send_batch([b"z" * (i + 1)])


def _drain(ch, n: int) -> None:
    got = 0
    while got < n:
        ms = ch.recv_batch(timeout=10)
        got += len(ms)
        for m in ms:
            m.release()


def ns(us: float) -> int:
    return round(us * 1000)


def want(stats: dict[int, dict]) -> dict[int, tuple[int, int, int]]:
    return {cid: (s["batches"], s["messages"], s["bytes"]) for cid, s in stats.items()}


def test_the_batch_spans_are_the_channels_batches(traced):
    path, stats, sender = traced
    with open(path) as f:
        doc = json.load(f)
    assert doc["otherData"]["rdmamw"]["records_dropped"] == 0
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "batch"]
    got: dict[int, list[int]] = {}
    for e in spans:
        acc = got.setdefault(e["args"]["channel"], [0, 0, 0])
        acc[0] += 1
        acc[1] += e["args"]["messages"]
        acc[2] += e["args"]["bytes"]
    assert {cid: tuple(v) for cid, v in got.items()} == want(stats)
    assert all(e["args"]["completed"] for e in spans)
    # each doorbell on its batch's track, inside it (in ns, as Perfetto reads the µs: a
    # one-chain batch ends at its doorbell); as many as the batches say
    bells = [e for e in doc["traceEvents"] if e["name"] == "doorbell"]
    for e in bells:
        assert any(b["tid"] == e["tid"] and
                   ns(b["ts"]) <= ns(e["ts"]) <= ns(b["ts"]) + ns(b["dur"]) for b in spans)
    assert len(bells) == sum(e["args"]["doorbells"] for e in spans)
    assert max(e["args"]["doorbells"] for e in spans) > 1        # (the long batch)
    assert sum(e["args"]["messages"] for e in bells) == sum(
        s["messages"] for s in stats.values())
    # the full ring's sender waited for credit, on its own thread's track
    waits = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == sender
             and e["name"] == "credit wait"]
    assert waits and all(e["args"]["for"] == "slots" for e in waits)


def test_rendezvous_phases(traced):
    path, stats, _ = traced
    sent = sum(s["rndv_sends"] for s in stats.values())
    if not sent:
        pytest.skip("rendezvous is off on this provider's pair")
    with open(path) as f:
        doc = json.load(f)
    names = Counter(e["name"] for e in doc["traceEvents"] if e.get("cat") == "rendezvous")
    assert names["rndv expose"] == sent
    assert names["rndv recv"] == sum(s["rndv_received"] for s in stats.values()) == sent


def test_perfettos_trace_processor_counts_the_same(traced):
    path, stats, _ = traced
    rows = query(path, "select extract_arg(arg_set_id, 'args.channel') as chan, "
                       "count(*) as n, sum(extract_arg(arg_set_id, 'args.messages')) as m, "
                       "sum(extract_arg(arg_set_id, 'args.bytes')) as b from slice "
                       "where name = 'batch' group by chan")
    assert {int(r.chan): (int(r.n), int(r.m), int(r.b)) for r in rows} == want(stats)


def test_past_the_capacity_the_latest_records_are_kept(tmp_path, monkeypatch):
    """RDMAMW_TRACE_MAX_RECORDS=10 (a ring of 16 slots, three times round): on shm each
    single-message send writes one record (a batch posted in one chain that completed
    within its post; its chain is its number from 1), so of 50 sends of 1 to 50 bytes
    the file keeps the last 10, in order (sends 41 to 50), and counts the 40 before
    them as dropped."""
    monkeypatch.setenv("RDMAMW_TRACE_MAX_RECORDS", "10")
    a, b, lst = make_pair(provider="shm")
    try:
        with rdmamw.trace.record(str(tmp_path / "t.json")) as tr:
            for i in range(50):
                a.send(b"m" * (i + 1))
                b.recv(timeout=10).release()
    finally:
        a.close()
        b.close()
        lst.close()
    k = _engine.TRACE_KINDS
    recs = records.parse(tr.records)
    assert recs["kind"].tolist() == [k["batch one"]] * 10
    assert (recs["b"].tolist(), recs["c"].tolist()) == (list(range(41, 51)),) * 2
    with open(tmp_path / "t.json") as f:
        doc = json.load(f)
    assert doc["otherData"]["rdmamw"]["records_dropped"] == 40
    spans = sorted((e for e in doc["traceEvents"] if e.get("cat") == "batch"
                    and e["ph"] == "X"), key=lambda e: e["ts"])
    assert [e["args"]["bytes"] for e in spans] == list(range(41, 51))
    bells = sorted((e for e in doc["traceEvents"] if e["name"] == "doorbell"),
                   key=lambda e: e["ts"])
    assert [(e["args"]["chain"], e["args"]["messages"], e["args"]["slots"]) for e in bells] \
        == [(c, 1, 1) for c in range(41, 51)]


def test_a_send_that_fails_after_a_doorbell_leaves_it_in_the_timeline(tmp_path):
    """A batch of more slots than the ring, nobody receiving: its first chain (the 8
    free slots) is posted, then its wait for credit times out: no batch span, but that
    doorbell, on the channel's track, in the file."""
    a, b, lst = make_pair(provider="shm", slots=8, slot_size=4096)
    try:
        with rdmamw.trace.record(str(tmp_path / "t.json")):
            with pytest.raises(rdmamw.Timeout) as e:
                a.send_batch(LONG, timeout=0.2)
    finally:
        a.close()
        b.close()
        lst.close()
    with open(tmp_path / "t.json") as f:
        doc = json.load(f)
    assert not [e for e in doc["traceEvents"] if e["name"] == "batch"]
    bells = [e["args"] for e in doc["traceEvents"] if e["name"] == "doorbell"]
    assert bells == [{"channel": a.trace_id, "messages": e.value.sent, "slots": 8,
                      "chain": 1}]
    assert e.value.sent == 8
