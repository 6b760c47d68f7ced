"""What the host's endpoint answers: each process of the host asked at once over its
own loopback endpoint, each within :data:`RANK_TIMEOUT` (a process that does not
answer in time, stopped or busy, is left out of this answer and holds no other),
the answers merged into one exposition: every rank's series under its own ``rank``
label, plus ``rdmamw_host_rank_up{rank}`` (1: answered now; 0: alive but silent).
A process found dead is in neither: its series end with it."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from rdmamw.metrics.members import Member, stopped

#: seconds the host's endpoint waits for each process's answer
RANK_TIMEOUT = 0.5
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def ask(live: list[Member], path: str, timeout: float = RANK_TIMEOUT,
        accept: str = OPENMETRICS) -> list[bytes | str]:
    """Each process's answer at ``path`` (its body), or why there is none; all asked
    at once, none waited for longer than ``timeout``: at the end, an answer still
    coming (a process that accepted and says nothing, or trickles) is cut off, so
    its thread ends too and no scrape leaves one behind. A process seen stopped now
    is not asked: it cannot answer, and waiting ``timeout`` for it would take most of
    a client's second."""
    got: list[bytes | str] = [f"no answer within {timeout:g} s"] * len(live)
    socks: list[socket.socket | None] = [None] * len(live)
    lock, cut = threading.Lock(), [False]

    def one(i: int, m: Member) -> None:
        url = urllib.parse.urlsplit(m.url)
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=timeout)
        try:
            conn.connect()
            with lock:
                socks[i] = conn.sock    # (the answer's reading keeps it after conn.close)
                if cut[0]:
                    _cut(conn.sock)
            conn.request("GET", url.path + path, headers={"Accept": accept})
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise OSError(f"HTTP {r.status} {r.reason}")
            with lock:
                got[i] = body
        except (OSError, http.client.HTTPException) as e:
            if not isinstance(e, TimeoutError):     # (a timeout: the default says it)
                with lock:
                    got[i] = str(e) or type(e).__name__
        finally:
            conn.close()

    threads: dict[int, threading.Thread] = {}
    for i, m in enumerate(live):
        if stopped(m.pid):
            got[i] = "not asked"
        else:
            threads[i] = threading.Thread(target=one, args=(i, m), daemon=True,
                                          name="rdmamw-metrics-ask")
    for t in threads.values():
        t.start()
    end = time.monotonic() + timeout
    for t in threads.values():
        t.join(max(0.0, end - time.monotonic()))
    with lock:
        answers, cut[0] = list(got), True
        for i, t in threads.items():
            sock = socks[i]
            if t.is_alive() and sock is not None:
                _cut(sock)
    return answers


def _cut(sock: socket.socket) -> None:
    """End the reads of ``sock`` now (its thread's, whatever it waits for)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Merged:
    """The host's exposition as a collector: the processes' families, merged by name
    (a series twice, as from two processes outside a job, is given once)."""

    def __init__(self, live: list[Member], answers: list[bytes | str],
                 dropped: int = 0) -> None:
        self.families: dict[str, Metric] = {}
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        up = GaugeMetricFamily("rdmamw_host_rank_up", "1: the rank's process answered "
                               "this scrape; 0: it is alive but did not answer in time",
                               labels=["rank"])
        for m, a in zip(live, answers, strict=True):
            up.add_metric([m.name], 0 if isinstance(a, str) else 1)
            if isinstance(a, str):
                continue
            for fam in text_string_to_metric_families(a.decode()):
                into = self.families.get(fam.name)
                if into is None:
                    into = self.families[fam.name] = Metric(fam.name, fam.documentation,
                                                            fam.type, fam.unit)
                for s in fam.samples:
                    labels = {**s.labels, "rank": s.labels.get("rank") or m.name} \
                        if "rank" in s.labels else s.labels
                    key = (s.name, tuple(sorted(labels.items())))
                    if key not in seen:
                        seen.add(key)
                        into.samples.append(Sample(s.name, labels, s.value))
        self.families[up.name] = up
        served = GaugeMetricFamily("rdmamw_host_endpoint_pid", "the process that "
                                   "answered this scrape (any process of the host may)")
        served.add_metric([], os.getpid())
        self.families[served.name] = served
        own = CounterMetricFamily("rdmamw_host_connections_dropped", "connections the "
                                  "host's endpoint closed, while this process serves it, "
                                  "to keep to RDMAMW_METRICS_MAX_CONNECTIONS")
        own.add_metric([], dropped)
        self.families[own.name] = own

    def collect(self) -> Iterator[Any]:
        return iter(self.families.values())


def health(known: list[Member], answers: list[bytes | str]) -> dict[str, Any]:
    """The host's health answer: each process's own (rdmamw/metrics/health.py), or
    what is known of one that gave none: ``gone`` (found dead), ``silent`` (alive, no
    answer in time: stopped, or busy)."""
    ranks = []
    for m, a in zip(known, answers, strict=True):
        if m.gone is not None:
            ranks.append({"rank": m.name, "pid": m.pid, "state": "gone",
                          "error": f"process {m.pid} exited (found "
                                   f"{time.time() - m.gone:.0f} s ago)"})
        elif isinstance(a, str):
            why = "stopped (SIGSTOP or a debugger)" if stopped(m.pid) else "alive"
            ranks.append({"rank": m.name, "pid": m.pid, "state": "silent",
                          "error": f"{why}, {a}"})
        else:
            ranks.append(json.loads(a))
    return {"host": os.uname().nodename, "served_by": os.getpid(), "ranks": ranks}
