"""What the remote-memory tests share (tests/channel/test_remote_*.py, test_aio_remote.py;
their fixtures are in tests/support/region_fixtures.py): the providers with regions, the byte
patterns they compare, and an owner process a test can stop (SIGSTOP) or kill."""

from __future__ import annotations

import os
import textwrap

import numpy as np

from tests.support.helpers import (
    DEVICE_PROVIDERS,
    LISTEN_ADDRESS,
    provider_param,
    providers_under_test,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the providers with regions; the others must say so (test_unsupported_...)
REGIONS = ("shm", "tcp", "verbs")
#: the rpair fixture's: verbs is a device test (in the soft-RoCE VM; skipped with its
#: reason where there is no device)
WITH = [provider_param(p) for p in providers_under_test()
        if p in REGIONS and (p in LISTEN_ADDRESS or p in DEVICE_PROVIDERS)]
WITHOUT = [p for p in providers_under_test() if p not in REGIONS and p in LISTEN_ADDRESS]
#: verbs alone (its own checks: the device refuses, a timeout ends the connection)
VERBS = [p for p in WITH if p.values[0] == "verbs"]

#: the owner process's region: OWNER_BYTES of pattern(OWNER_BYTES, OWNER_SEED)
OWNER_BYTES = 4 * 2**20
OWNER_SEED = 7
#: an owner process (argv: listen address, bytes): exposes a pattern (seed 7)
#: read-write ("atomic" on tcp, which has atomics) and sends the reference, then
#: sleeps (only its provider's threads serve)
OWNER = textwrap.dedent("""
    import sys, time, numpy as np, rdmamw
    lst = rdmamw.listen(sys.argv[1])
    print(lst.address, flush=True)
    ch = lst.accept(timeout=60)
    buf = np.random.default_rng(7).integers(0, 256, int(sys.argv[2]), dtype=np.uint8)
    reg = ch.expose(buf, "atomic" if sys.argv[1].startswith("tcp") else "rw")
    ch.send(bytes(reg.ref))
    time.sleep(120)
""")


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
