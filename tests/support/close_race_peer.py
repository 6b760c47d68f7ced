"""``python -m tests.support.close_race_peer ADDRESS SIZE``: a peer of test_close_races.py that
opens a channel to ADDRESS, sends one message of SIZE bytes (rendezvous when large),
prints "sent" and then sleeps until it is killed: the test stops it (SIGSTOP) so that
nothing of this process answers a READ of that message."""

from __future__ import annotations

import sys
import time

import rdmamw


def main(address: str, size: int) -> int:
    ch = rdmamw.Channel.open(address, timeout=10, rendezvous="read")
    ch.send(bytes([7]) * size, timeout=10)
    print("sent", flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
