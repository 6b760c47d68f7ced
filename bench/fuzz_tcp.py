"""A long fuzz run of the tcp decoders (not in CI): by default one million frame
streams through the progress thread's decoder, plus one million token-handshake and
hello inputs. Any write outside the regions, crash or hang is a failure; the run
ends with counts of how each input ended.

    .venv/bin/python bench/fuzz_tcp.py [--inputs 1000000] [--seed 1] [--jobs 1]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import random
import sys
import time

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rdmamw import auth  # noqa: E402
from rdmamw.errors import ProtocolError  # noqa: E402
from rdmamw.providers.tcp import provider as tcp  # noqa: E402
from rdmamw.transport import wire as _wire
from tests.support.hooks import apply_stream  # noqa: E402
from tests.support.tcp_util import random_stream  # noqa: E402


def frames(seed: int, n: int) -> collections.Counter:
    rng, out = random.Random(seed), collections.Counter()
    for _ in range(n):
        data = random_stream(rng)
        applied, why, intact = apply_stream(data, answer_reads=False)
        if not intact:
            raise SystemExit(f"OUT-OF-BOUNDS WRITE for input {data.hex()}")
        out[why] += 1
        out["frames applied"] += applied
    return out


def hellos(seed: int, n: int) -> collections.Counter:
    rng, out = random.Random(seed), collections.Counter()
    keys = ["v", "slots", "slot_size", "hb", "mode", "rank", "x"]
    vals = [1, 0, 64, 4096, 1 << 20, 1 << 31, -1, 0.25, 1e9, "ack", "batched", None, True,
            b"\0", [1], {"a": 1}]
    for _ in range(n):
        if rng.random() < 0.5:
            data = msgpack.packb({k: rng.choice(vals) for k in rng.sample(keys, rng.randrange(7))})
        else:
            data = rng.randbytes(rng.randrange(40))
        try:
            tcp.parse_hello(_wire.decode(data), rng.random() < 0.5)
            out["hello accepted"] += 1
        except ProtocolError:
            out["hello refused"] += 1
        proof = rng.randbytes(auth.PROOF_BYTES if rng.random() < 0.9 else rng.randrange(80))
        try:
            auth.check_proof(proof, b"key", b"\0" * auth.NONCE)
            raise SystemExit("random bytes proved the token")
        except auth.AuthError:
            out["proof refused"] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    per = args.inputs // args.jobs
    with multiprocessing.Pool(args.jobs) as pool:
        parts = pool.starmap(frames, [(args.seed + j, per) for j in range(args.jobs)])
    total = sum(parts, collections.Counter())
    t1 = time.perf_counter()
    total += hellos(args.seed, args.inputs)
    t2 = time.perf_counter()
    print(f"frame streams: {per * args.jobs} in {t1 - t0:.1f} s; handshake inputs: "
          f"{args.inputs} in {t2 - t1:.1f} s; out-of-bounds writes: 0, crashes: 0")
    for k, v in sorted(total.items()):
        print(f"  {k:28s} {v}")


if __name__ == "__main__":
    main()
