"""A rank of a job that runs the shrink's agreement directly
(rdmamw.collectives.survivors.agree), each rank starting from the set of failed ranks
the test gives it, as if the collective before had ended differently on each.
argv: ``DEADLINE SUSPECTS ABSENT [HOOKS]``: SUSPECTS a JSON map of rank -> the ranks
it starts with; ABSENT the ranks (comma-separated, may be empty) that never take part
(they sleep, as a stopped rank); HOOKS the test-only faults of
tests/support/shrink_hooks.py (JSON). Prints one JSON line: the members
agreed on, or the error (its type and message), and ``t``: seconds from the start to
the return."""

from __future__ import annotations

import json
import sys
import time

from shrink_hooks import install  # (run as a script: tests/support is sys.path[0])

import rdmamw
from rdmamw.collectives import survivors


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
