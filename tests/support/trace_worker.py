"""One rank of a timeline test job (tests/integrations/test_trace_job.py, started
through rdmamw.bootstrap.launch with RDMAMW_TRACE set): ``ALLREDUCES`` ring allreduces
of ``ELEMS`` float32 (the file is written at exit), then a JSON line: its rank and the
results' first elements (the job ran)."""

from __future__ import annotations

import json

import numpy as np

import rdmamw
from rdmamw.collectives import allreduce

ALLREDUCES = 3
ELEMS = 1 << 16         # 256 KiB: chunks on the collectives' 1 MiB-slot rings


def main() -> None:
    w = rdmamw.init()
    got = [float(allreduce(np.full(ELEMS, w.rank + i, np.float32), algorithm="ring")[0])
           for i in range(ALLREDUCES)]
    print(json.dumps({"rank": w.rank, "results": got}), flush=True)


if __name__ == "__main__":
    main()
