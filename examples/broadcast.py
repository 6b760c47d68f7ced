"""Parameter broadcast: one rank's model parameters to every rank, as at the start
of data-parallel training (or after a checkpoint load on rank 0).

    python -m rdmamw.bootstrap.launch -n 4 -- python examples/broadcast.py --mib 16
    python -m rdmamw.bootstrap.launch -n 4 -- python examples/broadcast.py --via channel

--via collective (default): rdmamw.collectives.broadcast per tensor (pipelined
chains / trees chosen by the collectives). --via channel: the root opens a Channel
to every rank and sends each tensor in eager-limit blocks; the others receive them
straight into their arrays. Every rank then prints one JSON line with a digest of
its parameters: equal digests on all ranks mean the broadcast worked."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

import rdmamw
import rdmamw.collectives as coll


def parameters(mib: int, seed: int | None) -> dict[str, np.ndarray]:
    """A model's tensors (a few shapes, about ``mib`` MiB); seed None: zeros."""
    n = max(1, (mib << 20) // 4 // 3)
    shapes = {"embed": (n // 256, 256), "dense.w": (n // 512, 512), "dense.b": (512,),
              "head": (n,)}
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s).astype(np.float32) if seed is not None
                else np.zeros(s, np.float32)) for k, s in shapes.items()}


def via_channel(params: dict[str, np.ndarray], root: int, w: rdmamw.World) -> None:
    """Root sends every tensor to each rank over a Channel; the others receive."""
    peers = [r for r in range(w.world_size) if r != w.rank] if w.rank == root else [root]
    chans = {r: rdmamw.Channel.open(r) for r in peers}
    stream = (m for _ in iter(int, 1) for m in chans[root].recv_batch()) \
        if w.rank != root else None
    try:
        for a in params.values():
            flat = a.reshape(-1)
            if w.rank == root:
                for ch in chans.values():
                    step = ch.eager_limit // flat.itemsize
                    ch.send_batch([flat[o:o + step] for o in range(0, flat.size, step)]
                                  ).wait()
                continue
            got = 0
            while got < flat.size:          # a batch may hold blocks of the next tensor too
                with next(stream) as m:
                    blk = np.frombuffer(m, flat.dtype)
                    flat[got:got + blk.size] = blk
                    got += blk.size
                    del blk
    finally:
        for ch in chans.values():
            ch.close()


def digest(params: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(k.encode() + params[k].tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=8, help="model size")
    ap.add_argument("--root", type=int, default=0)
    ap.add_argument("--via", choices=("collective", "channel"), default="collective")
    a = ap.parse_args()
    w = rdmamw.init()
    if not 0 <= a.root < w.world_size:
        raise SystemExit(f"--root {a.root} is not a rank of a world of {w.world_size}")
    params = parameters(a.mib, seed=1234 if w.rank == a.root else None)
    coll.barrier()
    t0 = time.perf_counter()
    if a.via == "collective":
        for arr in params.values():
            coll.broadcast(arr, root=a.root)
    else:
        via_channel(params, a.root, w)
    dt = time.perf_counter() - t0
    nbytes = sum(p.nbytes for p in params.values())
    sys.stdout.write(json.dumps({"rank": w.rank, "via": a.via, "digest": digest(params),
                                 "bytes": nbytes, "seconds": dt}) + "\n")   # one write: shared pipe
    sys.stdout.flush()
    coll.default_comm().close()


if __name__ == "__main__":
    main()
