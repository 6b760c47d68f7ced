"""rdmamw: batched-completion RDMA messaging for distributed machine learning.

>>> import rdmamw
>>> lst = rdmamw.listen("shm://job1")              # process A
>>> ch = rdmamw.Channel.open("shm://job1")          # process B
>>> ch.send_batch([b"a", b"b"]).wait()
>>> [bytes(m) for m in lst_side.recv_batch()]       # doctest: +SKIP
"""

from rdmamw import errors, log, observe
from rdmamw.bootstrap import World, finalize, init, world
from rdmamw.channel import Channel, Listener, Message, SendHandle, listen
from rdmamw.errors import (
    BufferTooSmall,
    ChannelClosed,
    MessageLost,
    MessageTooLarge,
    PeerLost,
    PeerNotFound,
    PeerRefused,
    ProtocolError,
    ProviderUnavailable,
    RdmamwError,
    Timeout,
)

__version__ = "0.1.0"

log.configure()     # RDMAMW_LOG_LEVEL / RDMAMW_LOG_FILE (rdmamw/log.py)


def _metrics_from_environment() -> None:
    """RDMAMW_METRICS_PORT's endpoint, once the process joins a job or opens a channel
    (rdmamw/observe.py); prometheus_client is imported only when it is set."""
    from rdmamw.metrics import from_environment
    from_environment()


def _trace_from_environment() -> None:
    """RDMAMW_TRACE's timeline, from the same moment (rdmamw/trace: its recorder is
    imported only when it is set)."""
    from rdmamw.trace import from_environment
    from_environment()


observe.at_begin(_metrics_from_environment)
observe.at_begin(_trace_from_environment)

__all__ = [
    "BufferTooSmall",
    "Channel",
    "ChannelClosed",
    "Listener",
    "Message",
    "MessageLost",
    "MessageTooLarge",
    "PeerLost",
    "PeerNotFound",
    "PeerRefused",
    "ProtocolError",
    "ProviderUnavailable",
    "RdmamwError",
    "SendHandle",
    "Timeout",
    "World",
    "errors",
    "finalize",
    "init",
    "listen",
    "world",
]
