"""The verbs provider: its PROVIDER (provider.py) and the transport it makes (_transport)."""

from rdmamw.providers.verbs.provider import PROVIDER

__all__ = ["PROVIDER"]
