"""Parameter server on the public Channel API: sharded keys, block transfers, SGD
with momentum on the servers, and the consistency models BSP, ASP, SSP(s), LSP(k)
and ALSP (see docs/ps.md)."""

from rdmamw.ps.consistency import Consistency
from rdmamw.ps.job import start, worker_index
from rdmamw.ps.metrics import WorkerMetrics
from rdmamw.ps.server import KVServer
from rdmamw.ps.worker import KVWorker, PSError

__all__ = ["Consistency", "KVServer", "KVWorker", "PSError", "WorkerMetrics", "start",
           "worker_index"]
