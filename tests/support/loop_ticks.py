"""LoopTicks: how long an event loop ran other work while a test awaited something
(tests of rdmamw.aio; the aio collectives' worker, run as a script, imports it as
``loop_ticks``)."""

from __future__ import annotations

import asyncio


class LoopTicks:
    """A task of the running event loop that counts its 10 ms ticks: how long the
    loop ran other work while a test awaited something (create it inside the loop)."""

    def __init__(self) -> None:
        self.n = 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.n += 1

    def stop(self) -> int:
        self._task.cancel()
        return self.n
