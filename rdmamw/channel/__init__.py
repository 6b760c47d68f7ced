"""The channel API: listen / accept / open, batched sends, zero-copy receives."""

from rdmamw.engine import Message, SendHandle
from rdmamw.channel.channel import Channel, Listener, listen

__all__ = ["Channel", "Listener", "Message", "SendHandle", "listen"]
