"""What a verbs connection reports as the first cause of its failure
(rdmamw/providers/verbs/_qp.pyx, VerbsFailure), on the host. The owner's device
refusing a region access fails both QPs: the peer may see the owner's EOF on the side
channel before it polls the refusal's completion, and the refusal must still be the
cause (the region call then raises RegionRevoked, not PeerLost)."""

from __future__ import annotations

import pytest

from tests.support.hooks import verbs_first_cause

SUCCESS, FLUSH, REM_ACCESS, RETRY_EXC = 0, 5, 10, 12


@pytest.mark.parametrize("events, cause", [
    ([("send", REM_ACCESS, True)], ("send", REM_ACCESS)),
    ([("socket",), ("send", REM_ACCESS, False)], ("send", REM_ACCESS)),
    ([("send", FLUSH, True), ("send", REM_ACCESS, False)], ("send", REM_ACCESS)),
    # a peer gone: its EOF says more than the retries that failed after it
    ([("socket",), ("send", RETRY_EXC, False)], ("socket", 0)),
    ([("socket",), ("recv", REM_ACCESS, False)], ("socket", 0)),
    ([("send", RETRY_EXC, True), ("send", REM_ACCESS, False)], ("send", RETRY_EXC)),
    ([("socket",), ("send", FLUSH, False)], ("socket", 0)),
    ([("send", REM_ACCESS, False)], (0, 0)),     # after our own halt: not a cause
    # what the refusal's QP error brings may come first: a receive WR that could not be
    # posted back, a receive's error, our halt; the refusal is still the cause
    ([("post",), ("send", REM_ACCESS, False)], ("send", REM_ACCESS)),
    ([("recv", RETRY_EXC, True), ("send", REM_ACCESS, False)], ("send", REM_ACCESS)),
    ([("other",), ("send", REM_ACCESS, False)], ("send", REM_ACCESS)),
    ([("post",), ("send", RETRY_EXC, False)], ("post", 0)),
])
def test_the_first_cause_kept(events, cause):
    assert verbs_first_cause(events) == cause
