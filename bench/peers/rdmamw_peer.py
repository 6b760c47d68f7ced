"""rdmamw over the shm provider, in mode "batched" (bitmaps) or "ack" (the baseline).

Usage (started by bench/run.py): rdmamw_peer.py a|b CONFIG_JSON.
Role b listens and accepts (the accepting side follows the opener's mode) and serves:
echo for ping-pong, count for streams, and the idle-receiver CPU check. Role a opens
the channel in cfg["mode"], drives every phase and prints the result. Control
messages are JSON over the same channel, outside the timed regions. The sender's
stats() are sampled around each stream phase so signaled completions, doorbells and
reclaim write-backs per message come from the same traffic that was timed.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque

import numpy as np
from common import (
    STOP,
    aligned,
    cpu_seconds,
    emit,
    latency_summary,
    load_config,
    pin,
    rate_summary,
    run_phases,
)

import rdmamw

WINDOW = 8  # batches in flight before the sender waits on the oldest handle


def ring(cfg: dict) -> dict:
    """Ring geometry used by both sides (each side receives on its own ring)."""
    return {"slots": cfg["slots"], "slot_size": cfg["slot_size"]}


def send_json(ch, obj: dict) -> None:
    """Control message (not timed)."""
    ch.send(json.dumps(obj).encode()).wait(timeout=30)


def recv_json(ch, timeout: float = 60) -> dict:
    """Control message (not timed); releases the slot at once."""
    with ch.recv(timeout=timeout) as m:
        return json.loads(bytes(m))


def idle_cpu(seconds: float, ch) -> dict:
    """CPU used while blocked in ch.recv(timeout) with no traffic (spin, then sleep)."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    outcome = "timeout"
    try:
        m = ch.recv(timeout=seconds)
        m.release()
        outcome = "unexpected message"
    except rdmamw.Timeout:
        pass
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    pct = 100 * cpu / wall
    return {"seconds": wall, "cpu_seconds": cpu, "cpu_percent": pct, "outcome": outcome}


def serve(cfg: dict) -> None:
    """Role b: accept one channel and obey its commands until told to stop."""
    lst = rdmamw.listen(cfg["address"], **ring(cfg))
    ch = lst.accept(timeout=30)
    while True:
        cmd = recv_json(ch)
        op = cmd["op"]
        if op == "done":
            break
        if op == "idle":
            send_json(ch, idle_cpu(cmd["seconds"], ch))
        elif op == "lat":
            send_json(ch, {"ready": True})
            recv, send = ch.recv, ch.send
            while True:
                m = recv()
                if len(m) == 1:
                    m.release()
                    break
                send(m).wait()  # the echo sends straight from our ring slot
                m.release()
        elif op == "stream_many":
            serve_many(ch)
        elif op == "stream":
            send_json(ch, {"ready": True})
            recv_batch = ch.recv_batch
            n = 0
            while True:
                msgs = recv_batch()
                if not msgs:
                    continue
                n += len(msgs)
                last = len(msgs[-1])
                del msgs  # zero-copy consumer: the slots go back as the views are collected
                if last == 1:
                    break
            send_json(ch, {"count": n - 1})
    ch.close()
    lst.close()


def serve_many(ch) -> None:
    """Count a stream received by recv_many_into (the messages copied into one buffer,
    their lengths into one array: no object per message) up to the 1-byte sentinel."""
    buf, lens = bytearray(1 << 22), np.zeros(1 << 16, np.uint32)
    send_json(ch, {"ready": True})
    recv_many_into = ch.recv_many_into
    n = 0
    while True:
        k = recv_many_into(buf, lens)
        n += k
        if lens[k - 1] == 1:
            break
    send_json(ch, {"count": n - 1})


