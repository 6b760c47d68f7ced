"""The channels' own part of a timeline: the fixed-size records the compiled path
writes while one is recorded (rdmamw/include/rm_trace.h; one atomic add and a few
stores each, no Python object), turned into trace events only when the file is
written.

A send call is a ``batch`` span from the start of its posting to the completion of
its last chain (the transport's work completion, reaped by the Link), on a track of
its channel; each chain posted (one doorbell) an instant on it. Waits (credit,
arrival, a READ's), the sleeps in the transport and the receiver's side of each
rendezvous message are spans of the thread that waited or received; the sender's
side of a rendezvous message a span from its source's exposure to its done bit, on a
second track of its channel. Spans of one track that overlap (a batch posted before
the previous one completed: verbs) go to further tracks of the same name, so that
every track nests."""

from __future__ import annotations

from typing import Any

import numpy as np

from rdmamw.engine import _engine

#: one record (rm_trace_rec)
DTYPE = np.dtype([("t0", "<i8"), ("t1", "<i8"), ("a", "<u8"), ("b", "<u8"), ("c", "<u8"),
                  ("chan", "<u4"), ("kind", "<u4"), ("tid", "<u4"), ("d", "<u4"),
                  ("e", "<u4"), ("ready", "<u4")])
assert DTYPE.itemsize == _engine.TRACE_RECORD_BYTES
K = _engine.TRACE_KINDS
#: the waits' spans, by kind; ``what`` of a credit wait (rdmamw/engine/_frames.pxd)
WAITS = {K["credit wait"]: "credit wait", K["arrival wait"]: "arrival wait",
         K["read wait"]: "read wait", K["sleep"]: "sleep"}
CREDIT_FOR = ("slots", "rendezvous entry", "done bits")
#: the tracks of channels get thread ids from here up (above any Linux tid: 2^22)
LANE_BASE = 1 << 30


def parse(data: bytes) -> np.ndarray:
    """The records of rdmamw.engine._engine.trace_stop()'s bytes."""
    return np.frombuffer(data, DTYPE)


class Lanes:
    """The channels' tracks: one per (channel, what), and more of the same name where
    spans would overlap (first one free, so each track nests)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.ends: dict[tuple[int, str], list[int]] = {}
        self.tids: dict[tuple[int, str, int], int] = {}

    def place(self, chan: int, what: str, t0: int, t1: int) -> int:
        ends = self.ends.setdefault((chan, what), [])
        for i, end in enumerate(ends):
            if end <= t0:
                ends[i] = t1
                return self.tid(chan, what, i)
        ends.append(t1)
        return self.tid(chan, what, len(ends) - 1)

    def tid(self, chan: int, what: str, i: int) -> int:
        key = (chan, what, i)
        if key not in self.tids:
            self.tids[key] = LANE_BASE + len(self.tids)
        return self.tids[key]

    def metadata(self, pid: int) -> list[dict[str, Any]]:
        out = []
        for (chan, what, i), tid in self.tids.items():
            name = f"{what}: {self.names.get(chan, f'channel {chan}')}"
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": name if i == 0 else f"{name} ({i + 1})"}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
        return out


def _us(ns: int) -> float:
    return ns / 1000


def _span(name: str, cat: str, t0: int, t1: int, pid: int, tid: int,
          args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "ts": _us(t0), "dur": _us(t1 - t0),
            "pid": pid, "tid": tid, "args": args}


def _first_at_least(done: np.ndarray, times: np.ndarray, target: int) -> int | None:
    """The time of the first record whose count reached ``target`` (None: none did)."""
    i = int(np.searchsorted(done, target, side="left"))
    return int(times[i]) if i < len(done) else None


def _progress(recs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A channel's completion (or done) records in time order, their counts made
    non-decreasing (two threads reap: the later reading counts)."""
    recs = recs[np.argsort(recs["t0"], kind="stable")]
    return np.maximum.accumulate(recs["c"]), recs["t0"]


def events(recs: np.ndarray, pid: int, names: dict[int, str]) -> list[dict[str, Any]]:
    """The trace events of ``recs`` (one process's, ``pid`` in the file); ``names``:
    the channels' names by their Engine.trace_id."""
    out: list[dict[str, Any]] = []
    lanes = Lanes(names)
    recs = recs[np.argsort(recs["t0"], kind="stable")]
    kind = recs["kind"]
    for chan in np.unique(recs["chan"]).tolist():
        mine = recs[recs["chan"] == chan]
        out += _batches(mine, pid, lanes, chan)
        out += _rendezvous(mine, pid, lanes, chan)
    for r in recs[np.isin(kind, list(WAITS))]:
        out.append(_wait(r, pid, names))
    for r in recs[kind == K["rndv recv"]]:
        out.append(_span("rndv recv", "rendezvous", int(r["t0"]), int(r["t1"]), pid,
                         int(r["tid"]), {"channel": int(r["chan"]), "index": int(r["a"]),
                                         "bytes": int(r["b"]),
                                         "strategy": "write" if r["d"] else "read"}))
    return lanes.metadata(pid) + out


