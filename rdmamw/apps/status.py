"""``rdmamw status ADDR...``: which ranks of a running job are up, which are silent
(alive, no answer: stopped, busy) or gone, which peers each one is connected to or
has lost, and which it waits on now and for how long, from the health answers of its
metrics endpoints (``/health``: a host's RDMAMW_METRICS_HOST_PORT, or the ranks'
RDMAMW_METRICS_PORT + local rank), all asked at once, answered within ``--timeout``.

    rdmamw status node1:9400 node2:9400         # one host endpoint per host
    rdmamw status --json node1:9400             # the same as JSON

Exit status: 0 every rank of the job is up and none lost; 1 some rank is not (or a
rank of the job was heard from by no endpoint); 2 nothing answers."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

#: seconds between the tries of an endpoint that refuses the connection
RETRY = 0.1


def url_of(target: str) -> str:
    """``host:port``, ``http://host:port`` or a whole URL -> the health URL."""
    url = target if "://" in target else f"http://{target}"
    base = url.rstrip("/").removesuffix("/metrics").removesuffix("/health")
    return base + "/health"


def ask(urls: list[str], timeout: float) -> list[dict[str, Any] | str]:
    """Each endpoint's health answer, or why there is none, all asked at once; none
    waited for past ``timeout``. A refused connection is tried again meanwhile: a
    host's endpoint is refused for up to 0.5 s while another process takes it over."""
    got: list[dict[str, Any] | str] = [f"no answer within {timeout:g} s"] * len(urls)
    end = time.monotonic() + timeout

    def one(i: int, url: str) -> None:
        while True:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    got[i] = json.loads(r.read())
            except OSError as e:
                got[i] = str(getattr(e, "reason", e))
                if isinstance(getattr(e, "reason", e), ConnectionRefusedError) and \
                        time.monotonic() + RETRY * 2 < end:
                    time.sleep(RETRY)
                    continue
            except ValueError as e:
                got[i] = f"not a health answer: {e}"
            return

    threads = [threading.Thread(target=one, args=(i, u), daemon=True)
               for i, u in enumerate(urls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return list(got)


def report(urls: list[str], answers: list[dict[str, Any] | str]) -> dict[str, Any]:
    """The job's status: ``ranks`` (each endpoint's ranks, a host's all of them),
    ``unreachable`` (endpoints that did not answer: url, why), ``missing`` (ranks of
    the job no endpoint spoke for, and which ranks lost them) and ``ok``."""
    ranks: list[dict[str, Any]] = []
    unreachable = []
    for url, a in zip(urls, answers, strict=True):
        if isinstance(a, str):
            unreachable.append({"url": url, "error": a})
        else:
            ranks.extend(a["ranks"] if "ranks" in a else [a])
    sizes = {r["world_size"] for r in ranks if r.get("world_size")}
    heard = {str(r["rank"]) for r in ranks}
    lost_by: dict[str, list[str]] = {}
    for r in ranks:
        for p in r.get("peers", ()):
            if p["lost"]:
                lost_by.setdefault(p["peer"], []).append(str(r["rank"]))
    missing = [{"rank": str(n), "lost_by": lost_by.get(str(n), [])}
               for n in range(max(sizes, default=0)) if str(n) not in heard]
    ok = bool(ranks) and not unreachable and not missing and not lost_by and \
        all(r["state"] == "up" for r in ranks)
    return {"ranks": sorted(ranks, key=lambda r: _order(str(r["rank"]))),
            "unreachable": unreachable, "missing": missing, "ok": ok}


def _order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 62, rank)


def text(st: dict[str, Any]) -> str:
    """The status for a person: a line per rank, then what did not answer."""
    lines = []
    for r in st["ranks"]:
        head = f"rank {r['rank']:>4}  {r['state']:<6}  pid {r['pid']:<7}"
        if r["state"] != "up":
            lines.append(f"{head}  {r['error']}")
            continue
        peers = r["peers"]
        up = [p["peer"] for p in peers if not p["lost"]]
        lost = [p["peer"] for p in peers if p["lost"]]
        waits = [f"{p['peer']} ({', '.join(f'{k} {v:.1f} s' for k, v in p['waiting'].items())})"
                 for w in r["waits_on"] for p in peers if p["peer"] == w]
        lines.append(f"{head}  connected: {','.join(up) or '-'}"
                     + (f"  LOST: {','.join(lost)}" if lost else "")
                     + (f"  waits on: {'; '.join(waits)}" if waits else ""))
    for m in st["missing"]:
        by = f" (lost by rank {', '.join(m['lost_by'])})" if m["lost_by"] else ""
        lines.append(f"rank {m['rank']:>4}  not heard from by any endpoint{by}")
    for u in st["unreachable"]:
        lines.append(f"{u['url']}: not answering: {u['error']}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="rdmamw status", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", metavar="ADDR",
                   help="a metrics endpoint: host:port (a host's or a rank's)")
    p.add_argument("--timeout", type=float, default=0.9,
                   help="seconds to wait for the answers (default 0.9)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    args = p.parse_args(list(argv))
    if not args.timeout > 0:
        p.error("--timeout must be > 0")
    urls = [url_of(t) for t in args.targets]
    st = report(urls, ask(urls, args.timeout))
    if not st["ranks"]:
        why = "; ".join(f"{u['url']}: {u['error']}" for u in st["unreachable"])
        print(f"rdmamw status: nothing answers ({why})", file=sys.stderr)
        return 2
    print(json.dumps(st, indent=1) if args.json else text(st))
    return 0 if st["ok"] else 1
