"""The cost of the metrics: the 8 B batched message rate with rdmamw.metrics on against
off, in the same run, in the same two processes.

    python bench/metrics_bench.py                      # 24 blocks of 0.5 s, batches of 256
    python bench/metrics_bench.py --blocks 40 --scrape-interval 0.05 --json

Two ranks on shm (rdmamw.bootstrap.launch): rank 0 streams batches of ``--batch`` 8 B
messages to rank 1 for ``--seconds`` per block, with a window of send handles as
bench/run.py's rate does; rank 1 counts what arrives. Blocks come in pairs, one with
the metrics on and one off, in an order that alternates from pair to pair. On: both
ranks serve their endpoint (``rdmamw.metrics.serve``, port + rank) and this process
scrapes both every ``--scrape-interval`` s (0.1 s by default: 150 times Prometheus's
usual 15 s, so the collector's cost shows); off: both stopped (the scrapes are
refused by the kernel). Prints the median rate of each side, the ratio of the medians
and the median of the per-pair ratios on/off (the one to judge by: a pair shares the
machine's state of the moment) with its quartiles. ``--control`` turns nothing on in
the "on" blocks: the spread of that A/A run is the noise a ratio must stand out of.
Then the CPU time of one scrape's answer in this process with 2, 16 and 64 channels
open (shm pairs, both ends here), which does not depend on a quiet machine."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
STOP = b"\x01"
WINDOW = 8


def stream(ch: Any, batch: list[bytes], seconds: float) -> float:
    """Send ``batch`` over and over for ``seconds`` (WINDOW handles in flight), then
    STOP; the rate (messages/s) at which the receiver (:func:`count_arrivals`) took
    them."""
    handles: deque[Any] = deque()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        handles.append(ch.send_batch(batch))
        if len(handles) > WINDOW:
            handles.popleft().wait()
    ch.send(STOP)
    for h in handles:
        h.wait()
    return int(bytes(ch.recv())) / (time.perf_counter() - t0)


def count_arrivals(ch: Any) -> None:
    """The receiving side of :func:`stream`: count until STOP, answer the count."""
    n = 0
    while True:
        msgs = ch.recv_batch()
        n += len(msgs)
        last = len(msgs[-1]) if msgs else 0
        del msgs
        if last == 1:
            break
    ch.send(str(n - 1).encode()).wait()


def sender(args: argparse.Namespace, base: int) -> None:
    import rdmamw
    import rdmamw.metrics as metrics
    rdmamw.init()
    ch = rdmamw.Channel.open(1)
    batch = [b"\0" * 8] * args.batch
    out = []
    for i in range(args.blocks):
        on = (i % 2 == 0) == (i // 2 % 2 == 0)        # on/off, off/on, on/off, ...
        _switch(metrics, on and not args.control, base)
        ch.send(json.dumps({"on": on and not args.control}).encode()).wait()
        ch.recv().release()                             # the receiver switched too
        out.append({"on": on, "rate": stream(ch, batch, args.seconds)})
    ch.send(b"{}").wait()
    ch.recv().release()
    metrics.stop()
    print(json.dumps(out), flush=True)
    ch.close()


def receiver(base: int) -> None:
    import rdmamw
    import rdmamw.metrics as metrics
    rdmamw.init()
    ch = rdmamw.Channel.open(0)
    while True:
        with ch.recv() as m:
            cmd = json.loads(bytes(m))
        if "on" not in cmd:
            ch.send(b"ok").wait()
            break
        _switch(metrics, cmd["on"], base + 1)
        ch.send(b"ok").wait()
        count_arrivals(ch)
    metrics.stop()
    ch.close()


def _switch(metrics: object, on: bool, port: int) -> None:
    if on:
        metrics.serve(port, "127.0.0.1")    # type: ignore[attr-defined]
    else:
        metrics.stop()                      # type: ignore[attr-defined]


def scraper(ports: list[int], interval: float, stop: threading.Event, done: list[int]) -> None:
    """Scrape every port each ``interval`` s; count the scrapes that answered."""
    while not stop.wait(interval):
        for port in ports:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                done[0] += 1
            except OSError:
                pass


def scrape_cost(pairs: int, reps: int = 200) -> dict:
    """CPU seconds of one scrape's answer (collector and text) in a process with
    ``pairs`` shm channel pairs open: median over ``reps``, by process CPU time."""
    import threading as th

    from prometheus_client import CollectorRegistry, generate_latest

    import rdmamw
    from rdmamw.metrics.exporter import RdmamwCollector
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RdmamwCollector())
    chans = []
    for i in range(pairs):
        lst = rdmamw.listen(f"shm://metrics-bench-{i}-{time.monotonic_ns()}")
        got: list = []
        t = th.Thread(target=lambda lst=lst, got=got: got.append(lst.accept(timeout=10)))
        t.start()
        chans.append(rdmamw.Channel.open(lst.address, timeout=10))
        t.join()
        chans.append(got[0])
        lst.close()
    costs = []
    for _ in range(reps):
        c0 = time.process_time()
        generate_latest(reg)
        costs.append(time.process_time() - c0)
    size = len(generate_latest(reg))
    for ch in chans:
        ch.close()
    return {"channels": len(chans), "scrape_cpu_us": 1e6 * statistics.median(costs),
            "scrape_bytes": size}


def _free(port: int) -> bool:
    import socket
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=24, help="measured blocks (even)")
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per block")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--scrape-interval", type=float, default=0.1)
    ap.add_argument("--control", action="store_true",
                    help="A/A: the 'on' blocks serve nothing either (the noise of the pairing)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--rank-of-job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of_job:                # rank 0 sends, rank 1 receives
        from rdmamw import config
        if config.get("RANK") == 0:
            sender(args, args.base)
        else:
            receiver(args.base)
        return 0
    from rdmamw.bootstrap.launch import free_port, spawn
    base = free_port()
    while not _free(base + 1):
        base = free_port()
    common = [sys.executable, str(Path(__file__).resolve()), "--base", str(base),
              "--blocks", str(args.blocks), "--seconds", str(args.seconds),
              "--batch", str(args.batch)] + (["--control"] if args.control else [])
    procs = spawn(2, common + ["--rank-of-job"], stdout=subprocess.PIPE, text=True)
    stop, scrapes = threading.Event(), [0]
    t = threading.Thread(target=scraper, args=([base, base + 1], args.scrape_interval, stop,
                                               scrapes), daemon=True)
    t.start()
    outs = [p.communicate(timeout=60 + 4 * args.blocks * args.seconds)[0] for p in procs]
    stop.set()
    for p in procs:
        if p.returncode != 0:
            raise SystemExit(f"a rank failed ({p.returncode})")
    blocks = json.loads(outs[0].splitlines()[-1])
    on = [b["rate"] for b in blocks if b["on"]]
    off = [b["rate"] for b in blocks if not b["on"]]
    pairs = [(a["rate"] / b["rate"]) if a["on"] else (b["rate"] / a["rate"])
             for a, b in zip(blocks[::2], blocks[1::2], strict=True)]
    res = {"batch": args.batch, "seconds": args.seconds, "blocks": len(blocks),
           "scrape_interval": args.scrape_interval, "scrapes": scrapes[0],
           "control": args.control,
           "rate_on_median": statistics.median(on), "rate_off_median": statistics.median(off),
           "ratio_of_medians": statistics.median(on) / statistics.median(off),
           "paired_ratio_median": statistics.median(pairs),
           "paired_ratio_quartiles": statistics.quantiles(pairs, n=4)[::2]}
    res["scrape_cost"] = [scrape_cost(n) for n in (1, 8, 32)]
    if args.json:
        print(json.dumps(res))
    else:
        print(("A/A control (nothing on): " if args.control else "") +
              f"8 B rate, batches of {args.batch}, {len(blocks)} blocks of {args.seconds} s, "
              f"{scrapes[0]} scrapes answered (every {args.scrape_interval} s when on)")
        print(f"  metrics off  {res['rate_off_median'] / 1e6:8.2f} M msg/s (median)")
        print(f"  metrics on   {res['rate_on_median'] / 1e6:8.2f} M msg/s (median)")
        print(f"  on/off: ratio of medians {res['ratio_of_medians']:.3f}, "
              f"median of paired ratios {res['paired_ratio_median']:.3f} (quartiles "
              f"{res['paired_ratio_quartiles'][0]:.3f}-{res['paired_ratio_quartiles'][1]:.3f})")
        for c in res["scrape_cost"]:
            print(f"  one scrape with {c['channels']:3d} channels open: "
                  f"{c['scrape_cpu_us']:7.0f} us CPU, {c['scrape_bytes']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
