"""A rank of a job that runs the shrink's agreement directly
(rdmamw.collectives.survivors.agree), each rank starting from the set of failed ranks
the test gives it, as if the collective before had ended differently on each.
argv: ``DEADLINE SUSPECTS ABSENT [HOOKS]``: SUSPECTS a JSON map of rank -> the ranks
it starts with; ABSENT the ranks (comma-separated, may be empty) that never take part
(they sleep, as a stopped rank); HOOKS a JSON map of test-only faults:
``{"slow": {rank: {peer: s}}}``: that rank's open of its agreement channel to ``peer``
starts ``s`` late (a loaded machine), ``{"stop": [rank]}``: that rank stops itself
(SIGSTOP) once its first set went to every peer. Prints one JSON line: the members
agreed on, or the error (its type and message), and ``t``: seconds from the start to
the return."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import rdmamw
from rdmamw.collectives import survivors


def install(hooks: dict, rank: int) -> None:
    late = {int(p): s for p, s in hooks.get("slow", {}).get(str(rank), {}).items()}
    if late:
        run = survivors._Opener.run

        def late_run(self: Any) -> None:
            time.sleep(late.get(self.peer, 0.0))
            run(self)
        survivors._Opener.run = late_run            # type: ignore[method-assign]
    if rank in hooks.get("stop", []):
        tell = survivors._Agreement._tell

        def tell_then_stop(self: Any) -> None:
            tell(self)
            if len(self.sent) == len(self.members) - 1:
                os.kill(os.getpid(), signal.SIGSTOP)
        survivors._Agreement._tell = tell_then_stop  # type: ignore[method-assign]


def main() -> None:
    deadline, suspects = float(sys.argv[1]), json.loads(sys.argv[2])
    absent = {int(r) for r in sys.argv[3].split(",") if r}
    w = rdmamw.init(timeout=60)
    if w.rank in absent:
        time.sleep(deadline + 30)
        return
    install(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}, w.rank)
    t0 = time.monotonic()
    out: dict = {"rank": w.rank}
    try:
        out["members"] = survivors.agree(w, list(range(w.world_size)),
                                         set(suspects.get(str(w.rank), [])), t0 + deadline)
    except rdmamw.RdmamwError as e:
        out.update(error=type(e).__name__, msg=str(e))
    out["t"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
