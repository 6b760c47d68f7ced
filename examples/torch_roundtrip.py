"""A torch CPU tensor there and back: zero-copy send, receive into a preallocated tensor.

    pip install torch          # optional; any CPU build works
    python examples/torch_roundtrip.py [--mib 64]

A CPU tensor shares its memory with ``tensor.numpy()``, so the channel sends from
and receives into the tensor's own storage: the peer doubles what it gets and sends
it back into a tensor the first process allocated up front.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys

try:
    import torch
except ImportError:
    torch = None

import rdmamw


def peer(address: str, numel: int) -> None:
    """Receive a tensor, double it, send it back."""
    ch = rdmamw.Channel.open(address, timeout=30)
    t = torch.empty(numel, dtype=torch.float32)
    n = ch.recv_into(t.numpy(), timeout=60)              # lands in t's storage
    assert n == t.numel() * t.element_size()
    t.mul_(2)
    ch.send_batch([t.numpy()]).wait()
    ch.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="tensor size in MiB (default 64)")
    a = ap.parse_args()
    if torch is None:
        print("torch is not installed; this example needs it: pip install torch "
              "(a CPU build is enough). Nothing was run.", file=sys.stderr)
        return 0
    numel = a.mib << 18
    address = f"shm://torch-roundtrip-{os.getpid()}"
    with rdmamw.listen(address) as lst:
        p = mp.get_context("spawn").Process(target=peer, args=(address, numel))
        p.start()
        ch = lst.accept(timeout=30)
        x = torch.randn(numel)
        ch.send_batch([x.numpy()]).wait()                # x may change after wait()
        back = torch.empty_like(x)
        n = ch.recv_into(back.numpy(), timeout=60)
        ok = n == x.numel() * 4 and torch.equal(back, x * 2)
        print(f"round trip of a {a.mib} MiB tensor: {'equal to 2x' if ok else 'WRONG'}; "
              + ", ".join(f"{k} {v}" for k, v in ch.stats().items()
                          if k in ("rndv_sends", "rndv_reads", "rndv_writes")))
        p.join(60)
        ch.close()
    return 0 if ok and p.exitcode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
