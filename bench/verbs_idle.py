"""What idle verbs channels cost in CPU: one process opens N channel pairs (both ends
here, 2N queue pairs on the process's one device), then N threads each block in
``recv`` on one end, as a server waiting for requests does, and the process's CPU
time over a quiet window is measured, once with the sleeper re-checking every
``RDMAMW_VERBS_POLL_MS`` (event=0) and once woken only by completion events (event=1),
in the same run. At the end one message per channel checks that every sleeper still
wakes. Run inside the soft-RoCE VM (scripts/rxe-vm.sh):

    python bench/verbs_idle.py --channels 100,500 --seconds 10 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(n: int, event: int, seconds: float) -> dict:
    import rdmamw

    host = os.environ.get("RXEVM_IP", "127.0.0.1")
    lst = rdmamw.listen(f"verbs://{host}:0?event={event}", slots=8, slot_size=1024)
    where = f"{lst.address}?event={event}"
    pairs = []
    t0 = time.monotonic()
    accepted: list = []
    acceptor = threading.Thread(
        target=lambda: accepted.extend(lst.accept(timeout=120) for _ in range(n)))
    acceptor.start()
    opened = [rdmamw.Channel.open(where, timeout=120, slots=8, slot_size=1024)
              for _ in range(n)]
    acceptor.join(300)
    pairs = list(zip(opened, accepted, strict=True))
    connect_s = time.monotonic() - t0
    woke: list[bytes] = []

    def sleeper(ch) -> None:
        woke.append(bytes(ch.recv(timeout=seconds + 120)))

    threads = [threading.Thread(target=sleeper, args=(b,), daemon=True) for _, b in pairs]
    for t in threads:
        t.start()
    time.sleep(1.0)                         # all spun and asleep
    c0, w0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    cpu, wall = time.process_time() - c0, time.monotonic() - w0
    for a, _ in pairs:
        a.send(b"wake")
    for t in threads:
        t.join(60)
    ok = len(woke) == n and set(woke) == {b"wake"}
    for a, b in pairs:
        a.close(), b.close()
    lst.close()
    return {"channels": n, "event": event, "cpu_s": cpu, "wall_s": wall,
            "core_fraction": cpu / wall, "all_woke": ok, "connect_s": connect_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", default="100", help="channel pairs, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--events", default="0,1", help="event modes to run (same run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.channels.split(",")):
        for ev in (int(x) for x in args.events.split(",")):
            row = measure(n, ev, args.seconds)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| channels | event | CPU over the window | share of a core | all woke |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['channels']} | {r['event']} | {r['cpu_s']:.2f} s / {r['wall_s']:.1f} s "
              f"| {100 * r['core_fraction']:.2f} % | {r['all_woke']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
