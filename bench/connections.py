"""What one more connection costs: jobs of N ranks open channels all-to-all and report,
per peer, the virtual size, resident memory, file descriptors and threads each channel
adds to a process, and how long the whole mesh took to connect.

    python bench/connections.py                      # N = 8, 32, 64 on the default provider
    python bench/connections.py --ranks 8,16 --provider tcp --json out.json

Every rank calls ``rdmamw.init()``, measures itself (/proc/self/status, /proc/self/fd,
/proc/self/task), opens ``Channel.open(r)`` to every other rank (both sides open, as
the API says), trades one message on each channel (so the rings are really wired),
measures again and prints one JSON line; the table gives the median over ranks of
(after - before) / (N - 1), and the connect time of the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def snapshot() -> dict[str, int]:
    """VmSize and VmRSS (KiB), open fds, threads of this process."""
    status = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmSize", "VmRSS"):
            status[key] = int(value.split()[0])
    return {"vm_kib": status["VmSize"], "rss_kib": status["VmRSS"],
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task"))}


def rank_main() -> None:
    import rdmamw
    w = rdmamw.init(timeout=300)
    before = snapshot()
    t0 = time.monotonic()
    chans = {r: rdmamw.Channel.open(r, timeout=300) for r in range(w.world_size)
             if r != w.rank}
    connect_s = time.monotonic() - t0
    for ch in chans.values():
        ch.send(b"x")
    for ch in chans.values():
        assert bytes(ch.recv(timeout=60)) == b"x"
    after = snapshot()
    some = next(iter(chans.values()))
    print(json.dumps({"rank": w.rank, "before": before, "after": after,
                      "connect_s": connect_s, "provider": some.peer.partition("://")[0],
                      "ring_bytes": some.nslots * some.slot_size,
                      "doorbells": some.stats().get("doorbells")}), flush=True)
    for ch in chans.values():
        ch.close()


def run_job(n: int, provider: str | None) -> list[dict]:
    from rdmamw.bootstrap.launch import spawn
    env = {"RDMAMW_PROVIDER": provider} if provider else {}
    procs = spawn(n, [sys.executable, __file__, "--rank"], env=env,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"a rank failed ({p.returncode}):\n{stderr[-2000:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    return out


def per_peer(rows: list[dict], n: int) -> dict[str, float]:
    def med(key: str) -> float:
        return statistics.median((r["after"][key] - r["before"][key]) / (n - 1) for r in rows)
    return {"vm_mib": med("vm_kib") / 1024, "rss_mib": med("rss_kib") / 1024,
            "fds": med("fds"), "threads": med("threads"),
            "connect_s": max(r["connect_s"] for r in rows),
            "vm_total_mib": statistics.median(r["after"]["vm_kib"] for r in rows) / 1024}


def main() -> None:
    if "--rank" in sys.argv:
        rank_main()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,32,64", help="job sizes (default 8,32,64)")
    ap.add_argument("--provider", default=None,
                    help="force one (RDMAMW_PROVIDER); default: the automatic choice")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    results = []
    print(f"{'ranks':>5} {'provider':>8} {'VmSize/peer':>12} {'RSS/peer':>9} "
          f"{'fds/peer':>8} {'threads/peer':>12} {'VmSize':>9} {'connect':>8}")
    for n in (int(x) for x in a.ranks.split(",")):
        rows = run_job(n, a.provider)
        f = per_peer(rows, n)
        results.append({"ranks": n, "provider": rows[0]["provider"], **f})
        print(f"{n:>5} {rows[0]['provider']:>8} {f['vm_mib']:>9.1f} MiB "
              f"{f['rss_mib']:>5.2f} MiB {f['fds']:>8.1f} {f['threads']:>12.2f} "
              f"{f['vm_total_mib']:>5.0f} MiB {f['connect_s']:>6.2f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
