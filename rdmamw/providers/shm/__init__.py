"""The shm provider: its PROVIDER (provider.py) and the transport it makes (_transport)."""

from rdmamw.providers.shm.provider import PROVIDER

__all__ = ["PROVIDER"]
