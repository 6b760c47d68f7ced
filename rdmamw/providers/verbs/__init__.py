"""The verbs provider: its PROVIDER (provider.py), the transport it makes (_transport)
and its settings (settings.py, declared here before any of its modules reads them)."""

from rdmamw.providers.verbs import settings  # noqa: F401
from rdmamw.providers.verbs.provider import PROVIDER

__all__ = ["PROVIDER"]
