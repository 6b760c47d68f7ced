"""Stub of rdmamw/providers/shm/_transport.pyx: the shared-memory transport (its data
path is C-level only). Checked by stubtest (`make lint`)."""

from rdmamw.providers.shm._endpoint import ShmEndpoint

class ShmTransport(ShmEndpoint): ...
