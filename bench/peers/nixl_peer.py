"""NVIDIA NIXL's Python API (the ``nixl-cu12`` wheel, which bundles UCX) as a peer of
bench/rmem_bench.py: READ / WRITE transfer requests between two processes on DRAM with
the UCX backend, beside rdmamw's shm provider. No GPU is needed for DRAM: the wheel's
CUDA parts are not loaded and torch (a declared dependency) is not imported, so the
peers venv installs it ``--no-deps`` (bench/setup.sh).

Runs under the peers' own Python. An owner process makes an agent, registers one
buffer per size (``DRAM``) and prints its agent metadata and serialized descriptors;
this process makes its agent, adds the owner's metadata (``add_remote_agent``),
registers its own arena and makes one transfer request per size and operation
(``initialize_xfer``), then reposts it (``transfer``, then ``check_xfer_state`` until
``DONE``): one operation per post for 64 KiB and 4 MiB (as rdmamw's ``ch.read`` /
``ch.write``); 256 descriptors of 8 B per post for the batched rate, the remote ones
16 B apart (adjacent ones NIXL may merge into one). UCX's transports: ``UCX_TLS`` as
given, default ``shm,self`` (posix/sysv mappings, cross-memory attach). A read is
checked against the owner's bytes before timing.

Usage: PEERS_PY bench/peers/nixl_peer.py CONFIG_JSON; prints one ``RESULT {json}``
line, the shape of mooncake_peer.py's.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from one_sided import announce, check_read, iterations, main, mean_s, owner, seeded

WHO = "NIXL"
STRIDE = 16


def agent(name: str):
    """A NIXL agent with the UCX backend only (its progress thread on, no listener).
    UCX's error handling is ``none``: NIXL's default (``peer``) needs a transport with
    a peer failure handler, which UCX's shared-memory ones lack (with ``shm,self``
    the backend's creation fails: "no active messages transport ... no peer failure
    handler")."""
    try:
        import nixl as api  # the meta package's name
    except ImportError:
        import nixl_cu12 as api
    a = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    a.create_backend("UCX", {"ucx_error_handling_mode": os.environ.get(
        "NIXL_UCX_ERROR_HANDLING", "none")})
    return a


def own(sizes: list[int]) -> None:
    """The owner: one seeded buffer per size, registered; waits for stdin's EOF."""
    a = agent("rmem-owner")
    bufs = [seeded(n) for n in sizes]
    regions = [(b.ctypes.data, b.nbytes, 0) for b in bufs]
    a.register_memory([(*r, "") for r in regions], "DRAM")
    descs = [a.get_serialized_descs(a.get_xfer_descs([r], "DRAM")).hex() for r in regions]
    announce({"meta": a.get_agent_metadata().hex(), "descs": descs,
              "addrs": [r[0] for r in regions]})
    sys.stdin.read()


def measure(cfg: dict) -> dict:
    sizes, reps, batch = cfg["sizes"], cfg["reps"], cfg["batch"]
    os.environ.setdefault("UCX_TLS", "shm,self")
    os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    with owner(__file__, sizes, WHO, env=dict(os.environ)) as info:
        a = agent("rmem-reader")
        peer = a.add_remote_agent(bytes.fromhex(info["meta"]))
        arena = np.ones(2 * sum(sizes) + 8 * batch, np.uint8)
        a.register_memory([(arena.ctypes.data, arena.nbytes, 0, "")], "DRAM")
        base, at = arena.ctypes.data, 0

        def request(op: str, local: list, remote):
            return a.initialize_xfer(op, a.get_xfer_descs(local, "DRAM"), remote, peer)

        def post(h, what: str) -> None:
            state = a.transfer(h)
            while state == "PROC":
                state = a.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL {what}: transfer state {state}")

        res: dict = {"tool": f"nixl-cu12, UCX backend, DRAM, UCX_TLS={os.environ['UCX_TLS']}",
                     "sizes": {}}
        for n, desc in zip(sizes, info["descs"], strict=True):
            remote = a.deserialize_descs(bytes.fromhex(desc))
            rd = request("READ", [(base + at, n, 0)], remote)
            wr = request("WRITE", [(base + at + n, n, 0)], remote)
            post(rd, "read")
            check_read(arena[at:at + n], WHO)
            post(wr, "write")
            at += 2 * n
            iters = iterations(cfg, n)
            res["sizes"][str(n)] = {
                "read_s": [mean_s(lambda rd=rd: post(rd, "read"), iters) for _ in range(reps)],
                "write_s": [mean_s(lambda wr=wr: post(wr, "write"), iters)
                            for _ in range(reps)]}
        span = max(1, (sizes[0] - 8) // STRIDE)
        w8 = request("WRITE", [(base + at + 8 * k, 8, 0) for k in range(batch)],
                     a.get_xfer_descs([(info["addrs"][0] + STRIDE * (k % span), 8, 0)
                                       for k in range(batch)], "DRAM"))
        post(w8, "8 B writes")
        res["writes8_s"] = [mean_s(lambda: post(w8, "8 B writes"), 20) for _ in range(reps)]
        return res


if __name__ == "__main__":
    main(own, measure)
