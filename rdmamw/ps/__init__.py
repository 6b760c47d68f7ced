"""Parameter server on the public Channel API: sharded keys, block transfers, SGD
with momentum on the servers, and the consistency models BSP, ASP, SSP(s), LSP(k),
ALSP and hybrid, with optional delay compensation (see docs/ps.md). The training
demo built on it (``rdmamw demo``) is in rdmamw.apps.demo. Its settings (settings.py)
are declared first, before any module of the package reads them."""

from rdmamw.ps import settings  # noqa: F401
from rdmamw.ps.consistency import Consistency
from rdmamw.ps.job import connect, start, worker_index
from rdmamw.ps.metrics import WorkerMetrics
from rdmamw.ps.server import KVServer
from rdmamw.ps.worker import KVWorker, PSError

__all__ = ["Consistency", "KVServer", "KVWorker", "PSError", "WorkerMetrics", "connect",
           "start", "worker_index"]
