"""The channel API: listen / accept / open, batched sends, zero-copy receives."""

from rdmamw.channel.channel import Channel, Listener, listen
from rdmamw.engine import Message, SendHandle

__all__ = ["Channel", "Listener", "Message", "SendHandle", "listen"]
