"""The Prometheus side: a collector that turns a reading (rdmamw/metrics/readings.py)
into metric families at each scrape, and the HTTP endpoint serving it. The only module
that imports prometheus_client (the ``metrics`` extra: ``pip install rdmamw[metrics]``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

from rdmamw.metrics import readings
from rdmamw.metrics.health import health
from rdmamw.metrics.http import Answer, Route, Server, json_route
from rdmamw.metrics.readings import (
    CHANNEL_COUNTERS,
    MEMORY_COUNTERS,
    PS_COUNTERS,
    RENDEZVOUS,
    RNDV_READ,
    RNDV_WRITE,
)

log = logging.getLogger("rdmamw.metrics")
PEER = ["rank", "provider", "peer"]


class RdmamwCollector:
    """rdmamw's metrics, read at each scrape (register it in a registry of your own to
    serve them with your metrics: ``registry.register(RdmamwCollector())``)."""

    def collect(self) -> Iterator[Any]:
        r = readings.read()
        rows = sorted(r.channels.items())
        for name, unit, doc, _ in CHANNEL_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=PEER, unit=unit)
            for (provider, peer), row in rows:
                c.add_metric([r.rank, provider, peer], row[name + "_total"])
            yield c
        c = CounterMetricFamily(RENDEZVOUS, "large messages sent by rendezvous, by strategy",
                                labels=[*PEER, "strategy"])
        for (provider, peer), row in rows:
            c.add_metric([r.rank, provider, peer, "read"], row[RNDV_READ])
            c.add_metric([r.rank, provider, peer, "write"], row[RNDV_WRITE])
        yield c
        g = GaugeMetricFamily("rdmamw_channels_open", "channels open to the peer",
                              labels=PEER)
        for (provider, peer), row in rows:
            g.add_metric([r.rank, provider, peer], row["rdmamw_channels_open"])
        yield g
        for name, unit, doc, _ in MEMORY_COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["rank"], unit=unit)
            c.add_metric([r.rank], r.memory[name + "_total"])
            yield c
        g = GaugeMetricFamily("rdmamw_pinned_bytes", "bytes registered (pinned) now by "
                              "the registration caches and the pool", labels=["rank"],
                              unit="bytes")
        g.add_metric([r.rank], r.memory["rdmamw_pinned_bytes"])
        yield g
        e = CounterMetricFamily("rdmamw_errors", "failures met, by kind",
                                labels=["rank", "kind"])
        for kind, n in r.errors.items():
            e.add_metric([r.rank, kind], n)
        yield e
        h = HistogramMetricFamily("rdmamw_collective_seconds", "time of each collective "
                                  "call", labels=["rank", "collective"], unit="seconds")
        for kind, t in sorted(r.collectives.items()):
            h.add_metric([r.rank, kind], [(_le(le), n) for le, n in t.cumulative()], t.sum)
        yield h
        if r.ps:
            for name, doc, _ in PS_COUNTERS:
                c = CounterMetricFamily(name, doc, labels=["rank"])
                c.add_metric([r.rank], r.ps[name + "_total"])
                yield c
            g = GaugeMetricFamily("rdmamw_ps_staleness_max", "the largest staleness of a "
                                  "gradient applied so far", labels=["rank"])
            g.add_metric([r.rank], r.ps["rdmamw_ps_staleness_max"])
            yield g
        h = HistogramMetricFamily("rdmamw_batch_completion_seconds", "time from a "
                                  "batch's post to its completion, as the program learned "
                                  "it (its handle's first done() that says so, or its "
                                  "wait()); recorded while metrics are on",
                                  labels=["rank"], unit="seconds")
        if r.batches is not None:
            h.add_metric([r.rank], [(_le(le), n) for le, n in r.batches.cumulative()],
                         r.batches.sum)
        yield h
        h = HistogramMetricFamily("rdmamw_connect_seconds", "time of each channel connect "
                                  "(its count: the connects), by outcome",
                                  labels=["rank", "provider", "outcome"], unit="seconds")
        for (provider, outcome), t in sorted(r.connects.items()):
            h.add_metric([r.rank, provider, outcome],
                         [(_le(le), n) for le, n in t.cumulative()], t.sum)
        yield h


class Dropped:
    """The connections an endpoint closed to keep to RDMAMW_METRICS_MAX_CONNECTIONS
    (rdmamw/metrics/http.py)."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        c = CounterMetricFamily("rdmamw_metrics_connections_dropped", "connections this "
                                "endpoint closed to keep to RDMAMW_METRICS_MAX_CONNECTIONS "
                                "(silent ones, or newcomers)", labels=["rank"])
        c.add_metric([readings.rank()], self.server.dropped)
        yield c


def _le(bound: float) -> str:
    """A bucket's bound as Prometheus writes it (``5e-07``, ``0.1``, ``10.0``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(bound)


def exposition(registry: Any) -> Route:
    """The metrics route: ``registry`` collected at each request, in the format its
    Accept header asks for (OpenMetrics for a Prometheus server, else text 0.0.4)."""
    def answer(accept: str) -> Answer:
        encode, ctype = choose_encoder(accept)
        return 200, ctype, encode(registry)
    return answer


class Endpoint:
    """An HTTP endpoint serving :class:`RdmamwCollector` (its own registry: a scrape
    shows rdmamw's metrics only) and, at ``/health``, the rank's health answer
    (rdmamw/metrics/health.py), on a thread of its own."""

    def __init__(self, port: int, addr: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RdmamwCollector())
        self.server = Server(addr, port, {"/health": json_route(health)},
                             exposition(self.registry)).start()
        self.registry.register(Dropped(self.server))
        self.port: int = self.server.port
        self.addr = addr

    def close(self) -> None:
        self.server.close()
