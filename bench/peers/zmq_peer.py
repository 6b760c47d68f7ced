"""pyzmq over ipc:// -- the "sleeping" peer rdmamw is compared against.

Usage (started by bench/run.py): zmq_peer.py a|b CONFIG_JSON.
Role b binds and serves (echo / count), role a drives every phase and prints the result.
Ping-pong uses a PAIR socket (it also carries control), streams use PUSH/PULL with
default high-water marks. A "batch of k" is k single-part messages sent back-to-back:
zmq has no batch call for independent messages (send_multipart would make one
message of k frames, which is a different contract), and zmq already coalesces
queued messages into one write.
"""

from __future__ import annotations

import sys
import time

import zmq
from common import STOP, aligned, emit, latency_summary, load_config, pin, rate_summary, run_phases

ZERO_COPY_MIN = 65536  # pyzmq's own copy threshold: below it copying is cheaper


def serve(cfg: dict) -> None:
    """Role b: obey commands on the PAIR socket until told to stop."""
    ctx = zmq.Context()
    pair = ctx.socket(zmq.PAIR)
    pair.bind(cfg["endpoint"] + "-pair")
    pull = ctx.socket(zmq.PULL)
    pull.bind(cfg["endpoint"] + "-stream")
    while True:
        cmd = pair.recv_json()
        op = cmd["op"]
        if op == "done":
            break
        if op == "hello":
            pair.send_json({"ok": True})
        elif op == "lat":
            copy = cmd["size"] < ZERO_COPY_MIN
            pair.send_json({"ready": True})
            while True:
                m = pair.recv(copy=copy)
                if len(m) == 1:
                    break
                pair.send(m, copy=copy)
        elif op == "stream":
            copy = cmd["size"] < ZERO_COPY_MIN
            pair.send_json({"ready": True})
            n = 0
            while True:
                m = pull.recv(copy=copy)
                if len(m) == 1:
                    break
                n += 1
            pair.send_json({"count": n})
    pair.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def ping_pong(pair, size: int, cfg: dict) -> dict:
    """Time-bounded ping-pong; every round trip is stamped."""
    buf = aligned(size)
    copy = size < ZERO_COPY_MIN
    pair.send_json({"op": "lat", "size": size})
    pair.recv_json()
    stamps = []
    append = stamps.append
    clock = time.perf_counter_ns
    t = clock()
    append(t)
    deadline = t + int((cfg["lat_warmup_seconds"] + cfg["lat_seconds"]) * 1e9)
    left = cfg["lat_max_iters"]
    send, recv = pair.send, pair.recv
    while t < deadline and left:
        send(buf, copy=copy)
        recv(copy=copy)
        t = clock()
        append(t)
        left -= 1
    pair.send(STOP)
    return latency_summary(stamps, int(cfg["lat_warmup_seconds"] * 1e9))


def stream_once(pair, push, buf, k: int, seconds: float) -> dict:
    """Stream batches of k for `seconds`, then the sentinel; time until b's count arrives."""
    copy = buf.nbytes < ZERO_COPY_MIN
    pair.send_json({"op": "stream", "size": buf.nbytes, "batch": k})
    pair.recv_json()
    send = push.send
    batch = range(k)
    clock = time.perf_counter
    t0 = clock()
    deadline = t0 + seconds
    sent = 0
    while True:
        for _ in batch:
            send(buf, copy=copy)
        sent += k
        if clock() >= deadline:
            break
    push.send(STOP)
    count = pair.recv_json()["count"]
    return {"messages": count, "sent": sent, "seconds": clock() - t0}


def stream(pair, push, size: int, k: int, runs: int, seconds: float) -> dict:
    """One discarded warm-up run, then `runs` measured runs."""
    buf = aligned(size)
    stream_once(pair, push, buf, k, min(seconds, 0.1))
    return rate_summary([stream_once(pair, push, buf, k, seconds) for _ in range(runs)], size)


def drive(cfg: dict) -> None:
    """Role a: run the phases and print the result."""
    ctx = zmq.Context()
    pair = ctx.socket(zmq.PAIR)
    pair.connect(cfg["endpoint"] + "-pair")
    push = ctx.socket(zmq.PUSH)
    push.connect(cfg["endpoint"] + "-stream")
    pair.send_json({"op": "hello"})
    pair.recv_json()
    out: dict = {"system": "zmq", "batch_semantics": "k back-to-back send() calls"}
    out.update(run_phases(cfg, lambda size: ping_pong(pair, size, cfg),
                          lambda *a: stream(pair, push, *a)))
    pair.send_json({"op": "done"})
    pair.close(linger=1000)
    push.close(linger=0)
    ctx.term()
    emit(out)


def main() -> None:
    """Entry point: pin, then serve (b) or drive (a)."""
    role = sys.argv[1]
    cfg = load_config()
    pin(0 if role == "a" else 1)
    (drive if role == "a" else serve)(cfg)


if __name__ == "__main__":
    main()
