"""The cost of the timeline (rdmamw.trace) where it has hooks: small allreduces (the
collectives' per-step path; the channels' own send/receive path has none, so the 8 B
batched rate is the same code on or off), with tracing on against off, in the same
run, in the same two processes.

    python bench/trace_bench.py                    # 24 blocks of 2000 allreduces
    python bench/trace_bench.py --blocks 40 --json
    python bench/trace_bench.py --rate [--batch 1]   # the 8 B batched rate, 2 ranks
    python bench/trace_bench.py --cpu [--batch 1]    # CPU per message, one process

Two ranks on shm (rdmamw.bootstrap.launch) run ``--calls`` allreduces of 8 float32
(the ring algorithm at 2 ranks: 4 header steps, 2 data steps, a wait: 7 spans and the
collective's per call) per block. Blocks come in pairs, one with a timeline recorded
on both ranks and one without, in an order that alternates from pair to pair; each
rank switches at the same block (no message needed: the order is fixed). Prints the
median rate of each side, the ratio of the medians and the median of the per-pair
ratios on/off with its quartiles; ``--control`` records nothing in the "on" blocks
(the A/A noise). Then the CPU time of one span (Tracer.step) in this process."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np

    import rdmamw
    from rdmamw import observe
    from rdmamw.collectives import allreduce
    from rdmamw.trace.recorder import Tracer
    w = rdmamw.init()
    a = np.ones(8, np.float32)
    for _ in range(200):                                  # warm-up: channels open
        allreduce(a, algorithm="ring")
    out = []
    for i in range(args.blocks):
        on = (i % 2 == 0) == (i // 2 % 2 == 0)            # on/off, off/on, on/off, ...
        tr = Tracer("unused", 10_000_000) if on and not args.control else None
        observe.tracer = tr
        t0 = time.perf_counter()
        for _ in range(args.calls):
            allreduce(a, algorithm="ring")
        dt = time.perf_counter() - t0
        observe.tracer = None
        out.append({"on": on, "rate": args.calls / dt,
                    "spans": 0 if tr is None else len(tr.spans) + len(tr.steps)})
    if w.rank == 0:
        print(json.dumps(out), flush=True)


def rate_main(args: argparse.Namespace) -> None:
    """``--rate``: rank 0 streams batches of ``--batch`` 8 B messages to rank 1 for
    ``--seconds`` per block (bench/metrics_bench.py's stream), both ranks recording the
    channels' records (rdmamw.engine._engine.trace_start: what the hooks write) in the
    "on" blocks; rank 1 counts what arrives."""
    from metrics_bench import count_arrivals, stream  # bench/ is sys.path[0]

    import rdmamw
    from rdmamw.engine import _engine
    w = rdmamw.init()
    ch = rdmamw.Channel.open(1 - w.rank)
    batch = [b"\0" * 8] * args.batch
    out = []
    for i in range(args.blocks):
        on = (i % 2 == 0) == (i // 2 % 2 == 0)            # on/off, off/on, on/off, ...
        if on and not args.control:
            _engine.trace_start(args.ring)
        if w.rank == 0:
            ch.recv().release()                             # the receiver is ready
            out.append({"on": on, "rate": stream(ch, batch, args.seconds)})
        else:
            ch.send(b"go").wait()
            count_arrivals(ch)
        records, _ = _engine.trace_stop()
        if out:
            out[-1]["records"] = len(records) // _engine.TRACE_RECORD_BYTES
    if w.rank == 0:
        print(json.dumps(out), flush=True)
    ch.close()


def cpu_main(args: argparse.Namespace) -> dict[str, float]:
    """``--cpu``: the CPU time per 8 B message of bench/call_cost.py's loop (one process,
    one thread: send a batch of ``--batch``, receive it, release it) with the channels'
    records on and off, ``--blocks`` blocks alternating; robust to a loaded machine
    (other processes' time is not counted), the rate's part of the sender is not."""
    from call_cost import pair, per_message_ns  # bench/ is sys.path[0]

    from rdmamw.engine import _engine
    a, b, lst = pair()
    n = max(100_000, 25_000 * args.batch)
    res: dict[bool, list[float]] = {False: [], True: []}
    try:
        per_message_ns(a, b, args.batch, 20_000)        # warm up
        for i in range(args.blocks):
            on = (i % 2 == 0) == (i // 2 % 2 == 0)      # on/off, off/on, on/off, ...
            if on and not args.control:
                _engine.trace_start(args.ring)
            res[on].append(per_message_ns(a, b, args.batch, n))
            _engine.trace_stop()
    finally:
        a.close(), b.close(), lst.close()
    off, on = statistics.median(res[False]), statistics.median(res[True])
    return {"cpu_ns_off": off, "cpu_ns_on": on, "cpu_ratio": off / on,
            "ns_per_batch": (on - off) * args.batch}


def span_cost(reps: int = 200_000) -> float:
    """CPU µs of one Tracer.step (a send of one 32 B buffer)."""
    import numpy as np

    from rdmamw.trace.recorder import Tracer
    tr = Tracer("unused", reps + 1)
    buf = [np.ones(8, np.float32)]
    t0 = time.process_time()
    for _ in range(reps):
        tr.step(0, 1, buf, None, 1, tr.clock())
    return (time.process_time() - t0) / reps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=24, help="measured blocks (even)")
    ap.add_argument("--calls", type=int, default=2000, help="allreduces per block")
    ap.add_argument("--control", action="store_true",
                    help="A/A: the 'on' blocks record nothing either")
    ap.add_argument("--rate", action="store_true",
                    help="the 8 B batched rate of a channel instead of allreduces")
    ap.add_argument("--batch", type=int, default=16, help="--rate: messages per batch")
    ap.add_argument("--seconds", type=float, default=0.5, help="--rate: seconds per block")
    ap.add_argument("--ring", type=int, default=1 << 20,
                    help="--rate: records the ring keeps (RDMAMW_TRACE_MAX_RECORDS's default)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--rank-of-job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true",
                    help="CPU time per message in one process (call_cost's loop) instead")
    args = ap.parse_args()
    if args.cpu:
        res = cpu_main(args)
        if args.json:
            print(json.dumps(res))
            return 0
        print(("A/A control (nothing recorded): " if args.control else "") +
              f"CPU per 8 B message (send + receive + release, one process), batches of "
              f"{args.batch}, {args.blocks} blocks")
        print(f"  tracing off  {res['cpu_ns_off']:8.1f} ns (median)")
        print(f"  tracing on   {res['cpu_ns_on']:8.1f} ns (median): "
              f"{res['ns_per_batch']:+.0f} ns a batch, off/on {res['cpu_ratio']:.3f}")
        return 0
    if args.rank_of_job:
        (rate_main if args.rate else rank_main)(args)
        return 0
    from rdmamw.bootstrap.launch import spawn
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-of-job", "--blocks",
           str(args.blocks), "--calls", str(args.calls), "--batch", str(args.batch),
           "--seconds", str(args.seconds)] + (["--control"] if args.control else []) + (
               ["--rate"] if args.rate else [])
    procs = spawn(2, cmd, stdout=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit("a rank failed")
    blocks = json.loads(outs[0].splitlines()[-1])
    on = [b["rate"] for b in blocks if b["on"]]
    off = [b["rate"] for b in blocks if not b["on"]]
    pairs = [(a["rate"] / b["rate"]) if a["on"] else (b["rate"] / a["rate"])
             for a, b in zip(blocks[::2], blocks[1::2], strict=True)]
    res = {"calls": args.calls, "blocks": len(blocks), "control": args.control,
           "rate_on_median": statistics.median(on), "rate_off_median": statistics.median(off),
           "ratio_of_medians": statistics.median(on) / statistics.median(off),
           "paired_ratio_median": statistics.median(pairs),
           "paired_ratio_quartiles": statistics.quantiles(pairs, n=4)[::2]}
    if args.rate:
        res.update(batch=args.batch, seconds=args.seconds,
                   records=max(b.get("records", 0) for b in blocks))
    else:
        res.update(spans_per_call=max(b["spans"] for b in blocks) / args.calls,
                   span_cpu_us=span_cost())
    if args.json:
        print(json.dumps(res))
        return 0
    if args.rate:
        print(("A/A control (nothing recorded): " if args.control else "") +
              f"8 B messages in batches of {args.batch}, shm, {len(blocks)} blocks of "
              f"{args.seconds} s, up to {res['records']} records per block when on")
        print(f"  tracing off  {res['rate_off_median'] / 1e6:8.2f} M msg/s (median)")
        print(f"  tracing on   {res['rate_on_median'] / 1e6:8.2f} M msg/s (median)")
        print(f"  on/off: ratio of medians {res['ratio_of_medians']:.3f}, median of paired "
              f"ratios {res['paired_ratio_median']:.3f} (quartiles "
              f"{res['paired_ratio_quartiles'][0]:.3f}-"
              f"{res['paired_ratio_quartiles'][1]:.3f})")
        return 0
    print(("A/A control (nothing recorded): " if args.control else "") +
          f"allreduce of 8 float32 at 2 ranks on shm, {len(blocks)} blocks of "
          f"{args.calls} calls, {res['spans_per_call']:.0f} spans per call when on")
    print(f"  tracing off  {res['rate_off_median']:9.0f} allreduces/s (median)")
    print(f"  tracing on   {res['rate_on_median']:9.0f} allreduces/s (median)")
    print(f"  on/off: ratio of medians {res['ratio_of_medians']:.3f}, median of paired "
          f"ratios {res['paired_ratio_median']:.3f} (quartiles "
          f"{res['paired_ratio_quartiles'][0]:.3f}-{res['paired_ratio_quartiles'][1]:.3f})")
    print(f"  one span (Tracer.step): {res['span_cpu_us']:.2f} us CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
