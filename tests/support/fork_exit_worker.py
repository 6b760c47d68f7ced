"""``python -m tests.support.fork_exit_worker PROVIDER``: make a channel pair, fork, and let
the child leave by ``sys.exit`` (atexit handlers, then the garbage collector
deallocates every inherited channel and the listener). The parent then checks its
pair still carries whole messages both ways and prints OK (test_fork.py). Each step
prints when it ends, at once, with the seconds since the start: a run cut short says
where it was."""

from __future__ import annotations

import os
import signal
import sys
import time

from tests.support.helpers import make_pair

T0 = time.monotonic()


def step(what: str) -> None:
    print(f"{time.monotonic() - T0:7.2f} s {what}", flush=True)


def main(provider: str) -> int:
    step("imported")
    a, b, lst = make_pair(provider=provider)
    step("pair open")
    a.send(b"before")
    assert bytes(b.recv(timeout=5)) == b"before"
    step("sent before the fork")
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
    step("child exited")
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
    step("sent after its exit")
    a.close(), b.close(), lst.close()
    step("closed")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
