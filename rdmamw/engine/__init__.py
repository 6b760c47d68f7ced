"""The batch engine, split by who owns the state (docs/architecture.md, "The engine").

Each unit is a small Cython class holding its own fields, and the only one writing
them (tests/unit/test_engine_owners.py); :class:`Engine` (``_engine.pyx``) only
orchestrates them: locks, ``send_batch`` / ``recv_batch`` and ``close``.

``_frames.pxd``    slot header, record and descriptor formats, control-word indices
``_counters.pxd``  the one struct of counters behind ``stats()``
``_trace.pxd``     the timeline's records (rdmamw/include/rm_trace.h): one process-wide
                   array the units append to while rdmamw.trace records
``_link.pyx``      the connection: the only holder of the transport, control words,
                   post lock, completions, peer liveness, the errors that end a
                   channel, the counters
``_batch.pyx``     the messages of one send call and their plan into slots
``_eager_send.pyx`` the peer's ring: staging, sequence numbers, arrival bitmap, WR chains
``_rndv_send.pyx`` rendezvous entries: exposed sources until their done bit returns
``_eager_recv.pyx`` my ring: arrivals in sequence order, slot references, write-back
``_rndv_recv.pyx`` rendezvous descriptors taken: READs, posted and advertised buffers
``_waits.pyx``     the one wait loop: spin, ask the peer to wake us, sleep, re-check
``_messages.pyx``  what users hold: SendHandle, Message, and buffers lent to the channel
``_many.pyx``      send_many / recv_many_into: many small messages in one buffer, through
                   the Engine's send and receive (its fields: ``_engine.pxd``)
"""

from rdmamw.engine._engine import Engine
from rdmamw.engine._messages import Message, SendHandle

__all__ = ["Engine", "Message", "SendHandle"]
