"""The test-only hooks (tests/support/hooks.py) are not on the classes users hold, and each one
refuses a transport it cannot drive (None, another provider's, a Channel) with a
TypeError naming what it takes, never a crash; no device needed."""

from __future__ import annotations

import pytest

from rdmamw.channel.channel import Channel
from rdmamw.providers.shm._transport import ShmTransport
from rdmamw.providers.tcp._transport import TcpTransport
from rdmamw.providers.verbs._transport import VerbsTransport
from rdmamw.transport._base import Transport
from tests.support import hooks
from tests.support.helpers import make_pair

#: hook -> (the transport class it drives, the rest of its arguments)
TAKES = {
    "region_address": (Transport, (0,)),
    "expose_range": (Transport, (0, 0)),        # shm and tcp
    "unexpose_range": (Transport, (0,)),
    "offer_job": (ShmTransport, (0, 0, 0, 0, 0, 0)),
    "job_state": (ShmTransport, ()),
    "job_claimed": (ShmTransport, ()),
    "assist_now": (ShmTransport, ()),
    "forge_peer_xtab": (ShmTransport, (0, 0, 0, 0, 0)),
    "hammer_job": (ShmTransport, (0, 0, 0, 0, 0)),
    "read_remote": (TcpTransport, (0, 0, 0)),
    "expose_churn": (VerbsTransport, (0, 0, 1)),
    "qp_error": (VerbsTransport, ()),
    "verbs_keys": (VerbsTransport, ()),
    "verbs_expose": (VerbsTransport, (0, 1)),
    "verbs_remote": (VerbsTransport, (0, 0, 1)),
    "verbs_unexpose": (VerbsTransport, (0,)),
    "verbs_side_socket": (VerbsTransport, ()),
    "verbs_drain_then_wait": (VerbsTransport, (0,)),
}
#: the hooks that take something else first (bytes, a Channel, a verbs device, an
#: address, a chain's letters)
OTHERS = {"apply_stream", "set_device_limit", "slot_address", "atomic_adds",
          "verbs_fences", "verbs_first_cause"}


@pytest.fixture(scope="module")
def channel():
    a, b, lst = make_pair(provider="shm")
    yield a
    a.close(), b.close(), lst.close()


def test_every_hook_is_listed_here():
    assert set(hooks.__all__) == set(TAKES) | OTHERS


def test_no_public_class_carries_a_test_hook():
    classes = (Channel, Transport, ShmTransport, TcpTransport, VerbsTransport)
    found = {c.__name__: sorted(n for n in dir(c) if n.startswith("_debug")
                                or n in hooks.__all__) for c in classes}
    assert found == {c.__name__: [] for c in classes}


@pytest.mark.parametrize("name", sorted(TAKES))
def test_a_hook_refuses_what_it_cannot_drive(name, channel):
    cls, rest = TAKES[name]
    wrong = [None, channel] + [t() for t in (ShmTransport, TcpTransport, VerbsTransport)
                         if not issubclass(t, cls)]
    for other in wrong:
        with pytest.raises(TypeError, match=rf"expected [\w.]+\.{cls.__name__}, got "
                                            rf"[\w.]*{type(other).__name__}"):
            getattr(hooks, name)(other, *rest)


@pytest.mark.parametrize("name", ["expose_churn", "qp_error", "verbs_keys", "verbs_expose",
                                  "verbs_remote"])
def test_the_verbs_hooks_on_an_unconnected_transport_say_so(name):
    with pytest.raises(ValueError, match="verbs transport is not connected"):
        getattr(hooks, name)(VerbsTransport(), *TAKES[name][1])
