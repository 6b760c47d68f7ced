"""Memory for large messages: the registration cache, the buffer pools and the
rendezvous thresholds (docs/memory.md); their settings (settings.py) are declared
here, before any of its modules reads them."""

from rdmamw.memory import settings  # noqa: F401
