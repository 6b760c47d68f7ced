"""Mooncake's Transfer Engine (``mooncake-transfer-engine-non-cuda``, the CPU build) as a
peer of bench/rmem_bench.py: one-sided batch read / write between two processes on
its ``tcp`` transport, beside rdmamw's tcp provider.

Runs under the peers' own Python (bench/setup.sh's peers venv, not the project's). An
owner process registers one buffer per size and prints its RPC port and addresses; this
process registers its own buffers (one arena: registered ranges may not overlap) and
calls ``batch_transfer_sync_read`` / ``batch_transfer_sync_write``: one operation per
call for 64 KiB and 4 MiB (as rdmamw's ``ch.read`` / ``ch.write``), 256 writes of 8 B
per call for the batched rate. Metadata: the engine's P2P handshake (``P2PHANDSHAKE``:
no metadata server), hosts 127.0.0.1. A read is checked against the owner's bytes
before timing, and every call's return code (non-zero: the run fails).

Usage: PEERS_PY bench/peers/mooncake_peer.py CONFIG_JSON; prints one ``RESULT {json}``
line: per size, the per-rep mean seconds of a read and of a write; the per-rep mean
seconds of one batch of ``batch`` 8 B writes.
"""

from __future__ import annotations

import sys

import numpy as np
from one_sided import announce, check_read, iterations, main, mean_s, owner, seeded

WHO = "mooncake"


def engine():
    """A TransferEngine on tcp, 127.0.0.1, P2P handshake (no metadata server)."""
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    _ok(e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), "initialize(tcp, P2PHANDSHAKE)")
    return e


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"mooncake {what}: {rc}")


def register(e, buf: np.ndarray) -> int:
    _ok(e.register_memory(buf.ctypes.data, buf.nbytes), f"register_memory({buf.nbytes})")
    return buf.ctypes.data


def own(sizes: list[int]) -> None:
    """The owner: one seeded buffer per size, registered; waits for stdin's EOF."""
    e = engine()
    bufs = [seeded(n) for n in sizes]
    announce({"port": e.get_rpc_port(), "addrs": [register(e, b) for b in bufs]})
    sys.stdin.read()


def measure(cfg: dict) -> dict:
    sizes, reps, batch = cfg["sizes"], cfg["reps"], cfg["batch"]
    with owner(__file__, sizes, WHO) as info:
        target = f"127.0.0.1:{info['port']}"
        e = engine()
        res: dict = {"tool": "mooncake-transfer-engine-non-cuda, tcp, P2PHANDSHAKE",
                     "sizes": {}}
        arena = np.ones(2 * sum(sizes) + 8 * batch, np.uint8)
        base, at = register(e, arena), 0
        for n, raddr in zip(sizes, info["addrs"], strict=True):
            d, s = base + at, base + at + n

            def read(d=d, raddr=raddr, n=n) -> None:
                _ok(e.batch_transfer_sync_read(target, [d], [raddr], [n]), "read")

            def write(s=s, raddr=raddr, n=n) -> None:
                _ok(e.batch_transfer_sync_write(target, [s], [raddr], [n]), "write")

            read()
            check_read(arena[at:at + n], WHO)
            write()
            at += 2 * n
            iters = iterations(cfg, n)
            res["sizes"][str(n)] = {"read_s": [mean_s(read, iters) for _ in range(reps)],
                                    "write_s": [mean_s(write, iters) for _ in range(reps)]}
        span = max(1, (sizes[0] - 8) // 16)
        srcs = [base + at + 8 * k for k in range(batch)]
        dsts = [info["addrs"][0] + 16 * (k % span) for k in range(batch)]

        def writes() -> None:
            _ok(e.batch_transfer_sync_write(target, srcs, dsts, [8] * batch), "8 B writes")

        writes()
        res["writes8_s"] = [mean_s(writes, 20) for _ in range(reps)]
        return res


if __name__ == "__main__":
    main(own, measure)
