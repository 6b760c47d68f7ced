"""rdmamw for asyncio: ``await`` channels from an event loop, no thread per channel.

>>> import rdmamw.aio as aio
>>> async def main():
...     async with await aio.Channel.open("shm://job1") as ch:     # doctest: +SKIP
...         await ch.send_batch([b"ping"])
...         async for m in ch:
...             ...

The loop watches each channel's ``fileno()`` (docs/api.md, "Event loops").
Awaitable collectives and the parameter-server client are designed in docs/api.md
("asyncio") and not here yet."""

from rdmamw.aio.channel import Channel, Listener, listen

__all__ = ["Channel", "Listener", "listen"]
