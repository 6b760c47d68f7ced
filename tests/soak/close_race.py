"""``python -m tests.soak.close_race --provider shm --rounds N [--seconds S] [--seed K]``: the
close-race stress (docs/protocol.md, "Closing"; docs/testing.md).

Each round opens a channel pair in this process, pinned to one CPU, and runs a
sender thread, a receiver thread and a closer thread: the sender sends numbered
messages (eager, 64 KiB and 1 MiB rendezvous, single and batched, by send_batch,
send_many or, for one message, send: small bytes take the one-message path), the
receiver takes them with recv / recv_batch / recv_into / recv_many_into, and the
closer closes one side (or both) at a random moment of that. Checked every round:

* no message that was not sent: every message received is byte for byte the one its
  number names, numbers strictly increasing (no zeros of a cut READ, no duplicate);
* no lost delivery: when the sender closed, every message it sent is received, except
  rendezvous messages reported as MessageLost (the receiver saw why);
* every call ends by its timeout + 0.5 s, or within 0.5 s of the close that ended it,
  with one of the typed errors (ChannelClosed, MessageLost, Timeout, PeerLost);
* each source's buffer is released once (its refcount is back where it began).

A crash (a double free) ends the process: the caller sees its exit status. Prints one
line of counts; exit status 1 on any violation."""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import struct
import sys
import threading
import time

import numpy as np

from rdmamw.errors import ChannelClosed, MessageLost, PeerLost, Timeout
from tests.support.helpers import make_pair

HDR = struct.Struct("<IIQ")         # round, seq, length
SIZES = (16, 700, 3000, 64 << 10, 1 << 20)
TIMEOUT = 1.0                       # every call's deadline
SLACK = 0.5                         # ... kept within this
TYPED = (ChannelClosed, MessageLost, PeerLost, Timeout)


def body(rnd: int, seq: int, size: int) -> bytes:
    """Message ``seq`` of round ``rnd``: its header, then bytes that depend on both."""
    fill = bytes([(rnd * 31 + seq * 7) & 0xFF or 1]) * max(0, size - HDR.size)
    return HDR.pack(rnd, seq, size) + fill


