"""``python -m tests.support.fork_exit_worker PROVIDER``: make a channel pair, fork, and let
the child leave by ``sys.exit`` (atexit handlers, then the garbage collector
deallocates every inherited channel and the listener). The parent then checks its
pair still carries whole messages both ways and prints OK (test_fork.py)."""

from __future__ import annotations

import os
import signal
import sys
import time

from tests.support.helpers import make_pair


def main(provider: str) -> int:
    a, b, lst = make_pair(provider=provider)
    a.send(b"before")
    assert bytes(b.recv(timeout=5)) == b"before"
    pid = os.fork()
    if pid == 0:
        sys.exit(0)             # the real interpreter shutdown, with a, b, lst alive
    end = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            print("child hung in its exit")
            return 3
        time.sleep(0.01)
    if os.waitstatus_to_exitcode(status) != 0:
        print(f"child exited with {os.waitstatus_to_exitcode(status)}")
        return 5
    for src, dst in ((a, b), (b, a)):
        sent = [b"after-%d" % i * (i + 1) for i in range(50)]
        src.send_batch(sent).wait(5)
        got: list[bytes] = []
        while len(got) < len(sent):
            got += [bytes(m) for m in dst.recv_batch(timeout=5)]
        if got != sent:
            print("messages differ after the child's exit")
            return 4
    a.close(), b.close(), lst.close()
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
