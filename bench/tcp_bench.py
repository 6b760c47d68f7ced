"""tcp in one run: rdmamw batched vs its per-message ack baseline, against pyzmq
tcp://, raw Python sockets and iperf3 (the loopback limit), all over 127.0.0.1.

Each case is a receiver process and a sender process; a rate is messages (or bytes)
the receiver got, from the sender's start to the receiver's last message (both read
CLOCK_MONOTONIC). Other jobs share this machine: compare ratios within one run.

    .venv/bin/python bench/tcp_bench.py [--seconds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import time

from rdmamw.bootstrap.launch import free_port

BIG = 65536
SMALL = 8


# ---- receivers (child processes): put ("addr", x) then ("done", t_end, count) ----

def rx_rdmamw(q, mode: str, total: int, scheme: str = "tcp", spin_us: float = 100.0) -> None:
    import rdmamw
    where = "tcp://127.0.0.1:0" if scheme == "tcp" else f"shm://bench-{os.getpid()}"
    lst = rdmamw.listen(where, slots=128, slot_size=BIG, spin_us=spin_us)
    q.put(("addr", lst.address))
    ch = lst.accept(timeout=60)
    n = 0
    while n < total:
        n += len(ch.recv_batch(timeout=60))
    q.put(("done", time.monotonic(), n))
    try:
        ch.recv_batch(timeout=60)       # wait for the sender's close
    except rdmamw.ChannelClosed:
        pass
    ch.close()


def rx_zmq(q, size: int, total: int) -> None:
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 100000)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    q.put(("addr", f"tcp://127.0.0.1:{port}"))
    recv = s.recv
    for _ in range(total):
        recv(copy=size < 4096)
    q.put(("done", time.monotonic(), total))
    s.close(linger=0)
    ctx.term()


def rx_socket(q, size: int, total: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    q.put(("addr", srv.getsockname()[1]))
    c, _ = srv.accept()
    buf = bytearray(1 << 20)
    want, got = total * size, 0
    while got < want:
        k = c.recv_into(buf)
        if not k:
            break
        got += k
    q.put(("done", time.monotonic(), got // size))
    c.close()


# ---- senders (this process) ---------------------------------------------------------

def tx_rdmamw(addr: str, mode: str, size: int, total: int, batch: int,
              spin_us: float = 100.0) -> float:
    import numpy as np

    import rdmamw
    ch = rdmamw.Channel.open(addr, mode=mode, timeout=30, slots=16, slot_size=4096,
                             spin_us=spin_us)
    msgs = [np.full(size, 1, np.uint8).tobytes()] * batch
    t0 = time.monotonic()
    for _ in range(total // batch):
        ch.send_batch(msgs)
    ch.close()
    return t0


def tx_zmq(addr: str, size: int, total: int) -> float:
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 100000)
    s.connect(addr)
    msg = b"x" * size
    send = s.send
    time.sleep(0.2)                     # let the connection come up
    t0 = time.monotonic()
    for _ in range(total):
        send(msg, copy=size < 4096)
    s.close(linger=-1)
    ctx.term()
    return t0


def tx_socket(port: int, size: int, total: int) -> float:
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * size
    t0 = time.monotonic()
    send = c.sendall
    for _ in range(total):
        send(msg)
    c.close()
    return t0


def run_case(rx, rx_args: tuple, tx, tx_args: tuple) -> tuple[float, int]:
    """(seconds, messages) of one sender/receiver pair."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=rx, args=(q, *rx_args))
    p.start()
    kind, addr = q.get(timeout=60)
    t0 = tx(addr, *tx_args)
    kind, t_end, n = q.get(timeout=300)
    p.join(60)
    return t_end - t0, n


def iperf3(seconds: float) -> float | None:
    """Single-stream loopback bytes/s, or None without iperf3."""
    if shutil.which("iperf3") is None:
        return None
    port = str(free_port())
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-p", port], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", port, "-t",
                                  str(max(1, round(seconds))), "-J"],
                                 capture_output=True, text=True)
            end = json.loads(out.stdout or "{}").get("end", {}) if out.returncode == 0 else {}
            if "sum_received" in end:
                return end["sum_received"]["bits_per_second"] / 8
            time.sleep(0.1)
        return None
    finally:
        srv.kill()
        srv.wait()


