"""``python -m tests.support.close_worker ADDRESS ROUNDS [TIMEOUT]``: the closing peer of
test_close_delivery.py. Each round opens a channel to ADDRESS, sends batches from one
or two threads (odd rounds: two, so batches from both interleave in the ring), waits
for every handle, then closes at once: everything it sent completed before close(),
so the receiver must get all of it before ChannelClosed. The streams are
``plan(round)``'s, which the test computes too."""

from __future__ import annotations

import struct
import sys
import threading

import rdmamw

REC = struct.Struct("<III")     # round, thread, seq


def plan(rnd: int) -> list[list[int]]:
    """The batch sizes (messages per batch) of each sending thread in round ``rnd``."""
    threads = 1 + rnd % 2
    return [[1 + (rnd * 7 + t * 5 + i * 3) % 13 for i in range(2 + (rnd + t) % 4)]
            for t in range(threads)]


def body(rnd: int, t: int, seq: int) -> bytes:
    """Message ``seq`` of thread ``t``: the header, then 0 B to about 700 B, so a
    batch packs several messages per slot and one batch can take more slots than the
    receiver's ring has (it goes in pieces)."""
    return REC.pack(rnd, t, seq) + bytes([seq & 0xFF]) * ((rnd * 31 + seq * 97) % 700)


def send(ch, rnd: int, t: int, sizes: list[int], errors: list[BaseException],
         timeout: float) -> None:
    """Thread ``t``'s batches of round ``rnd``, each waited for."""
    try:
        seq = 0
        for n in sizes:
            ch.send_batch([body(rnd, t, seq + i) for i in range(n)],
                          timeout=timeout).wait(timeout)
            seq += n
    except BaseException as e:      # noqa: BLE001 - reported by main
        errors.append(e)


def main(address: str, rounds: int, timeout: float = 10.0) -> int:
    for rnd in range(rounds):
        ch = rdmamw.Channel.open(address, timeout=timeout)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=send, args=(ch, rnd, t, s, errors, timeout))
                   for t, s in enumerate(plan(rnd))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        ch.close()
        if errors:
            print(f"round {rnd}: {errors[0]!r}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:4])))