def ping_pong(ch, size: int, cfg: dict) -> dict:
    """Time-bounded send/recv ping-pong; every round trip is stamped."""
    buf = aligned(size)
    send_json(ch, {"op": "lat", "size": size})
    recv_json(ch)
    stamps: list[int] = []
    append = stamps.append
    clock = time.perf_counter_ns
    t = clock()
    append(t)
    deadline = t + int((cfg["lat_warmup_seconds"] + cfg["lat_seconds"]) * 1e9)
    left = cfg["lat_max_iters"]
    send, recv = ch.send, ch.recv
    while t < deadline and left:
        send(buf)
        recv().release()
        t = clock()
        append(t)
        left -= 1
    ch.send(STOP).wait(timeout=30)
    return latency_summary(stamps, int(cfg["lat_warmup_seconds"] * 1e9))


def stream_once(ch, send_batch, batch, k: int, seconds: float, op: str = "stream") -> dict:
    """Stream send_batch(batch) (k messages) for `seconds` with a window of handles,
    then the sentinel; the receiver serves `op`."""
    send_json(ch, {"op": op, "batch": k})
    recv_json(ch)
    handles: deque = deque()
    push, pop = handles.append, handles.popleft
    clock = time.perf_counter
    t0 = clock()
    deadline = t0 + seconds
    sent = 0
    while True:
        push(send_batch(batch))
        if len(handles) > WINDOW:
            pop().wait()
        sent += k
        if clock() >= deadline:
            break
    ch.send(STOP)
    for h in handles:
        h.wait()
    count = recv_json(ch)["count"]
    return {"messages": count, "sent": sent, "seconds": clock() - t0}


def delta(before: dict, after: dict) -> dict:
    """Counter differences over one phase."""
    return {k: after[k] - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


def stream(ch, size: int, k: int, runs: int, seconds: float, many: bool = False) -> dict:
    """One discarded warm-up run, then `runs` measured runs with sender counters.
    ``many``: send_many of one buffer of k messages, received by recv_many_into."""
    if many:
        send_many = ch.send_many

        def send(data):     # (a partial with a keyword would copy a dict per call)
            return send_many(data, size=size)
        batch: object = aligned(size * k)
    else:
        # one buffer k times: the source is never written while in flight
        send, batch = ch.send_batch, [aligned(size)] * k
    op = "stream_many" if many else "stream"
    stream_once(ch, send, batch, k, min(seconds, 0.1), op)
    before = ch.stats()
    out = rate_summary([stream_once(ch, send, batch, k, seconds, op) for _ in range(runs)],
                       size)
    d = delta(before, ch.stats())
    msgs = max(d.get("messages", 0), 1)
    out["sender_stats"] = d
    for key in ("signaled_completions", "doorbells", "reclaim_writebacks", "batches"):
        if key in d:
            out[f"{key}_per_msg"] = d[key] / msgs
    return out


def open_channel(cfg: dict):
    """Open in cfg["mode"]; Channel.open itself retries until the listener is up."""
    return rdmamw.Channel.open(cfg["address"], mode=cfg["mode"], timeout=30, **ring(cfg))


def drive(cfg: dict) -> None:
    """Role a: run the phases and print the result."""
    ch = open_channel(cfg)
    many = cfg.get("api") == "many"
    out: dict = {
        "system": f"rdmamw-{cfg['mode']}" + ("-many" if many else ""),
        "mode": ch.mode,
        "eager_limit": ch.eager_limit,
        "batch_semantics": (f"send_many(one buffer, size=s) of k, recv_many_into, window "
                            f"of {WINDOW} handles" if many else
                            f"send_batch([buf]*k), window of {WINDOW} handles"),
    }
    out.update(run_phases(cfg, lambda size: ping_pong(ch, size, cfg),
                          lambda *a: stream(ch, *a, many=many)))
    if "idle" in cfg["phases"]:
        send_json(ch, {"op": "idle", "seconds": cfg["idle_seconds"]})
        out["idle"] = recv_json(ch, timeout=cfg["idle_seconds"] + 60)
    out["stats_total"] = ch.stats()
    send_json(ch, {"op": "done"})
    ch.close()
    emit(out)


def main() -> None:
    """Entry point: pin, then serve (b) or drive (a)."""
    role = sys.argv[1]
    cfg = load_config()
    pin(0 if role == "a" else 1)
    (drive if role == "a" else serve)(cfg)


if __name__ == "__main__":
    main()
