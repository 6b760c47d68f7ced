"""The tcp provider: its PROVIDER (provider.py), the transport it makes (_transport)
and its settings (settings.py, declared here before any of its modules reads them)."""

from rdmamw.providers.tcp import settings  # noqa: F401
from rdmamw.providers.tcp.provider import PROVIDER

__all__ = ["PROVIDER"]
