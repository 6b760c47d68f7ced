"""``rdmamw top URL...``: a live view of a running job in the terminal, from its
metrics endpoints (docs/metrics.md): a rank's (RDMAMW_METRICS_PORT) or a host's
(RDMAMW_METRICS_HOST_PORT: every rank of the host behind one port, each its own rows).
Per rank and peer, the bytes and messages each way per second and in all, the waits
(sends that waited for the peer's free slots, sleeps in the transport), the rank's
errors and, from the endpoint's ``/health``, what it waits on that peer for now,
refreshed each second. A rank its host's endpoint reports silent or gone is shown
``down`` with why; an endpoint that does not answer is named, with why.

    rdmamw top node1:9400 node1:9401 ...     # Ctrl-C to quit
    rdmamw top --once node1:9400 node2:9400  # one frame (rates over one interval)

Reads the Prometheus text exposition with prometheus_client's parser and draws with
rich; both are imported only by this command."""

from __future__ import annotations

import argparse
import json
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
RATES = ((SENT_B, "B"), (RECV_B, "B"), (SENT_M, ""), (RECV_M, ""))
ERRORS = "rdmamw_errors_total"
#: a host's endpoint: 1 the rank answered it, 0 it did not (rdmamw/metrics/gather.py)
UP = "rdmamw_host_rank_up"
COLUMNS = ("rank", "peer", "provider", "sent/s", "recv/s", "msg sent/s", "msg recv/s",
           "bytes sent", "bytes recv", "msgs sent", "msgs recv", "credit waits", "sleeps",
           "errors", "waiting on peer")
LEFT = ("rank", "peer", "provider", "waiting on peer")


def url_of(target: str, path: str = "/metrics") -> str:
    """``host:port``, ``http://host:port`` or a whole URL -> the endpoint's URL at
    ``path`` (``/metrics``, ``/health``)."""
    url = target if "://" in target else f"http://{target}"
    base = url.rstrip("/").removesuffix("/metrics")
    return base + path


@dataclass
class Rank:
    """One rank as an endpoint shows it: ``peers[(provider, peer)][counter]``, its
    errors by kind, whether it answered (a host's endpoint says ``up`` 0 for a rank
    that did not: ``why`` then says what is known) and, from its health answer, what
    it waits on by peer."""

    peers: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    up: bool = True
    why: str = ""
    waiting: dict[str, str] = field(default_factory=dict)


@dataclass
class Scrape:
    """One endpoint read once: its ranks by name (one for a rank's endpoint, every
    rank of the host for a host's), or ``error`` (why it did not answer)."""

    url: str
    at: float
    ranks: dict[str, Rank] = field(default_factory=dict)
    error: str | None = None


def scrape(target: str, timeout: float = 2.0) -> Scrape:
    """``target``'s metrics and, asked at the same time, its health answer (for the
    waits; an endpoint without one shows none)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        health = pool.submit(_get, url_of(target, "/health"), timeout)
        out = _metrics(url_of(target), timeout)
        answer = health.result()
    if out.error is None and not isinstance(answer, str):
        _add_health(out, answer)
    return out


def scrape_all(targets: list[str]) -> list[Scrape]:
    """Every target read at once (a host's endpoint with a stopped rank takes its
    per-rank bound to answer: one after the other, the bounds would add up)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(len(targets), 16)) as pool:
        return list(pool.map(scrape, targets))


def _get(url: str, timeout: float) -> bytes | str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bytes(r.read())
    except OSError as e:
        return str(getattr(e, "reason", e))


def _metrics(url: str, timeout: float) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families
    at = time.monotonic()
    text = _get(url, timeout)
    if isinstance(text, str):
        return Scrape(url, at, error=text)
    out = Scrape(url, at)
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if "rank" not in s.labels:
                continue
            r = out.ranks.setdefault(s.labels["rank"], Rank())
            if s.name == UP:
                r.up = bool(s.value)
                r.why = r.why or ("" if r.up else "did not answer its host's endpoint")
            elif s.name in PER_PEER:
                r.peers.setdefault((s.labels["provider"], s.labels["peer"]), {})[
                    s.name] = s.value
            elif s.name == ERRORS:
                r.errors[s.labels["kind"]] = s.value
    return out


