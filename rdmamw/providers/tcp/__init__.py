"""The tcp provider: its PROVIDER (provider.py) and the transport it makes (_transport)."""

from rdmamw.providers.tcp.provider import PROVIDER

__all__ = ["PROVIDER"]
