"""Test-only hooks, kept out of the public classes (as ucxx keeps its in a separate
extension) and out of the package (tests/support/_hooks.pyx, built in place by
tests/support/build_hooks.py): the suite and the fuzzers use them to reach a channel's
memory the way a peer process can. The package never imports them
(tests/unit/test_layers.py checks) and its wheel has none
(tests/unit/test_hooks_not_in_wheel.py)."""

from __future__ import annotations

from typing import Any

from tests.support._hooks import (
    apply_stream,
    assist_now,
    atomic_adds,
    expose_churn,
    expose_range,
    forge_peer_xtab,
    hammer_job,
    job_claimed,
    job_state,
    offer_job,
    qp_error,
    read_remote,
    region_address,
    set_device_limit,
    unexpose_range,
    verbs_drain_then_wait,
    verbs_expose,
    verbs_fences,
    verbs_first_cause,
    verbs_keys,
    verbs_remote,
    verbs_side_socket,
    verbs_unexpose,
)

__all__ = ["apply_stream", "assist_now", "atomic_adds", "expose_churn", "expose_range",
           "forge_peer_xtab", "hammer_job", "job_claimed", "job_state", "offer_job",
           "qp_error", "read_remote",
           "region_address", "set_device_limit", "slot_address", "unexpose_range",
           "verbs_drain_then_wait", "verbs_expose", "verbs_fences", "verbs_first_cause",
           "verbs_keys", "verbs_remote", "verbs_side_socket",
           "verbs_unexpose"]


def slot_address(channel: Any, slot: int) -> int:
    """Address of the header of ``slot`` in the ring ``channel`` receives on."""
    ring = channel.diagnostics()["ring"]
    if not 0 <= slot < ring["slots"]:
        raise IndexError(slot)
    return ring["address"] + slot * ring["stride"]
