"""rdmamw for asyncio: ``await`` channels from an event loop, no thread per channel.

>>> import rdmamw.aio as aio
>>> async def main():
...     async with await aio.Channel.open("shm://job1") as ch:     # doctest: +SKIP
...         await ch.send_batch([b"ping"])
...         async for m in ch:
...             ...

``open_channel`` is ``Channel.open`` safe to cancel (a channel that arrives after
the caller gave up is closed). The loop watches each channel's ``fileno()``
(docs/api.md, "Event loops").
A channel's remote memory is awaited as well (``await ch.read(ref, into)``, ...:
rdmamw/aio/remote.py). ``rdmamw.aio.collectives`` awaits the collectives and
``rdmamw.aio.ps.KVWorker`` the parameter-server worker (imported on their own: they
pull in numpy)."""

from rdmamw.aio.channel import Channel, Listener, listen, open_channel

__all__ = ["Channel", "Listener", "listen", "open_channel"]
