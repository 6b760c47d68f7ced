"""Phase bitmaps for arrival and reclamation (Cython) and their pure-Python model."""

from rdmamw.bitmap._phase import RecvBitmaps, SendBitmaps

__all__ = ["RecvBitmaps", "SendBitmaps"]
