"""Stub of rdmamw/providers/verbs/_transport.pyx: the verbs transport (its data path is
C-level only). Checked by stubtest (`make lint`)."""

from rdmamw.providers.verbs._qp import VerbsQP

class VerbsTransport(VerbsQP):
    def poll_interval(self) -> float: ...
    def close(self) -> None: ...
