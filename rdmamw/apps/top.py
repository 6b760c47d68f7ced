"""``rdmamw top URL...``: a live view of a running job in the terminal, from its
ranks' metrics endpoints (RDMAMW_METRICS_PORT, docs/metrics.md): per rank and peer,
the bytes and messages each way per second and in all, the waits (sends that waited
for the peer's free slots, sleeps in the transport) and the rank's errors, refreshed
each second. An endpoint that does not answer is shown as such, with why.

    rdmamw top node1:9400 node1:9401 ...     # Ctrl-C to quit
    rdmamw top --once node1:9400 node1:9401  # one frame (rates over one interval)

Reads the Prometheus text exposition with prometheus_client's parser and draws with
rich; both are imported only by this command."""

from __future__ import annotations

import argparse
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: the per-peer counters shown, by the sample's name
SENT_B, RECV_B = "rdmamw_sent_bytes_total", "rdmamw_received_bytes_total"
SENT_M, RECV_M = "rdmamw_messages_sent_total", "rdmamw_messages_received_total"
CREDIT, SLEEPS = "rdmamw_credit_waits_total", "rdmamw_sleeps_total"
PER_PEER = (SENT_B, RECV_B, SENT_M, RECV_M, CREDIT, SLEEPS)
ERRORS = "rdmamw_errors_total"
COLUMNS = ("rank", "peer", "provider", "sent/s", "recv/s", "msg sent/s", "msg recv/s",
           "bytes sent", "bytes recv", "msgs sent", "msgs recv", "credit waits", "sleeps",
           "errors")


def url_of(target: str) -> str:
    """``host:port``, ``http://host:port`` or a whole URL -> the metrics URL."""
    url = target if "://" in target else f"http://{target}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


@dataclass
class Scrape:
    """One endpoint read once: ``peers[(provider, peer)][counter]``, the rank's errors
    by kind, or ``error`` (why it did not answer)."""

    url: str
    at: float
    rank: str = "?"
    peers: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def scrape(url: str, timeout: float = 2.0) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families
    at = time.monotonic()
    try:
        text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    except OSError as e:
        return Scrape(url, at, error=str(getattr(e, "reason", e)))
    out = Scrape(url, at)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "rank" in s.labels:
                out.rank = s.labels["rank"]
            if s.name in PER_PEER:
                row = out.peers.setdefault((s.labels["provider"], s.labels["peer"]), {})
                row[s.name] = s.value
            elif s.name == ERRORS:
                out.errors[s.labels["kind"]] = s.value
    return out


def _rate(now: Scrape, before: Scrape | None, key: tuple[str, str], name: str) -> float | None:
    if before is None or before.error is not None or key not in before.peers:
        return None
    dt = now.at - before.at
    return max(0.0, now.peers[key][name] - before.peers[key][name]) / dt if dt > 0 else None


def _si(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.2f} {prefix}{unit}"
    return f"{v:.0f} {unit}"


def frame(now: list[Scrape], before: list[Scrape | None], frames: int) -> Any:
    """The table of one refresh: a row per rank and peer (rates against ``before``)."""
    from rich.table import Table
    down = [f"{s.url}: {s.error}" for s in now if s.error is not None]
    t = Table(title=f"rdmamw top: {len(now)} endpoints, frame {frames}, "
                    f"{time.strftime('%H:%M:%S')}", title_justify="left",
              caption="\n".join(f"[red]not answering: {d}[/red]" for d in down) or None,
              caption_justify="left")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("rank", "peer", "provider") else "right",
                     no_wrap=True)
    for s, b in sorted(zip(now, before, strict=True), key=lambda p: _rank_order(p[0])):
        if s.error is not None:
            continue
        errs = ", ".join(f"{k} {v:.0f}" for k, v in sorted(s.errors.items()) if v) or "0"
        for key in sorted(s.peers, key=lambda k: (_num(k[1]), k[0])):
            row = s.peers[key]
            t.add_row(s.rank, key[1], key[0],
                      _si(_rate(s, b, key, SENT_B), "B"), _si(_rate(s, b, key, RECV_B), "B"),
                      _si(_rate(s, b, key, SENT_M), ""), _si(_rate(s, b, key, RECV_M), ""),
                      *(f"{row.get(n, 0):.0f}" for n in PER_PEER), errs)
        if not s.peers:
            t.add_row(s.rank, "-", "-", "no channels yet", *[""] * 9, errs)
    return t


def _num(v: str) -> tuple[int, str]:
    return (int(v), "") if v.isdigit() else (1 << 62, v)


def _rank_order(s: Scrape) -> tuple[int, str]:
    return _num(s.rank)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="rdmamw top", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", metavar="URL",
                   help="a rank's metrics endpoint: host:port or http://host:port/metrics")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes "
                   "(default 1)")
    p.add_argument("--once", action="store_true",
                   help="print one frame (two reads, --interval apart) and exit")
    args = p.parse_args(list(argv))
    if not args.interval > 0:
        p.error("--interval must be > 0")
    from rich.console import Console
    urls = [url_of(t) for t in args.targets]
    console = Console()
    before: list[Scrape | None] = [None] * len(urls)
    if args.once:
        before = [scrape(u) for u in urls]
        time.sleep(args.interval)
        if not console.is_terminal:
            console = Console(width=max(console.width, 240))
        console.print(frame([scrape(u) for u in urls], before, 1))
        return 0
    from rich.live import Live
    frames = 0
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                start = time.monotonic()
                now = [scrape(u) for u in urls]
                frames += 1
                live.update(frame(now, before, frames), refresh=True)
                before = list(now)
                time.sleep(max(0.0, args.interval - (time.monotonic() - start)))
    except KeyboardInterrupt:
        return 0
