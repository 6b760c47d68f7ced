"""The channel's lifecycle as a state machine (hypothesis): sends, receives (blocking
ones on a second thread), and closes of either side in any order, checked against a
model of what was sent. Whatever the order: every message received is the next one
sent (none invented, none skipped but one reported MessageLost), every call ends by its
deadline + 0.5 s with a typed error, and a blocking receive on another thread ends
when either side closes (docs/protocol.md, "Closing")."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rdmamw.errors import ChannelClosed, MessageLost, PeerLost, Timeout
from tests.support.helpers import make_pair

TYPED = (ChannelClosed, MessageLost, PeerLost, Timeout)
SIZES = st.sampled_from([1, 100, 5000, 70_000, 1 << 20])
SLACK = 0.5


class Lifecycle(RuleBasedStateMachine):
    provider = "shm"

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.lst = make_pair(provider=self.provider, slots=8,
                                             slot_size=4096, rendezvous="read")
        self.sent: list[bytes] = []     # the messages a send took, in order
        self.next = 0                   # the index of the next one to receive
        self.seq = 0
        self.bg: dict | None = None     # a receive running on another thread
        self.errors: list[str] = []
        self.arrays: list[np.ndarray] = []      # sources a send thread holds
        self.sender: threading.Thread | None = None

    def _timed(self, what: str, fn, timeout: float):
        t0 = time.monotonic()
        try:
            return fn()
        except TYPED:
            raise
        except BaseException as e:      # noqa: BLE001 - reported by the invariant
            self.errors.append(f"{what}: untyped {type(e).__name__}: {e}")
            raise ChannelClosed("untyped") from e
        finally:
            if time.monotonic() - t0 > timeout + SLACK:
                self.errors.append(f"{what} took {time.monotonic() - t0:.2f} s")

    def _payload(self, size: int) -> bytes:
        self.seq += 1
        return self.seq.to_bytes(4, "little") * max(1, size // 4)

    def _take(self, data: bytes) -> None:
        if self.next >= len(self.sent):
            self.errors.append(f"received a message that was not sent ({len(data)} B)")
        elif data != self.sent[self.next]:
            self.errors.append(f"message {self.next} is not what was sent")
        self.next += 1

    @precondition(lambda self: self.bg is None and self.sender is None)
    @rule(sizes=st.lists(SIZES, min_size=1, max_size=4))
    def send(self, sizes):
        batch = [self._payload(s) for s in sizes]
        try:
            self._timed("send", lambda: self.a.send_batch(batch, timeout=0.3), 0.3)
            self.sent.extend(batch)
        except Timeout as e:
            self.sent.extend(batch[:e.sent])
        except TYPED:
            pass

    @precondition(lambda self: self.bg is None)
    @rule()
    def recv(self):
        try:
            m = self._timed("recv", lambda: self.b.recv(timeout=0.2), 0.2)
            self._take(bytes(m))
        except MessageLost:
            self.next += 1
        except TYPED:
            pass

    @precondition(lambda self: self.bg is None)
    @rule()
    def recv_on_a_thread(self):
        """A blocking receive (no timeout) on another thread: a close must end it."""
        out: dict = {}

        def run() -> None:
            try:
                out["msg"] = bytes(self.b.recv())
            except TYPED as e:
                out["err"] = e
            except BaseException as e:  # noqa: BLE001 - reported by the invariant
                self.errors.append(f"background recv: untyped {type(e).__name__}: {e}")
            out["t"] = time.monotonic()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        out["thread"] = t
        self.bg = out

    @precondition(lambda self: self.bg is None and self.sender is None)
    @rule(n=st.integers(1, 40))
    def send_on_a_thread(self, n):
        """A thread sends n 1 MiB arrays one by one, no timeout: with nobody
        receiving it runs out of slots and waits with sources exposed; a close must end
        it and release each source once."""
        arrays = [np.full(1 << 20, i & 0xFF, np.uint8) for i in range(n)]
        self.arrays.extend(arrays)

        def run() -> None:
            for arr in arrays:
                try:
                    self.a.send(arr)
                except TYPED:
                    return
                except BaseException as e:  # noqa: BLE001 - reported by the invariant
                    self.errors.append(f"send thread: untyped {type(e).__name__}: {e}")
                    return
                self.sent.append(arr.tobytes())

        self.sender = threading.Thread(target=run, daemon=True)
        self.sender.start()
        time.sleep(0.05)

    @precondition(lambda self: self.bg is not None)
    @rule(side=st.sampled_from(["sender", "receiver"]))
    def close_under_the_receive(self, side):
        time.sleep(0.02)
        t0 = time.monotonic()
        (self.a if side == "sender" else self.b).close()
        self._join(t0)

    @precondition(lambda self: self.bg is not None and self.sender is None)
    @rule()
    def send_to_the_receive(self):
        self.send([8])
        self._join(None)

    def _join(self, closed_at: float | None) -> None:
        bg, self.bg = self.bg, None
        bg["thread"].join(8)
        if bg["thread"].is_alive():
            self.errors.append("a blocking receive outlived the close" if closed_at
                               else "a blocking receive missed a message")
            return
        if "msg" in bg:
            self._take(bg["msg"])
        elif isinstance(bg.get("err"), MessageLost):
            self.next += 1
        elif closed_at is not None and bg["t"] - closed_at > 1.0 + SLACK:
            self.errors.append(f"a blocking receive ended {bg['t'] - closed_at:.2f} s "
                               f"after the close")

    @precondition(lambda self: self.bg is None)
    @rule(side=st.sampled_from(["sender", "receiver"]))
    def close(self, side):
        self._timed(f"close {side}", (self.a if side == "sender" else self.b).close, 6.0)
        if side == "sender" and self.sender is not None:
            self.sender.join(3)
            if self.sender.is_alive():
                self.errors.append("a send thread outlived the close of its side")

    @invariant()
    def nothing_wrong(self):
        assert not self.errors, self.errors

    def teardown(self):
        for ch in (self.a, self.b):
            ch.close()
        if self.bg is not None:
            self.bg["thread"].join(8)
            assert not self.bg["thread"].is_alive(), "a receive outlived both closes"
        if self.sender is not None:
            self.sender.join(8)
            assert not self.sender.is_alive(), "a send thread outlived both closes"
        self.lst.close()
        assert not self.errors, self.errors
        for arr in self.arrays:     # each source released once: held by the list only
            assert sys.getrefcount(arr) == 3, sys.getrefcount(arr)


class LifecycleTcp(Lifecycle):
    provider = "tcp"


@pytest.mark.parametrize("machine", [Lifecycle, LifecycleTcp], ids=["shm", "tcp"])
def test_the_lifecycle_in_any_order(machine):
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(machine, settings=settings(
        max_examples=12, stateful_step_count=10, deadline=None,
        suppress_health_check=list(HealthCheck)))
