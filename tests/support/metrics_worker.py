"""One rank of a metrics test job (tests/integrations/test_metrics_job.py, started through
rdmamw.bootstrap.launch with RDMAMW_METRICS_PORT set). Opens a channel to every other
rank, sends each peer a traffic of its own (so a series under the wrong peer shows) and
one large message, receives what every peer sent, runs ``ALLREDUCES`` allreduces, then
prints one JSON line: its rank, the bytes its own channel sent each peer, and per peer
the summed ``stats()`` of its channels to that peer (its own and the communicator's,
where it has one). It stays up, idle, until a line comes
on stdin (the test scrapes it meanwhile), prints the same again, and exits after
another line."""

from __future__ import annotations

import json
import sys

import numpy as np

import rdmamw
from rdmamw.collectives import allreduce
from rdmamw.collectives.api import default_comm

ALLREDUCES = 5
LARGE = 256 << 10       # above the 64 KiB eager slots


def plan(src: int, dst: int) -> tuple[int, int, int]:
    """(batches, messages per batch, bytes per message) rank ``src`` sends ``dst``."""
    return 2 + src, 3 + dst, 8 * (1 + src + 2 * dst)


def summed(chans: list) -> dict[str, float]:
    out: dict[str, float] = {}
    for ch in chans:
        for k, v in ch.stats().items():
            if type(v) in (int, float):
                out[k] = out.get(k, 0) + v
    return out


def main() -> None:
    w = rdmamw.init()
    me, n = w.rank, w.world_size
    chans = {p: rdmamw.Channel.open(p) for p in range(n) if p != me}
    large = []
    for p, ch in chans.items():
        batches, count, size = plan(me, p)
        for _ in range(batches):
            ch.send_batch([bytes([me]) * size] * count).wait()
        large.append(ch.send_batch([bytes(LARGE)]))   # one by rendezvous: done once read
    for p, ch in chans.items():
        batches, count, size = plan(p, me)
        got = 0
        while got < batches * count:
            for m in ch.recv_batch(timeout=30):
                assert len(m) == size
                m.release()
                got += 1
        assert len(ch.recv(timeout=30)) == LARGE
    for h in large:
        h.wait()
    for _ in range(ALLREDUCES):
        allreduce(np.ones(16, np.float32))
    comm = default_comm()

    def report() -> None:
        print(json.dumps({"rank": me, "sent": {str(p): ch.stats()["bytes"]
                                               for p, ch in chans.items()}, "stats": {
            str(p): summed([ch, *([comm.channel(p)] if p in comm._chans else [])])
            for p, ch in chans.items()}}), flush=True)

    report()
    sys.stdin.readline()
    report()
    sys.stdin.readline()        # every rank reported: the channels may close now
    comm.close()
    for ch in chans.values():
        ch.close()


if __name__ == "__main__":
    main()
