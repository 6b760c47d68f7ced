"""Memory for large messages: the registration cache, the buffer pools and the
rendezvous thresholds (docs/memory.md); their settings (settings.py) are declared
here, before any of its modules reads them. ``shared(nbytes)``: memory a peer on the
same host can map (the shm provider's atomics, docs/remote-memory.md)."""

from rdmamw.memory import settings  # noqa: F401
from rdmamw.memory.sharedmem import shared

__all__ = ["shared"]