def _batches(mine: np.ndarray, pid: int, lanes: Lanes, chan: int) -> list[dict[str, Any]]:
    """A batch record (its last chain completed by its end when ``e`` says so, else at
    the first completion record that reached it), a one-chain batch's record (it ends
    at its doorbell, when its chain had completed) and the doorbells of the others."""
    done, when = _progress(mine[mine["kind"] == K["completed"]])
    out = []
    lane_of_chain: dict[int, int] = {}
    bells = [(int(r["t0"]), int(r["a"]), int(r["b"]), int(r["c"]), int(r["d"]))
             for r in mine[mine["kind"] == K["doorbell"]]]
    for r in mine[np.isin(mine["kind"], [K["batch"], K["batch one"]])]:
        t0, t1, last = int(r["t0"]), int(r["t1"]), int(r["c"])
        one = int(r["kind"]) == K["batch one"]
        chains = 1 if one else int(r["d"])
        if one:
            bells.append((t1, int(r["a"]), int(r["d"]), last, 0))
        end = (t1 if one or r["e"] else _first_at_least(done, when, last)) if chains \
            else None
        t_end = t1 if end is None else max(t1, end)
        tid = lanes.place(chan, "batches", t0, t_end)
        for c in range(last - chains + 1, last + 1):
            lane_of_chain[c] = tid
        out.append(_span("batch", "batch", t0, t_end, pid, tid, {
            "channel": chan, "messages": int(r["a"]), "bytes": int(r["b"]),
            "doorbells": chains, "posting_us": _us(t1 - t0),
            "completed": end is not None or not chains}))
    for t, messages, slots, chain, rc in sorted(bells):
        # (one whose send call failed, no batch counted: on the first track)
        tid = lane_of_chain.get(chain, lanes.tid(chan, "batches", 0))
        out.append({"name": "doorbell", "cat": "batch", "ph": "i", "s": "t",
                    "ts": _us(t), "pid": pid, "tid": tid,
                    "args": {"channel": chan, "messages": messages, "slots": slots,
                             "chain": chain,
                             **({"error": int(np.int32(np.uint32(rc)))} if rc else {})}})
    return out


def _rendezvous(mine: np.ndarray, pid: int, lanes: Lanes, chan: int
                ) -> list[dict[str, Any]]:
    done, when = _progress(mine[mine["kind"] == K["rndv done"]])
    out = []
    for r in mine[mine["kind"] == K["rndv expose"]]:
        t0, index = int(r["t0"]), int(r["a"])
        args = {"channel": chan, "index": index, "bytes": int(r["b"]),
                "strategy": "write" if r["d"] else "read"}
        out.append(_span("rndv expose", "rendezvous", t0, int(r["t1"]), pid, int(r["tid"]),
                         args))
        end = _first_at_least(done, when, index + 1)
        if end is not None and end >= t0:
            out.append(_span("rndv", "rendezvous", t0, end, pid,
                             lanes.place(chan, "rendezvous", t0, end), args))
    return out


def _wait(r: Any, pid: int, names: dict[int, str]) -> dict[str, Any]:
    k, chan = int(r["kind"]), int(r["chan"])
    result = int(np.int32(np.uint32(r["d"])))
    args: dict[str, Any] = {"channel": chan, "result": result}
    if chan in names:
        args["peer"] = names[chan]
    if k == K["credit wait"]:
        args["for"] = CREDIT_FOR[int(r["a"])] if int(r["a"]) < len(CREDIT_FOR) else int(r["a"])
    if k == K["sleep"]:
        args = {"channel": chan, "timeout_ms": int(r["a"]), "result": result}
    return _span(WAITS[k], "wait", int(r["t0"]), int(r["t1"]), pid, int(r["tid"]), args)


def thread_ids(recs: np.ndarray) -> list[int]:
    """The threads that wrote records (their spans are on those threads' tracks)."""
    kinds = list(WAITS) + [K["rndv recv"], K["rndv expose"]]
    return [int(t) for t in np.unique(recs["tid"][np.isin(recs["kind"], kinds)])]
