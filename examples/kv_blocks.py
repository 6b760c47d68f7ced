"""Move KV-cache blocks between a prefill and a decode process by a block table.

    python examples/kv_blocks.py                      # 512 blocks of 32 KiB, 64 wanted
    python examples/kv_blocks.py --blocks 2048 --block-kib 64 --want 256 --reps 50

The prefill process keeps its KV cache as one paged buffer (``--blocks`` blocks of
``--block-kib`` KiB) and exposes it, read-only, to the decode process's channel. It
sends one message: the region's reference and the block table (sequence -> the
blocks that hold it, scattered through the buffer). The decode process picks the
sequence it serves, READs exactly its blocks in ONE batch (one chain, one doorbell)
into its own contiguous buffer, and checks every byte; no thread of the prefill
process takes part in the reads. Then it repeats the batch ``--reps`` times and prints
the median rate, beside a local gather of the same blocks (one ``np.copyto`` per
block, interleaved with the reads) as the memory's own speed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import time

import numpy as np

import rdmamw


def block_value(b: int) -> int:
    """What every element of block ``b`` holds (so the reader can check it)."""
    return b * 7 % 65521


def prefill(address: str, blocks: int, block_elems: int, seqs: int) -> None:
    ch = rdmamw.Channel.open(address, timeout=30)
    cache = np.empty((blocks, block_elems), np.int32)     # the paged KV buffer
    for b in range(blocks):
        cache[b] = block_value(b)
    rng = np.random.default_rng(0)
    order = rng.permutation(blocks)                       # pages scattered, as in a cache
    table = {f"seq{i}": [int(b) for b in part] for i, part in
             enumerate(np.array_split(order, seqs))}
    region = ch.expose(cache, access="r")
    ch.send(pickle.dumps({"ref": region.ref, "block_bytes": cache[0].nbytes,
                          "table": table}))
    ch.recv(timeout=120)                                  # the decode side is done
    region.revoke()
    ch.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=512, help="blocks in the paged buffer")
    ap.add_argument("--block-kib", type=int, default=32)
    ap.add_argument("--want", type=int, default=64, help="blocks of the sequence read")
    ap.add_argument("--reps", type=int, default=20, help="batches timed")
    a = ap.parse_args()
    seqs = max(1, a.blocks // a.want)
    block_elems = (a.block_kib << 10) // 4
    address = f"shm://kv-blocks-{os.getpid()}"
    with rdmamw.listen(address) as lst:
        p = mp.get_context("spawn").Process(target=prefill,
                                            args=(address, a.blocks, block_elems, seqs))
        p.start()
        ch = lst.accept(timeout=30)
        with ch.recv(timeout=60) as m:
            msg = pickle.loads(m)
        ref, size, wanted = msg["ref"], msg["block_bytes"], msg["table"]["seq0"]
        dst = np.zeros((len(wanted), block_elems), np.int32)

        def read_blocks() -> None:
            ops = ch.batch()
            for i, b in enumerate(wanted):
                ops.read(ref, dst[i], offset=b * size)
            ops.post().wait()

        chains0 = ch.stats()["rmem_chains"]
        read_blocks()
        expect = np.array([block_value(b) for b in wanted], np.int32)[:, None]
        ok = bool((dst == expect).all())
        chains = ch.stats()["rmem_chains"] - chains0
        reads, copies = [], []
        local = np.empty_like(dst)
        cache_copy = np.zeros((a.blocks, block_elems), np.int32)
        cache_copy[wanted] = dst                          # a local paged buffer to gather from
        for _ in range(a.reps):                           # interleaved: the same load for both
            t0 = time.perf_counter()
            read_blocks()
            reads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i, b in enumerate(wanted):
                np.copyto(local[i], cache_copy[b])
            copies.append(time.perf_counter() - t0)
        dt, dl = statistics.median(reads), statistics.median(copies)
        ch.send(b"done")
        p.join(30)
        ch.close()
    nbytes = dst.nbytes
    print(f"kv_blocks: {len(wanted)} of {a.blocks} blocks ({a.block_kib} KiB each, "
          f"{nbytes >> 10} KiB) read in one batch ({chains} chain): "
          f"{'content correct' if ok else 'CONTENT WRONG'}")
    print(f"kv_blocks: batch read {nbytes / dt / 1e9:.2f} GB/s ({dt * 1e6:.0f} us, median), "
          f"local gather {nbytes / dl / 1e9:.2f} GB/s, ratio {dl / dt:.2f}")
    return 0 if ok and p.exitcode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
