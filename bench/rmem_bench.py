"""Remote memory, same run: rdmamw's one-sided ``read`` / ``write`` of a peer's exposed
buffer against a single-thread ``np.copyto`` of the same size, a two-sided pull of it
on the same channel, and the peers on the same transport (docs/remote-memory.md,
docs/benchmarks/remote-memory.md).

    python bench/rmem_bench.py                      # shm, 64 KiB and 4 MiB, peers found
    python bench/rmem_bench.py --provider tcp --peers none
    python bench/rmem_bench.py --provider shm,tcp --peers none   # both, one run
    python bench/rmem_bench.py --provider verbs --reps 5 --iters 8 --peers none  # VM
    python bench/rmem_bench.py --peers mooncake,nixl,ucx --rounds 2

An owner process exposes one buffer per size (allocated by rdmamw's
``memory.pool.aligned_empty``; on shm, whose atomics need memory the peer can map,
``memory.shared``) and then waits in ``recv`` (idle in the engine: on shm
it may help copy a large read, as for rendezvous); this process reads the whole buffer
into a reused destination, and writes a source over it, ``--iters`` times per rep,
and times ``np.copyto`` between two warm arrays of the size the same number of times,
rep by rep. Medians of the per-rep means; ``copyto/read`` = copyto time / read time
(>= 1: the read is at least as fast). The pull: the owner's application thread answers
a request with the buffer as a message, received with ``recv_into`` into the same
destination (what a read saves on tcp); ``pull/read`` = pull time / read time. Also
``--batch`` 8 B writes into one region, 16 B apart, as one ``ch.scatter`` (the array
form: one source buffer, the offsets an integer array; one chain): operations per
second; and,
where the provider has atomics (shm, tcp, verbs: the regions are then exposed
"atomic"), fetch_adds on one word beside single 8-byte reads of it, interleaved rep
by rep (``read8/fetch_add`` = read time / fetch_add time: both are one round trip on
tcp; on shm both run on the reader's mapping of the owner's shared memory: a copy, a
CPU atomic),
and ATOMIC_BATCH (64) fetch_adds posted as one ``ch.batch()`` beside as many single
ones, interleaved rep by rep (``batch64/single`` = the batched rate / the single rate).
``--provider shm,tcp`` runs both providers, rep by rep, in one run.

The peers (bench/peers/): UCX's ``ucx_perftest`` ``ucp_get`` / ``ucp_put_bw`` over
``posix`` beside rdmamw on shm; NIXL's Python API (UCX backend, DRAM) beside rdmamw on
shm; Mooncake's Transfer Engine (tcp) beside rdmamw on tcp. The Python peers run under
``--peers-python`` (bench/setup.sh's peers venv). rdmamw's runs and the peers' alternate
``--rounds`` times; each value is the median of every rep of every round.
``peer/rdmamw`` = the peer's time per operation / rdmamw's (>= 1: rdmamw at least as
fast). Targets: rdmamw's 64 KiB and 4 MiB read and write >= each Python peer's on
the same transport; on shm, read 4 MiB >= 1.0x np.copyto, 64 KiB >= 0.8x, batched 8 B
writes >= 10 M ops/s. The box is shared: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = {"64K": 64 << 10, "4M": 4 << 20}
STRIDE = 16                      # the batched 8 B writes' spacing (the peers' too)
#: each peer, the rdmamw provider it is compared with, and how it runs
PEERS = {"ucx": "shm", "nixl": "shm", "mooncake": "tcp"}
PYTHON_PEERS = {"nixl": "nixl_cu12", "mooncake": "mooncake.engine"}
TARGETS = {"read 4M / np.copyto": 1.0, "read 64K / np.copyto": 0.8}
WRITES_TARGET = 10e6
#: the providers with fetch_add / compare_swap (docs/remote-memory.md)
ATOMICS = ("shm", "tcp", "verbs")
#: fetch_adds in one batch, against as many single ones
ATOMIC_BATCH = 64

OWNER = r"""
import sys, numpy as np, rdmamw
import rdmamw.memory
from rdmamw.memory.pool import aligned_empty
lst = rdmamw.listen(sys.argv[1])
print(lst.address, flush=True)  # tcp: the port it was given
ch = lst.accept(timeout=60)
sizes = [int(s) for s in sys.argv[2].split(",")]
shared = sys.argv[1].startswith("shm") and sys.argv[3] == "atomic"
bufs = [rdmamw.memory.shared(n) if shared else aligned_empty(n) for n in sizes]
for b in bufs:
    b[:] = np.arange(b.size, dtype=np.uint8)        # what the reader checks once
