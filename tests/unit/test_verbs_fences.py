"""The fences of a verbs region chain (rdmamw/providers/verbs/_fence.pxd;
docs/remote-memory.md, "Atomics in a batch"), on the host: a WRITE after a READ or an
atomic of its chain and an atomic after a READ carry IBV_SEND_FENCE, only the first
such one after them; READs and atomics after atomics are not fenced. (That the chain
then runs in its order on a device: tests/channel/test_batch_atomics.py in the VM.)"""

from __future__ import annotations

import pytest

from tests.support.hooks import verbs_fences


@pytest.mark.parametrize("chain, fenced", [
    ("RRRR", "RRRR"),               # reads alone: nothing to wait for
    ("WWWW", "WWWW"),
    ("WRWR", "WRwR"),               # a write waits for the read before it
    ("RRWW", "RRwW"),               # the first write after them is enough
    ("AAAA", "AAAA"),               # atomics after atomics: one outstanding at most
    ("RAAW", "RaAw"),               # an atomic after a read; a write after atomics
    ("WAWR", "WAwR"),               # a read after anything: RC orders it
    ("RARCWAW", "RaRcwAw"),
    ("ACRA", "ACRa"),
    ("", ""),
])
def test_the_chain_fences_what_its_order_needs(chain, fenced):
    assert verbs_fences(chain) == fenced
