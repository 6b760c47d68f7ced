"""One rank of a parameter-server job that loses a worker and takes its replacement
(rdmamw/ps/rejoin.py), started by tests/integrations/test_ps_join.py with a launcher's
environment per rank. argv: MODE (server | member | victim | replacement), the
consistency, the output directory, the gradient (``quad``: x - target, every worker
on the same x; ``const``: the target itself, whatever x is).

Members loop push + pull until the replacement wrote ``DIR/joined``, then ``EXTRA``
more iterations. The victim SIGKILLs itself before iteration ``DIE`` (a kill between
two pushes: ASP applies a push's blocks as they come, so a kill half way through one
would leave a gradient in the model that no clock counted). The replacement sleeps
``--join-delay`` after its channels are open (a slow start: the others must not wait
for it), then ``init`` + ``pull_start`` and ``EXTRA`` iterations. Every worker saves
its first and final values with the versions and merged counts they were read at;
the server its final model and stats."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import numpy as np

import rdmamw
from rdmamw import ps
from tests.support.ps_job import KEYS, shapes, targets

SERVERS, BIG, DIE, EXTRA, STEP = 1, 3000, 6, 8, 0.01
LR, MU = 0.2, 0.5


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def save(path: str, node: ps.KVWorker, x: list[np.ndarray]) -> None:
    versions = [node.base[node.owner(k)] for k in KEYS]
    np.savez(path, *x, versions=np.array(versions), merged=np.array(node.merged))


def serve(consistency: str, out: str, round_timeout: float) -> None:
    c = ps.Consistency.parse(consistency, round_timeout=round_timeout)
    node = ps.start(SERVERS, consistency=c, lr=LR, momentum=MU)
    assert isinstance(node, ps.KVServer)
    stats = node.serve()
    np.savez(os.path.join(out, f"server{rdmamw.world().rank}.npz"),
             **{str(k): v for k, v in node.model.items()})
    stats["round_sizes"] = sorted(stats["round_sizes"].items())
    stats.pop("groups", None)
    emit({"role": "server", **stats})
    node.close()


def work(mode: str, consistency: str, out: str, grad: str, delay: float) -> None:
    node = ps.start(SERVERS, consistency=consistency, lr=LR, momentum=MU, timeout=60)
    assert isinstance(node, ps.KVWorker)
    me = ps.worker_index(SERVERS)
    tg = targets(BIG)
    if mode == "replacement":
        time.sleep(delay)
    x = [np.zeros(s, d) for s, d in shapes(BIG)]
    node.init(KEYS, [np.full(s, 1.0, d) for s, d in shapes(BIG)])
    node.pull_start(KEYS, out=x)
    save(os.path.join(out, f"first{me}-{mode}.npz"), node, x)
    flag = os.path.join(out, "joined")
    if mode == "replacement":
        open(flag, "w").close()
    else:
        emit({"role": "worker", "ready": me})
    left, i, end = EXTRA, 0, time.monotonic() + 60
    while left > 0 and time.monotonic() < end:
        if mode == "victim" and i == DIE:
            os.kill(os.getpid(), signal.SIGKILL)
        g = [xi - ti if grad == "quad" else ti for xi, ti in zip(x, tg, strict=True)]
        node.push(KEYS, g)
        node.pull(KEYS, out=x)
        time.sleep(STEP)
        i += 1
        if mode == "replacement" or os.path.exists(flag):
            left -= 1
    save(os.path.join(out, f"final{me}-{mode}.npz"), node, x)
    emit({"role": "worker", "index": me, "mode": mode, "iters": i, "clock": node.clock})
    node.close()


def main() -> None:
    mode, consistency, out, grad = sys.argv[1:5]
    delay = float(sys.argv[5]) if len(sys.argv) > 5 else 1.0
    logging.basicConfig(level=logging.WARNING)
    if mode == "server":
        serve(consistency, out, float(sys.argv[6]) if len(sys.argv) > 6 else 10.0)
    else:
        work(mode, consistency, out, grad, delay)


if __name__ == "__main__":
    main()