regs = [ch.expose(b, sys.argv[3]) for b in bufs]
ch.send_batch([bytes(r.ref) for r in regs])
while True:                     # idle in the engine (reads), or answering pulls
    ask = bytes(ch.recv(timeout=600))
    if ask == b"done":
        break
    ch.send(bufs[int(ask)])
ch.close()
"""


def _mean_s(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _atomics(ch: Any, region: Any, reps: int, iters: int = 200) -> dict[str, list]:
    """fetch_adds on the region's first word against 8-byte reads of it, and
    ATOMIC_BATCH of them in one batch against as many single ones (seconds a
    fetch_add), interleaved rep by rep; the word's total checked at the end, and each
    batch's old values (consecutive: nothing else adds meanwhile)."""
    before = ch.fetch_add(region, 0, 0).wait()
    dst = np.zeros(8, np.uint8)
    fadds, reads, singles, batched = [], [], [], []
    rounds = max(2, iters // ATOMIC_BATCH)

    def single64() -> None:
        for _ in range(ATOMIC_BATCH):
            ch.fetch_add(region, 0, 1)

    def batch64() -> None:
        ops = ch.batch()
        for _ in range(ATOMIC_BATCH):
            ops.fetch_add(region, 0, 1)
        old = ops.post().values
        if [(v - old[0]) % 2**64 for v in old] != list(range(ATOMIC_BATCH)):
            raise RuntimeError(f"a batch of fetch_adds gave {old}")

    for _ in range(reps):
        fadds.append(_mean_s(lambda: ch.fetch_add(region, 0, 1), iters))
        reads.append(_mean_s(lambda: ch.read(region, dst), iters))
        singles.append(_mean_s(single64, rounds) / ATOMIC_BATCH)
        batched.append(_mean_s(batch64, rounds) / ATOMIC_BATCH)
    after = ch.fetch_add(region, 0, 0).wait()
    want = reps * (iters + 2 * rounds * ATOMIC_BATCH)
    assert (after - before) % 2**64 == want, "fetch_adds lost"
    return {"fadd_s": fadds, "read8_s": reads, "fadd_single64_s": singles,
            "fadd_batch64_s": batched}


def rdmamw_run(provider: str, sizes: list[int], reps: int, iters: int, batch: int,
               bytes_per_rep: int) -> dict:
    """One owner process, ``reps`` reps per size: per-rep mean seconds of a read, a
    write, an np.copyto and a pull; per-rep seconds of one ``scatter`` of ``batch`` 8 B
    writes."""
    import rdmamw
    from rdmamw.channel.remote import RegionRef

    addr = {"shm": f"shm://rmem-bench-{os.getpid()}-{time.monotonic_ns()}",
            "tcp": "tcp://127.0.0.1:0", "verbs": "verbs://127.0.0.1:0"}[provider]
    atomics = provider in ATOMICS
    owner = subprocess.Popen([sys.executable, "-c", OWNER, addr, ",".join(map(str, sizes)),
                              "atomic" if atomics else "rw"],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    res: dict = {"tool": f"rdmamw {provider}", "sizes": {}}
    try:
        assert owner.stdout is not None
        ch = rdmamw.Channel.open(owner.stdout.readline().strip(), timeout=30)
        refs = [bytes(m) for m in ch.recv_batch(max_messages=len(sizes), timeout=30)]
        while len(refs) < len(sizes):
            refs += [bytes(m) for m in ch.recv_batch(timeout=30)]
        for i, (n, ref) in enumerate(zip(sizes, refs, strict=True)):
            k = iters or max(8, bytes_per_rep // n)
            dst, src = np.zeros(n, np.uint8), np.ones(n, np.uint8)
            a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)
            region = RegionRef.from_bytes(ref)

            def read(dst=dst, region=region) -> None:
                ch.read(region, dst)

            def write(src=src, region=region) -> None:
                ch.write(src, region).wait()

            def copy(a=a, b=b) -> None:
                np.copyto(b, a)

            def pull(dst=dst, ask=b"%d" % i) -> None:
                ch.send(ask)
                ch.recv_into(dst, timeout=30)

            read()
            if not np.array_equal(dst, np.arange(n, dtype=np.uint8)):
                raise RuntimeError(f"rdmamw read of {n} B: not the owner's bytes")
            for fn in (write, copy, pull):
                fn()
            per = {"read_s": [], "write_s": [], "copyto_s": [], "pull_s": []}
            for _ in range(reps):
                for key, fn in (("read_s", read), ("copyto_s", copy), ("write_s", write),
                                ("pull_s", pull)):
                    per[key].append(_mean_s(fn, k))
            res["sizes"][str(n)] = per
        region = RegionRef.from_bytes(refs[0])
        words = np.ones(8 * batch, np.uint8)
        offsets = np.arange(batch) * STRIDE % (region.length - 8)

        def writes() -> None:       # the array form: one call, a WRITE a piece
            ch.scatter(words, region, offsets, 8).wait()

        writes()
        res["writes8_s"] = [_mean_s(writes, 20) for _ in range(reps)]
        if atomics:
            res["atomics"] = _atomics(ch, region, reps)
        ch.send(b"done")
        ch.close()
    finally:
        owner.wait(30)
    return res


def peer_run(name: str, python: str, cfg: dict) -> dict:
    """One run of a peer: its RESULT (ucx: ucx_perftest pairs run from here)."""
    if name == "ucx":
        if str(HERE / "peers") not in sys.path:
            sys.path.insert(0, str(HERE / "peers"))
        import ucx_peer

        return ucx_peer.one_sided(cfg)
    p = subprocess.run([python, str(HERE / "peers" / f"{name}_peer.py"), json.dumps(cfg)],
                       cwd=ROOT, capture_output=True, text=True, timeout=cfg["timeout"])
    return parse_result(p.stdout, f"{name} (exit {p.returncode}): {p.stderr[-600:]}")


def parse_result(out: str, what: str) -> dict:
    """The last ``RESULT {json}`` line of a peer's output (its libraries log around it)."""
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"no RESULT line from {what}")
    res = json.loads(lines[-1][len("RESULT "):])
    if not isinstance(res.get("sizes"), dict) or not isinstance(res.get("writes8_s"), list):
        raise RuntimeError(f"a RESULT without sizes and writes8_s from {what}")
    return res


def merge(runs: list[dict]) -> dict:
    """Rounds of one system into one: every rep's value, in round order."""
    out: dict = {"tool": runs[0]["tool"], "sizes": {}, "writes8_s": []}
    for r in runs:
        for n, per in r["sizes"].items():
            into = out["sizes"].setdefault(n, {})
            for key, vals in per.items():
                into.setdefault(key, []).extend(vals)
        out["writes8_s"].extend(r["writes8_s"])
        for key, vals in r.get("atomics", {}).items():
            out.setdefault("atomics", {}).setdefault(key, []).extend(vals)
    return out


def available(name: str, python: str) -> str:
    """Why a peer cannot run here ("" when it can)."""
    if name == "ucx":
        return "" if shutil.which("ucx_perftest") else "ucx_perftest not on PATH (ucx-utils)"
    if not Path(python).exists():
        return f"no peers Python at {python} (bash bench/setup.sh; RDMAMW_PEERS_PY)"
    p = subprocess.run([python, "-c", f"import {PYTHON_PEERS[name]}"], capture_output=True,
                       text=True, timeout=120)
    return "" if p.returncode == 0 else f"{PYTHON_PEERS[name]}: {p.stderr.strip()[-300:]}"


def _med(vals: list[float]) -> float:
    return statistics.median(vals)


def summarize(rdmamw: dict, peers: dict, batch: int, main: str) -> tuple[list, list]:
    """Rows (one per system, size and operation, and the 8 B rates) and target rows.
    ``rdmamw``: provider -> merged run; ``peers``: name -> merged run; ``main``: the
    provider compared with np.copyto and the pull."""
    rows, targets = [], []
    for prov, r in rdmamw.items():
        for n, per in r["sizes"].items():
            row = {"system": f"rdmamw {prov}", "size": int(n),
                   **{k.replace("_s", "_us"): _med(v) * 1e6 for k, v in per.items()}}
            if "copyto_s" in per:
                row["copyto/read"] = _med(per["copyto_s"]) / _med(per["read_s"])
                row["pull/read"] = _med(per["pull_s"]) / _med(per["read_s"])
            rows.append(row)
        rows.append({"system": f"rdmamw {prov}", "size": 8,
                     "writes8_ops_per_s": batch / _med(r["writes8_s"])})
        if "atomics" in r:
            f, rd = _med(r["atomics"]["fadd_s"]), _med(r["atomics"]["read8_s"])
            rows.append({"system": f"rdmamw {prov}", "size": 8, "fetch_add_ops_per_s": 1 / f,
                         "fetch_add_us": f * 1e6, "read8_us": rd * 1e6,
                         "read8/fetch_add": rd / f})
            if "fadd_batch64_s" in r["atomics"]:
                one = _med(r["atomics"]["fadd_single64_s"])
                many = _med(r["atomics"]["fadd_batch64_s"])
                rows.append({"system": f"rdmamw {prov}", "size": 8,
                             f"single{ATOMIC_BATCH}_fetch_add_ops_per_s": 1 / one,
                             f"batch{ATOMIC_BATCH}_fetch_add_ops_per_s": 1 / many,
                             f"batch{ATOMIC_BATCH}/single": one / many})
    if main == "shm" and "shm" in rdmamw:
        shm = rdmamw["shm"]["sizes"]
        for label, want in TARGETS.items():
            n = str(SIZES[label.split()[1]])
            if n in shm:
                v = _med(shm[n]["copyto_s"]) / _med(shm[n]["read_s"])
                targets.append(_target(f"shm {label} >= {want}", v, v >= want))
        ops = batch / _med(rdmamw["shm"]["writes8_s"])
        targets.append(_target(f"shm batched 8 B writes >= {WRITES_TARGET / 1e6:.0f} M ops/s",
                               ops / 1e6, ops >= WRITES_TARGET))
    for name, r in peers.items():
        if "error" in r:
            rows.append({"system": name, "error": r["error"]})
            continue
        prov = PEERS[name]
        mine = rdmamw[prov]
        for n, per in r["sizes"].items():
            row = {"system": name, "size": int(n), "tool": r["tool"]}
            for op in ("read", "write"):
                theirs, ours = _med(per[f"{op}_s"]), _med(mine["sizes"][n][f"{op}_s"])
                row[f"{op}_us"] = theirs * 1e6
                row[f"{op}_{name}/rdmamw"] = theirs / ours
                if name in PYTHON_PEERS:
                    targets.append(_target(f"{prov} {op} {int(n) >> 10} KiB: rdmamw >= "
                                           f"{name} ({name}/rdmamw time)", theirs / ours,
                                           theirs >= ours))
            rows.append(row)
        ops = batch / _med(r["writes8_s"])
        rows.append({"system": name, "size": 8, "writes8_ops_per_s": ops,
                     f"rdmamw/{name} 8 B write rate": batch / _med(mine["writes8_s"]) / ops})
    return rows, targets


def _target(label: str, value: float, ok: bool) -> dict:
    return {"target": label, "value": value, "verdict": "PASS" if ok else "FAIL"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm",
                    help="shm, tcp or verbs, or several, comma-separated (one run)")
    ap.add_argument("--sizes", default="64K,4M")
    ap.add_argument("--reps", type=int, default=5, help="per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=0, help="per rep (default: ~64 MiB)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--peers", default="auto",
                    help="auto (those that run here), none, or of ucx,nixl,mooncake")
    ap.add_argument("--peers-python", default=os.environ.get(
        "RDMAMW_PEERS_PY", str(ROOT / ".venv-peers" / "bin" / "python")))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [SIZES[n] if n in SIZES else int(n) for n in args.sizes.split(",")]
    asked = list(PEERS) if args.peers == "auto" else [
        p for p in args.peers.split(",") if p and p != "none"]
    peers, skipped = [], {}
    for name in asked:
        why = available(name, args.peers_python) if name in PEERS else "unknown peer"
        if why and args.peers != "auto":
            skipped[name] = why
        elif not why:
            peers.append(name)
    mine = args.provider.split(",")
    if not set(mine) <= {"shm", "tcp", "verbs"}:
        ap.error(f"--provider: shm, tcp or verbs, not {args.provider!r}")
    providers = list(dict.fromkeys([*mine, *(PEERS[p] for p in peers)]))
    cfg = {"sizes": sizes, "reps": args.reps, "batch": args.batch, "iters": args.iters,
           "bytes_per_rep": 64 << 20, "timeout": 900}
    runs: dict = {}
    for _ in range(args.rounds):
        for prov in providers:
            runs.setdefault(prov, []).append(rdmamw_run(prov, sizes, args.reps, args.iters,
                                                        args.batch, cfg["bytes_per_rep"]))
        for name in peers:
            try:
                runs.setdefault(name, []).append(peer_run(name, args.peers_python, cfg))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                skipped[name] = f"failed: {e}"
    peers = [p for p in peers if p not in skipped]
    rows, targets = summarize({p: merge(runs[p]) for p in providers},
                              {**{p: merge(runs[p]) for p in peers},
                               **{p: {"error": w} for p, w in skipped.items()}},
                              args.batch, mine[0])
    if args.json:
        print(json.dumps({"rows": rows, "targets": targets}, indent=1))
        return
    print(f"rmem_bench: {args.provider}; load {os.getloadavg()[0]:.2f}; medians of "
          f"{args.reps} reps x {args.rounds} rounds")
    for row in rows:
        print("  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()))
    for t in targets:
        print(f"  {t['verdict']}  {t['target']}: {t['value']:.3f}")


if __name__ == "__main__":
    main()
