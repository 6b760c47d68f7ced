"""What a job is doing, as Prometheus metrics (docs/metrics.md): per process, labelled
by provider and peer rank, read from the channels' own counters at each scrape, the
errors by kind and the collectives' times. Off by default: ``RDMAMW_METRICS_PORT``
serves them over HTTP (port + local rank) from ``rdmamw.init()`` or the first channel
on, ``RDMAMW_METRICS_HOST_PORT`` every rank of the host at one port
(rdmamw/metrics/host.py); :func:`serve` and :func:`serve_host` do it from code;
:func:`snapshot` returns them as plain data.

The HTTP endpoint needs prometheus_client (``pip install rdmamw[metrics]``), imported
only when one is served; :func:`snapshot` does without it."""

from __future__ import annotations

import logging
import threading
from typing import Any

from rdmamw import _fork, config
from rdmamw.errors import ConfigError
from rdmamw.metrics import settings as settings
from rdmamw.metrics.readings import disable, enable, snapshot

log = logging.getLogger("rdmamw.metrics")
#: the launchers' variables for this process's rank on its host, the first set wins
LOCAL_RANK = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")

_endpoint: Any = None
_host: Any = None           # rdmamw.metrics.host.Host: this process's part in the host's
_lock = threading.Lock()


def local_rank() -> int:
    """This process's rank on its host, from its launcher's variables (0 without any)."""
    for name in LOCAL_RANK:
        value = config.get(name)
        if value is not None:
            return int(value)
    return 0


def serve(port: int | None = None, addr: str | None = None) -> int:
    """Serve the metrics over HTTP at ``addr:port`` (default RDMAMW_METRICS_ADDR and
    RDMAMW_METRICS_PORT + the local rank; 0: a free port) and record the collectives'
    times; returns the port. Once per process: later calls return the first port."""
    global _endpoint
    with _lock:
        if _endpoint is None:
            if port is None:
                base = config.get("RDMAMW_METRICS_PORT")
                if base is None:
                    raise ValueError("no port: pass one or set RDMAMW_METRICS_PORT")
                port = base + local_rank()
                if port > 65535:
                    raise ConfigError(f"RDMAMW_METRICS_PORT={base} + local rank "
                                      f"{port - base} = {port} is above the last port, "
                                      f"65535: set a lower one")
            from rdmamw.metrics.exporter import Endpoint
            _endpoint = Endpoint(port, config.get("RDMAMW_METRICS_ADDR") if addr is None
                                 else addr)
            enable()
            log.info("metrics served at http://%s:%d/metrics", _endpoint.addr, _endpoint.port)
        return int(_endpoint.port)


def serve_host(port: int | None = None) -> None:
    """Take part in the host's endpoint at RDMAMW_METRICS_ADDR:``port`` (default
    RDMAMW_METRICS_HOST_PORT): every process of the host that does serves its metrics
    there, through whichever of them holds the port. This process's own endpoint (its
    :func:`serve`, else one on a free loopback port) is what the host's asks. Once
    per process."""
    global _host
    if port is None:
        port = config.get("RDMAMW_METRICS_HOST_PORT")
        if port is None:
            raise ValueError("no port: pass one or set RDMAMW_METRICS_HOST_PORT")
    with _lock:
        if _host is not None:
            return
    own = serve(0, "127.0.0.1") if _endpoint is None else _endpoint.port
    from rdmamw.metrics.host import Host
    from rdmamw.metrics.readings import rank
    addr = _endpoint.addr
    loopback = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(addr, addr)
    with _lock:
        if _host is None:
            _host = Host(port, config.get("RDMAMW_METRICS_ADDR"),
                         f"http://{loopback}:{own}", rank())


def stop() -> None:
    """Stop serving (and recording the collectives' times), and leave the host's
    endpoint."""
    global _endpoint, _host
    with _lock:
        if _host is not None:
            _host.close()
            _host = None
        if _endpoint is not None:
            _endpoint.close()
            _endpoint = None
        disable()


def from_environment() -> None:
    """:func:`serve` if RDMAMW_METRICS_PORT is set, :func:`serve_host` if
    RDMAMW_METRICS_HOST_PORT is (rdmamw/observe.py runs this when the process joins a
    job or opens its first channel). A port in use is logged (warning), not raised:
    the job runs without its metrics."""
    if config.get("RDMAMW_METRICS_PORT") is not None:
        try:
            serve()
        except OSError as e:
            log.warning("metrics: cannot serve on port %s + local rank %d: %s",
                        config.raw("RDMAMW_METRICS_PORT"), local_rank(), e)
    if config.get("RDMAMW_METRICS_HOST_PORT") is not None:
        try:
            serve_host()
        except OSError as e:
            log.warning("metrics: cannot take part in the host's endpoint: %s", e)


@_fork.at_child
def _forget() -> None:
    """A fork child has no part in the host's endpoint: the thread and file are its
    parent's."""
    global _host, _lock
    if _host is not None:
        _host.forget()
    _host, _lock = None, threading.Lock()


__all__ = ["disable", "enable", "from_environment", "local_rank", "serve", "serve_host",
           "snapshot", "stop"]
