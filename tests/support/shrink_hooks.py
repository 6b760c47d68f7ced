"""Test-only faults inside the shrink's agreement (rdmamw.collectives.survivors), put
in by the workers of tests/integrations/test_coll_faults.py: the library has no hook
of its own; these wrap its methods in the rank's process.

``hooks`` (JSON from the test), for the rank ``rank``:

* ``{"slow": {rank: {peer: s}}}``: that rank's open of its agreement channel to
  ``peer`` starts ``s`` late (as on a loaded machine);
* ``{"stop": [rank]}``: that rank stops itself (SIGSTOP) once its first set went to
  every peer it counts alive;
* ``{"kill": [rank, step]}``: that rank kills itself (SIGKILL) at ``step``: ``open``
  (its first agreement channel opened), ``told`` (its set went to every peer it counts alive),
  ``decide`` (it decided, before its DECIDED went anywhere), ``decided-K`` (its
  DECIDED went to K members, the highest ranks first), ``returned`` (agree returned
  to it);
* ``{"deaf": {rank: peer}}``: that rank reads nothing from ``peer`` until it sent
  every member it counts alive a set naming ``peer`` (it learnt of its failure from
  the others first: a scheduler's order)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from rdmamw.collectives import survivors


def install(hooks: dict, rank: int) -> None:
    late = {int(p): s for p, s in hooks.get("slow", {}).get(str(rank), {}).items()}
    if late:
        _wrap(survivors._Opener, "run", lambda run: lambda self: (
            time.sleep(late.get(self.peer, 0.0)), run(self))[1])
    if rank in hooks.get("stop", []):
        _after_tell(lambda: os.kill(os.getpid(), signal.SIGSTOP))
    who, step = hooks.get("kill", [None, ""])
    if who == rank:
        _kill_at(step)
    deaf = hooks.get("deaf", {}).get(str(rank))
    if deaf is not None:
        _deaf_to(deaf)


def _deaf_to(peer: int) -> None:
    def make(take: Any) -> Any:
        def took(self: Any) -> Any:
            named = [r for r, s in self.sent.items() if peer in s]
            if peer not in self.chans or len(named) >= len(self.alive()) - 1:
                return take(self)
            ch = self.chans.pop(peer)
            try:
                return take(self)
            finally:
                self.chans[peer] = ch
        return took
    _wrap(survivors._Agreement, "_take", make)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)


def _wrap(cls: Any, name: str, make: Callable[[Any], Any]) -> None:
    setattr(cls, name, make(getattr(cls, name)))


def _after_tell(then: Callable[[], None]) -> None:
    def make(tell: Any) -> Any:
        def told(self: Any) -> None:
            tell(self)
            if len(self.sent) == len(self.alive()) - 1:
                then()
        return told
    _wrap(survivors._Agreement, "_tell", make)


def _kill_at(step: str) -> None:
    if step == "open":
        def make_connect(connect: Any) -> Any:
            def connected(self: Any) -> bool:
                new = connect(self)
                if self.chans:
                    _die()
                return new
            return connected
        _wrap(survivors._Agreement, "_connect", make_connect)
    elif step == "told":
        _after_tell(_die)
    elif step == "decide" or step.startswith("decided-"):
        k = 0 if step == "decide" else int(step.partition("-")[2])

        def make_pass_on(pass_on: Any) -> Any:
            def passed_on(self: Any, decided: Any, frm: Any) -> None:
                if frm is not None:
                    return pass_on(self, decided, frm)
                chans = self.chans
                self.chans = {r: chans[r] for r in sorted(chans, reverse=True)[:k]}
                pass_on(self, decided, frm)
                self.chans = chans
                _die()
            return passed_on
        _wrap(survivors._Agreement, "_pass_on", make_pass_on)
    elif step == "returned":
        def make_agree(agree: Any) -> Any:
            def agreed(*args: Any) -> Any:
                agree(*args)
                _die()
            return agreed
        _wrap(survivors, "agree", make_agree)
    else:
        raise ValueError(f"no step {step!r}")