def cases(seconds: float) -> list[tuple]:
    """(name, size, receiver, its args, sender, its args), each sized to run ~seconds."""
    big = max(1024, int(seconds * 3e9 / BIG) // 64 * 64)        # ~3 GB/s guess
    small = max(1 << 20, int(seconds * 8e6) // 4096 * 4096)     # ~8 M msg/s guess
    out = [
        ("rdmamw tcp batched 64 KiB x16", BIG, rx_rdmamw, ("batched", big), tx_rdmamw,
         ("batched", BIG, big, 16)),
        ("rdmamw tcp ack 64 KiB", BIG, rx_rdmamw, ("ack", big // 4), tx_rdmamw,
         ("ack", BIG, big // 4, 1)),
        ("raw socket sendall 64 KiB", BIG, rx_socket, (BIG, big), tx_socket, (BIG, big)),
        ("rdmamw tcp batched 8 B x4096", SMALL, rx_rdmamw, ("batched", small), tx_rdmamw,
         ("batched", SMALL, small, 4096)),
        ("rdmamw tcp ack 8 B", SMALL, rx_rdmamw, ("ack", small // 64), tx_rdmamw,
         ("ack", SMALL, small // 64, 1)),
        ("raw socket sendall 8 B", SMALL, rx_socket, (SMALL, small // 8), tx_socket,
         (SMALL, small // 8)),
    ]
    try:
        import zmq  # noqa: F401
    except ImportError:
        return out
    return out + [
        ("pyzmq tcp:// 64 KiB", BIG, rx_zmq, (BIG, big), tx_zmq, (BIG, big)),
        ("pyzmq tcp:// 8 B", SMALL, rx_zmq, (SMALL, small // 4), tx_zmq, (SMALL, small // 4)),
    ]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="rough length of each case")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds; each case reports its best round")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    todo = cases(args.seconds)
    best: dict[str, float] = {}          # name -> best messages/s (iperf3: bytes/s)
    size = {name: sz for name, sz, *_ in todo} | {"iperf3 single stream": 1}
    print(f"tcp bench on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"best of {args.rounds} interleaved rounds")
    for r in range(args.rounds):
        bw = iperf3(args.seconds)
        if bw:
            best["iperf3 single stream"] = max(bw, best.get("iperf3 single stream", 0))
        line = [f"iperf3 {bw / 1e9 if bw else 0:.2f} GB/s"]
        for name, _sz, rx, rx_args, tx, tx_args in todo:
            dt, n = run_case(rx, rx_args, tx, tx_args)
            best[name] = max(n / dt, best.get(name, 0))
            line.append(f"{name.split(' x')[0]} {n / dt / 1e6:.3f}M")
        print(f"  round {r + 1}: " + ", ".join(line), flush=True)
    print(f"  {'case':34s} {'M msg/s':>9s} {'GB/s':>7s}")
    for name, rate in best.items():
        msgs = "" if name.startswith("iperf3") else f"{rate / 1e6:9.3f}"
        print(f"  {name:34s} {msgs:>9s} {rate * size[name] / 1e9:7.2f}")
    big_bw = best["rdmamw tcp batched 64 KiB x16"] * BIG
    small = best["rdmamw tcp batched 8 B x4096"]
    ratios = {
        "64KiB batched / iperf3": ratio(big_bw, best.get("iperf3 single stream")),
        "64KiB batched / ack": ratio(big_bw, best["rdmamw tcp ack 64 KiB"] * BIG),
        "64KiB batched / pyzmq": ratio(big_bw, best.get("pyzmq tcp:// 64 KiB", 0) * BIG),
        "64KiB batched / raw socket": ratio(big_bw, best["raw socket sendall 64 KiB"] * BIG),
        "8B batched M msg/s": small / 1e6,
        "8B batched / ack": ratio(small, best["rdmamw tcp ack 8 B"]),
        "8B batched / pyzmq": ratio(small, best.get("pyzmq tcp:// 8 B")),
        "8B batched / raw socket": ratio(small, best["raw socket sendall 8 B"]),
    }
    print("ratios (targets: 64 KiB >= 0.90 x iperf3; 8 B >= 5 M msg/s and >= 5 x pyzmq)")
    for k, v in ratios.items():
        print(f"  {k:28s} {'n/a' if v is None else f'{v:8.2f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"best_per_s": best, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