def _add_health(out: Scrape, answer: bytes) -> None:
    """Each rank's waits by peer; a rank the health answer knows and the metrics
    do not show up (silent, or gone: found dead) is shown down with why."""
    try:
        got = json.loads(answer)
        ranks = got["ranks"] if "ranks" in got else [got]
    except (ValueError, TypeError, KeyError):
        return
    for h in ranks:
        name = str(h.get("rank", "?"))
        if h.get("state", "up") != "up":
            if name in out.ranks and out.ranks[name].up:
                continue    # (answered the metrics: a gone one is an earlier process)
            r = out.ranks.setdefault(name, Rank(up=False))
            r.up, r.why = False, f"{h.get('state')}: {h.get('error', '')}"
            continue
        seen = out.ranks.get(name)
        if seen is None:
            continue
        for p in h.get("peers", []):
            waits = sorted(p.get("waiting", {}).items(), key=lambda kv: -kv[1])
            if waits:
                seen.waiting[str(p["peer"])] = ", ".join(f"{k} {s:.1f} s" for k, s in waits)


def _rate(now: Scrape, before: Scrape | None, rank: str, key: tuple[str, str],
          name: str) -> float | None:
    if before is None or before.error is not None:
        return None
    was = before.ranks.get(rank)
    if was is None or not was.up or key not in was.peers:
        return None
    dt = now.at - before.at
    return (max(0.0, now.ranks[rank].peers[key].get(name, 0) - was.peers[key].get(name, 0))
            / dt if dt > 0 else None)


def _si(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.2f} {prefix}{unit}"
    return f"{v:.0f} {unit}"


def frame(now: list[Scrape], before: list[Scrape | None], frames: int) -> Any:
    """The table of one refresh: a row per rank and peer (rates against ``before``),
    a row per rank that did not answer (``down``, and why)."""
    from rich.table import Table
    down = [f"{s.url}: {s.error}" for s in now if s.error is not None]
    t = Table(title=f"rdmamw top: {len(now)} endpoints, frame {frames}, "
                    f"{time.strftime('%H:%M:%S')}", title_justify="left",
              caption="\n".join(f"[red]not answering: {d}[/red]" for d in down) or None,
              caption_justify="left")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in LEFT else "right", no_wrap=True)
    shown = [(name, r, s, b) for s, b in zip(now, before, strict=True)
             for name, r in s.ranks.items()]
    for name, r, s, b in sorted(shown, key=lambda x: _num(x[0])):
        if not r.up:
            t.add_row(name, "-", "-", "[red]down[/red]", *[""] * 10, r.why)
            continue
        errs = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.errors.items()) if v) or "0"
        for key in sorted(r.peers, key=lambda k: (_num(k[1]), k[0])):
            row = r.peers[key]
            t.add_row(name, key[1], key[0],
                      *(_si(_rate(s, b, name, key, n), u) for n, u in RATES),
                      *(f"{row.get(n, 0):.0f}" for n in PER_PEER), errs,
                      r.waiting.get(key[1], "-"))
        if not r.peers:
            t.add_row(name, "-", "-", "no channels yet", *[""] * 9, errs, "")
    return t


def _num(v: str) -> tuple[int, str]:
    return (int(v), "") if v.isdigit() else (1 << 62, v)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="rdmamw top", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", metavar="URL",
                   help="a rank's or a host's metrics endpoint: host:port or "
                   "http://host:port/metrics")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes "
                   "(default 1)")
    p.add_argument("--once", action="store_true",
                   help="print one frame (two reads, --interval apart) and exit")
    args = p.parse_args(list(argv))
    if not args.interval > 0:
        p.error("--interval must be > 0")
    from rich.console import Console
    urls = list(args.targets)
    console = Console()
    before: list[Scrape | None] = [None] * len(urls)
    if args.once:
        before = list(scrape_all(urls))
        time.sleep(args.interval)
        if not console.is_terminal:
            console = Console(width=max(console.width, 240))
        console.print(frame(scrape_all(urls), before, 1))
        return 0
    from rich.live import Live
    frames = 0
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                start = time.monotonic()
                now = scrape_all(urls)
                frames += 1
                live.update(frame(now, before, frames), refresh=True)
                before = list(now)
                time.sleep(max(0.0, args.interval - (time.monotonic() - start)))
    except KeyboardInterrupt:
        return 0
