"""Fixtures of the remote-memory tests, a plugin of tests/conftest.py (pytest_plugins)
(a conftest.py here would be a second module named "conftest": tests/unit/
test_suite_hygiene.py). tests/support/regions.py has the rest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import rdmamw
from tests.support.helpers import make_pair
from tests.support.regions import OWNER, OWNER_BYTES, ROOT, WITH


@pytest.fixture(params=WITH)
def rpair(request):
    """(owner, peer): a channel pair on each provider with regions, verbs included
    (a device test: in the soft-RoCE VM)."""
    a, b, lst = make_pair("batched", provider=request.param)
    yield a, b
    a.close()
    b.close()
    lst.close()


@pytest.fixture
def stoppable_owner(request):
    """(channel to an owner process (regions.OWNER), its region's reference bytes, its
    pid); tcp unless the test parametrizes it indirectly with a listen address. The
    process is continued (SIGCONT) and killed at the end."""
    address = getattr(request, "param", "tcp://127.0.0.1:0")
    env = {**os.environ, "PYTHONPATH": ROOT, "RDMAMW_TCP_PEER_TIMEOUT": "20"}
    p = subprocess.Popen([sys.executable, "-c", OWNER, address, str(OWNER_BYTES)],
                         cwd=ROOT, text=True, stdout=subprocess.PIPE, env=env)
    ch = None
    try:
        ch = rdmamw.Channel.open(p.stdout.readline().strip(), timeout=30)
        yield ch, bytes(ch.recv(timeout=30)), p.pid
    finally:
        os.kill(p.pid, signal.SIGCONT)
        if ch is not None:
            ch.close()
        p.kill()
        p.wait()
