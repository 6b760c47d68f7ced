# cython: freethreading_compatible = False
"""Batches of many small messages with O(1) Python objects per call (docs/api.md,
"Many small messages"): ``send_many`` sends one buffer cut into messages by a lengths
array, ``recv_many_into`` copies the messages that have arrived into one buffer and
their lengths into an array. They are ordinary messages (the same slots and records,
docs/protocol.md): either side may use recv/recv_batch or send/send_batch instead.

The calls run through the engine's own send and receive (_engine.pyx: locks,
deadlines, waits, counters, the timeline's records); what differs is only how the
batch's messages are taken (SendBatch.acquire_packed) and delivered
(EagerReceiver.copy_many), each in the unit that owns that state."""

from rdmamw.engine._batch cimport Packed
from rdmamw.engine._engine cimport Engine
from rdmamw.engine._messages cimport SendHandle, new_many_dest


def send_many(Engine ch, data, sizes=None, *, size=None, timeout=None) -> SendHandle:
    """Send ``data`` (bytes, bytearray, a numpy array, any C-contiguous buffer) as
    consecutive messages of the lengths in ``sizes`` (an integer numpy array, any
    integer buffer, or a sequence of ints), or all of ``size`` bytes: one batch, one
    handle, exactly as ``send_batch`` of the slices would (messages above the
    rendezvous threshold go by rendezvous; ``Timeout.sent`` counts the messages sent).
    ``data`` must not change until the handle is done."""
    return ch._send(None, timeout, Packed(data, sizes, size))


def recv_many_into(Engine ch, buffer, lengths, timeout=None) -> int:
    """Copy the messages that have arrived into ``buffer`` (writable, C-contiguous),
    back to back, and their lengths into ``lengths`` (a writable uint32, int64 or
    uint64 array); return how many (at least one: waits up to ``timeout`` for the
    first, as recv_into). At most ``len(lengths)`` messages and as many as fit: one
    that does not stays for the next call; a rendezvous message is delivered alone,
    READ straight into ``buffer`` (the call before it stops short of it). A buffer
    that cannot hold even the next message raises BufferTooSmall (``.needed``), and
    the message stays receivable."""
    return ch._recv(0, timeout, new_many_dest(buffer, lengths))