class Round:
    """One round's threads and what they saw."""

    def __init__(self, provider: str, rnd: int, rng: random.Random) -> None:
        self.rnd, self.rng = rnd, rng
        self.a, self.b, self.lst = make_pair(provider=provider, slots=8, slot_size=4096,
                                             rendezvous="read")
        self.sent: list[int] = []           # seqs whose send call returned
        self.tried = 0                      # seqs handed to a send call (the last one
                                            # cut by a close may have gone in part)
        self.sizes: dict[int, int] = {}
        self.got: list[int] = []
        self.lost = 0
        self.bad: list[str] = []
        self.closed_at: dict[str, float] = {}
        self.arrays: list[np.ndarray] = []     # 1 MiB sources sent as arrays

    def call(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs) timed: a late return or an untyped error is a violation."""
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        except TYPED:
            raise
        except BaseException as e:      # noqa: BLE001 - the stress reports it
            self.bad.append(f"{what}: untyped {type(e).__name__}: {e}")
            raise ChannelClosed("untyped") from e
        finally:
            t1 = time.monotonic()
            closed = min(self.closed_at.values(), default=None)
            limit = t0 + TIMEOUT + SLACK
            if closed is not None:
                limit = min(limit, max(closed, t0) + SLACK + 2.5)
            if t1 > limit:
                self.bad.append(f"{what} took {t1 - t0:.2f} s (closed at "
                                f"{(closed or t0) - t0:+.2f} s)")

    def send(self) -> None:
        seq = 0
        try:
            while seq < 5000:
                n = self.rng.choice((1, 1, 3))
                batch = []
                for _ in range(n):
                    size = self.rng.choice(SIZES)
                    if size == 1 << 20 and self.rng.random() < 0.5:
                        arr = np.frombuffer(body(self.rnd, seq, size), np.uint8).copy()
                        self.arrays.append(arr)     # its refcount is checked at the end
                        batch.append(arr)
                        del arr
                    else:
                        batch.append(body(self.rnd, seq, size))
                    self.sizes[seq] = size
                    seq += 1
                self.tried = seq
                try:
                    if self.rng.random() < 0.3:     # the same messages from one buffer
                        self.call("send_many", self.a.send_many, b"".join(batch),
                                  [len(x) for x in batch], timeout=TIMEOUT)
                    elif n == 1 and self.rng.random() < 0.5:    # one small bytes: the
                        self.call("send", self.a.send, batch[0], TIMEOUT)  # one-message way
                    else:
                        self.call("send", self.a.send_batch, batch, TIMEOUT)
                except Timeout as e:
                    self.sent.extend(range(seq - n, seq - n + e.sent))
                    return
                self.sent.extend(range(seq - n, seq))
        except TYPED:
            return

    def check(self, m, seq_hint: int | None = None) -> None:
        data = bytes(m)
        if len(data) < HDR.size:
            self.bad.append(f"a message of {len(data)} bytes")
            return
        rnd, seq, size = HDR.unpack_from(data)
        if rnd != self.rnd or len(data) != size or (self.got and seq <= self.got[-1]):
            self.bad.append(f"a message that was not sent: round {rnd} seq {seq} "
                            f"length {len(data)} (header says {size})")
            return
        if data != body(self.rnd, seq, size):
            self.bad.append(f"message {seq} is not what was sent")
            return
        self.got.append(seq)

    def recv(self) -> None:
        buf, lens = bytearray(1 << 20), np.zeros(4, np.uint32)
        while True:
            how = self.rng.randrange(4)
            if self.rng.random() < 0.2:     # a slow receiver: the sender waits for slots
                time.sleep(self.rng.random() * 0.005)
            try:
                if how == 0:
                    self.check(self.call("recv", self.b.recv, TIMEOUT))
                elif how == 1:
                    for m in self.call("recv_batch", self.b.recv_batch, 4, TIMEOUT):
                        self.check(m)
                elif how == 2:
                    n = self.call("recv_into", self.b.recv_into, buf, TIMEOUT)
                    self.check(memoryview(buf)[:n])
                else:
                    n = self.call("recv_many_into", self.b.recv_many_into, buf, lens,
                                  TIMEOUT)
                    ends = np.cumsum(lens[:n]).tolist()
                    for start, end in zip([0, *ends[:-1]], ends, strict=True):
                        self.check(memoryview(buf)[start:end])
            except MessageLost:
                self.lost += 1
            except Timeout:
                if self.closed_at:
                    return
            except (ChannelClosed, PeerLost):
                return

    def close(self, side: str) -> None:
        time.sleep(self.rng.random() * 0.04)
        ch = self.a if side == "sender" else self.b
        self.closed_at[side] = time.monotonic()
        self.call(f"close {side}", ch.close)

    def run(self) -> str:
        side = self.rng.choice(("sender", "receiver", "sender"))
        threads = [threading.Thread(target=self.send, name="sender", daemon=True),
                   threading.Thread(target=self.recv, name="receiver", daemon=True),
                   threading.Thread(target=self.close, args=(side,), name="closer",
                                    daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
            if t.is_alive():        # a call outlived its deadline: where each thread is
                print(f"round {self.rnd} ({side} closed): the {t.name} thread still runs "
                      f"after 30 s; every thread's stack:", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
                os._exit(1)
        self.a.close()
        self.b.close()
        self.lst.close()
        if any(s >= self.tried for s in self.got):
            self.bad.append(f"received a message numbered past the {self.tried} sent")
        if side == "sender":        # everything sent is received, or reported lost
            missing = len(set(self.sent) - set(self.got))
            if missing > self.lost:
                self.bad.append(f"sender closed: {len(self.sent)} sent, {len(self.got)} "
                                f"received, {self.lost} reported lost")
        for arr in self.arrays:         # held by the list and the call's argument only
            if sys.getrefcount(arr) != 3:
                self.bad.append(f"a source's refcount is {sys.getrefcount(arr) - 1}, "
                                f"held once")
        return side


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=0, help="the CPU to pin to (-1: none)")
    ap.add_argument("--watchdog", type=float, default=0.0,
                    help="after this many seconds, print every thread's stack and exit")
    args = ap.parse_args(argv)
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    counts = {"rounds": 0, "sender": 0, "receiver": 0, "received": 0, "lost": 0,
              "lost_sender_closed": 0, "violations": 0}
    for rnd in range(args.rounds):
        if args.seconds and time.monotonic() - t0 > args.seconds:
            break
        r = Round(args.provider, rnd, random.Random(rng.random()))
        side = r.run()
        counts["rounds"] += 1
        counts[side] += 1
        counts["received"] += len(r.got)
        counts["lost"] += r.lost
        counts["lost_sender_closed"] += r.lost if side == "sender" else 0
        for b in r.bad:
            counts["violations"] += 1
            print(f"round {rnd} ({side} closed): {b}", flush=True)
        print(f"round {rnd} ({side} closed) ended at {time.monotonic() - t0:.1f} s",
              file=sys.stderr, flush=True)
    print(f"close_race {args.provider}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f" in {time.monotonic() - t0:.1f} s", flush=True)
    return 1 if counts["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
