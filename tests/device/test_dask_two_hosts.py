"""A Dask ``rdmamw://`` comm between two "hosts" of the soft-RoCE VM, on verbs: the
listener in one network namespace, the connector in the other (tests/support/netns.py), each
host with its own rxe device over one end of a veth pair (rxe_over_veth of
tests/device/test_two_hosts_verbs.py). Nobody names a verbs address: the connector dials
``rdmamw://HOST:PORT``, reads the listener's offer on tcp and moves to verbs by
itself (docs/dask.md, "Across hosts: the offer"), and the frames cross the rxe wire.

It hung in 3 of 4 runs in the VM before the verbs provider split long READs
(RDMAMW_VERBS_READ_CHUNK): one 8 MiB READ between two soft-RoCE devices lost a packet
and rxe's retry of it stalled the QP for good (docs/design.md "Long READs on
soft-RoCE"). If it hangs again, the connector's watchdog prints its stack and both
sides' logs."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.device.test_two_hosts_verbs import WIRE, rxe_over_veth, tx_bytes
from tests.integrations.test_bootstrap import ROOT, clean_env
from tests.integrations.test_multihost import two_hosts  # noqa: F401 - the fixture
from tests.support.helpers import NO_DEVICE, VERBS_OK

pytest.importorskip("distributed", reason="dask distributed is not installed "
                    "(pip install rdmamw[dask])")
pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE),
              pytest.mark.timeout(400),
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("rdma") is None,
                                 reason="needs root and rdma (iproute2)")]

LISTENER = textwrap.dedent("""
    import asyncio, sys
    import rdmamw.dask
    rdmamw.dask.register()
    from distributed.comm import listen
    from tests.support.dask_echo import echo

    async def main():
        async with listen(f"rdmamw://{sys.argv[1]}:0", echo) as lst:
            print(lst.contact_address, flush=True)
            await asyncio.sleep(300)
    asyncio.run(main())
""")

CONNECTOR = textwrap.dedent("""
    import asyncio, faulthandler, json, sys
    faulthandler.dump_traceback_later(150, exit=True)   # where it hangs, if it does
    import dask, numpy as np
    import rdmamw.dask
    rdmamw.dask.register()
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    async def main():
        out = {"providers": [], "whole": []}
        for _ in range(2):                      # the second comm: straight to verbs
            comm = await connect(sys.argv[1])
            out["providers"].append(comm.extra_info.get("provider"))
            for n in (8, 64 << 10, 8 << 20):
                x = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
                await comm.write({"x": to_serialize(x)})
                out["whole"].append(bool(np.array_equal((await comm.read())["x"], x)))
            await comm.close()
        print(json.dumps(out), flush=True)
    with dask.config.set({"distributed.comm.timeouts.connect": "60s"}):
        asyncio.run(main())
""")


def test_a_dask_comm_across_hosts_moves_to_verbs_by_itself(two_hosts):  # noqa: F811
    hosts, _ = two_hosts
    a, b = sorted(hosts)
    env = {"PYTHONPATH": str(ROOT), "RDMAMW_TOKEN": secrets.token_hex(16),
           "RDMAMW_VERBS_FABRIC": "vm-veth", "RDMAMW_LOG_LEVEL": "debug"}
    with rxe_over_veth():
        tx0 = tx_bytes(WIRE["rxeA"][0]) + tx_bytes(WIRE["rxeB"][0])
        server = subprocess.Popen(
            ["ip", "netns", "exec", a, sys.executable, "-c", LISTENER, hosts[a]],
            env=clean_env(RDMAMW_VERBS_DEVICE="rxeA", **env), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            address = server.stdout.readline().strip()
            assert address.startswith(f"rdmamw://{hosts[a]}:"), (
                address, server.stderr.read() if server.poll() is not None else "")
            client = subprocess.run(
                ["ip", "netns", "exec", b, sys.executable, "-c", CONNECTOR, address],
                env=clean_env(RDMAMW_VERBS_DEVICE="rxeB", **env), capture_output=True,
                text=True, cwd=ROOT, timeout=200)
        finally:
            server.kill()
            _, server_err = server.communicate(timeout=30)
        tx1 = tx_bytes(WIRE["rxeA"][0]) + tx_bytes(WIRE["rxeB"][0])
    if client.returncode != 0:          # shown with the failure: where each side was
        print("---- connector's stderr ----", client.stderr[-8000:],
              "---- listener's stderr ----", server_err[-5000:], sep="\n")
    assert client.returncode == 0
    got = json.loads(client.stdout.strip().splitlines()[-1])
    assert got == {"providers": ["verbs", "verbs"], "whole": [True] * 6}, client.stderr[-3000:]
    # 2 x (8 MiB + 64 KiB) each way went over the rxe devices' veth pair
    assert tx1 - tx0 > 4 * (8 << 20), (tx0, tx1)
