"""Batched vs per-message-ack on the verbs provider, in one run, as ratios.

Run inside the soft-RoCE VM (`make bench-verbs`, i.e. scripts/rxe-vm.sh): TCG makes
absolute speed meaningless, so what counts is the ratio between the modes of
messages/s, doorbells (ibv_post_send calls), signaled completions and CPU seconds
per message. One sender and one receiver process; 8-byte messages by default. First,
the doorbells per batch of a fresh channel whose ring grows (50 and 200 batches),
beside one whose ring is registered whole at connect.

    bench/verbs_rxe.py [--seconds 3] [--size 8] [--batch 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time

import rdmamw


def receiver(address: str, ready, out) -> None:
    """Receive and release until the sender closes; report count, stats, CPU time."""
    with rdmamw.listen(address, slots=128, slot_size=65536) as lst:
        ready.put(lst.address)
        ch = lst.accept(timeout=60)
        c0, n = time.process_time(), 0
        while True:
            try:
                msgs = ch.recv_batch(timeout=30)
            except rdmamw.ChannelClosed:
                break
            n += len(msgs)
            del msgs
        out.put((n, ch.stats(), time.process_time() - c0))
        ch.close()


def run(mode: str, size: int, batch: int, seconds: float, opts: str) -> dict:
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(f"verbs://127.0.0.1:0{opts}", ready, out))
    proc.start()
    try:
        address = ready.get(timeout=120)
        ch = rdmamw.Channel.open(address + opts, mode=mode, timeout=60, slots=16, slot_size=4096)
        msgs = [os.urandom(size)] * batch
        sent, c0, t0 = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            ch.send_batch(msgs)
            sent += batch
        st = ch.stats()
        cpu = time.process_time() - c0
        ch.close()
        received, rst, rcpu = out.get(timeout=120)
        wall = time.perf_counter() - t0
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if received != sent:
        raise SystemExit(f"{mode}: sent {sent} but {received} arrived")
    return {"mode": mode, "size": size, "batch": batch, "messages": sent, "seconds": wall,
            "msgs_per_s": sent / wall, "doorbells_per_msg": st["doorbells"] / sent,
            "post_sends_per_batch": st["doorbells"] / st["batches"],
            "wakeups_per_batch": st["wakeups_sent"] / st["batches"],
            "signaled_per_msg": st["signaled_completions"] / sent,
            "cpu_s_per_msg": (cpu + rcpu) / sent,
            "receiver_writebacks_per_msg": rst["reclaim_writebacks"] / sent}


def fresh(batches: int, opts: str, window: int = 32) -> float:
    """Doorbells per batch of a fresh channel at default settings (its ring grows
    unless opts say otherwise) sending ``batches`` batches of 256 x 8 B, at most
    ``window`` batches ahead of the receiver, which reads in a thread (further ahead,
    a receiver slower than the sender fills even the whole ring: credit waits that
    are not the ring growing). The bytes are compared whole."""
    lst = rdmamw.listen("verbs://127.0.0.1:0" + opts)
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("c", lst.accept(timeout=60)))
    t.start()
    ch = rdmamw.Channel.open(lst.address + opts, timeout=60)
    t.join(60)
    rx, out, more = got["c"], [], threading.Condition()

    def receive() -> None:
        while len(out) < 256 * batches:
            for m in rx.recv_batch(timeout=60):
                out.append(bytes(m))
                m.release()
            with more:
                more.notify()

    r = threading.Thread(target=receive)
    r.start()
    batch = [i.to_bytes(8, "little") for i in range(256)]
    for i in range(batches):
        with more:
            more.wait_for(lambda i=i: len(out) >= 256 * (i - window), timeout=60)
        ch.send_batch(batch)
    r.join(120)
    st = ch.stats()
    ch.close(), rx.close(), lst.close()
    if out != batch * batches:
        raise SystemExit(f"fresh channel: {len(out)} of {256 * batches} messages arrived right")
    return st["doorbells"] / st["batches"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--size", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--opts", default="", help="verbs options, e.g. '?event=1'")
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args()
    # a fresh channel whose ring grows, beside one registered whole at connect
    print("doorbells per batch from a fresh channel, 256 x 8 B batches: " + ", ".join(
        f"{n} batches {fresh(n, ''):.3f} (ring whole at connect {fresh(n, '?ring_start=0'):.3f})"
        for n in (50, 200)))
    res = [run(m, a.size, a.batch, a.seconds, a.opts) for m in ("batched", "ack")]
    keys = ("msgs_per_s", "doorbells_per_msg", "signaled_per_msg", "cpu_s_per_msg")
    print(f"verbs on {os.environ.get('RXEVM_DEV', 'an RDMA device')}, {a.size} B messages, "
          f"batches of {a.batch}, {a.seconds:g} s per mode")
    print(f"{'mode':>8} {'messages':>9} " + " ".join(f"{k:>18}" for k in keys))
    for r in res:
        print(f"{r['mode']:>8} {r['messages']:>9} " + " ".join(f"{r[k]:>18.6g}" for k in keys))
    b, k = res
    ratios = {"msgs_per_s": b["msgs_per_s"] / k["msgs_per_s"],
              "doorbells_per_msg": k["doorbells_per_msg"] / b["doorbells_per_msg"],
              "signaled_per_msg": k["signaled_per_msg"] / b["signaled_per_msg"],
              "cpu_s_per_msg": k["cpu_s_per_msg"] / b["cpu_s_per_msg"]}
    print(f"batched/ack: {ratios['msgs_per_s']:.1f}x messages/s; ack needs "
          f"{ratios['doorbells_per_msg']:.0f}x the doorbells, "
          f"{ratios['signaled_per_msg']:.0f}x the signaled completions and "
          f"{ratios['cpu_s_per_msg']:.1f}x the CPU seconds per message")
    print("ibv_post_send calls per send_batch (incl. wake-up SENDs): " + ", ".join(
        f"{r['mode']} {r['post_sends_per_batch']:.2f} ({r['wakeups_per_batch']:.2f} wake-ups)"
        for r in res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": res, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
