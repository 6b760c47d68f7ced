"""Operations written once, run blocking or awaited: an operation that waits on
channels is a generator yielding the waits it needs as steps (tuples its driver
understands) and returning its result; a blocking driver performs each step with
blocking calls, an asyncio driver (rdmamw.aio) awaits it. The collectives
(rdmamw/collectives/comm.py) and the parameter-server worker (rdmamw/ps/worker.py)
are written this way, so their schedules and codecs exist once."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

#: an operation: a generator of steps that returns its result
Steps = Generator[tuple, Any, Any]


class Driving:
    """An operation being run, what every driver shares: iterate it for the steps;
    set ``value`` to a step's outcome, or ``exc`` to its failure (thrown into the
    operation at that step); ``result`` once the iteration ends."""

    __slots__ = ("steps", "value", "exc", "result")

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.value: Any = None
        self.exc: BaseException | None = None
        self.result: Any = None

    def __iter__(self) -> Iterator[tuple]:
        steps = self.steps
        while True:
            try:
                step = steps.send(self.value) if self.exc is None else steps.throw(self.exc)
            except StopIteration as e:
                self.result = e.value
                return
            self.value = self.exc = None
            yield step
