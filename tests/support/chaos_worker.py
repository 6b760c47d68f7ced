"""A rank of a chaos trial (bench/chaos.py): loops one *layer* until a rank of the job
fails, checking every result it gets, then prints (JSON lines on stdout) how it
failed, shrinks the communicator and checks one allreduce on the survivors.

argv: ``LAYER SEED TIMEOUT STREAM_TIMEOUT``. Every rank draws the same calls from
``SEED`` (so they call the same collectives in the same order); every input is a
function of (rank, call, element), so each rank knows what each result must be.

Layers:

* ``allreduce``: ring, rhd or auto allreduce (sum) of a small (<= 20 KB) or a large
  (> 1 MiB) float32 array;
* ``bcast_gather``: broadcast from a random root, or allgather;
* ``stream``: ranks 2k and 2k + 1 ping-pong numbered messages (64 B to 1.5 MiB, eager
  and rendezvous) on a channel of their own (``rdmamw.Channel.open(peer)``), each
  checked byte for byte; between rounds every rank runs a small allreduce (the
  checkpoint that brings the failure to the ranks that do not stream with the victim).
  A stream error (recv/send deadline ``STREAM_TIMEOUT``) is recorded, naming the
  partner, and the rank goes on to the checkpoint, which then fails too;
* ``torch``: ``torch.distributed.all_reduce`` (sum, small and large float32 tensors)
  on a group of the rdmamw backend (``new_group(timeout=TIMEOUT)``); after the
  failure ``rdmamw.torch.shrink()`` and an allreduce on the shrunk group
  (docs/torch.md, "A rank lost: going on").

Lines: ``{"rank", "ready"}`` before the loop; ``{"rank", "t", "calls", "wrong",
"error", "named", "msg", "stream_error", "stream_peer"}`` at the failure (``t``:
time.time(); ``wrong``: results that were not what they must be; ``named``: the
error's ``.rank``); then ``{"rank", "members", "new_rank", "sum", "want", "t_after"}``
after the shrink and its allreduce (or ``{"rank", "shrink_error", ...}``).

SIGUSR1 (the ``close`` fault) raises ``Closing`` wherever the rank is after it said
ready (or, where that exception is swallowed, before its next call): it closes its
communicator (and its stream channel), prints ``{"rank", "closed"}`` and idles,
alive, until killed."""

from __future__ import annotations

import datetime
import json
import random
import signal
import struct
import sys
import time
from typing import NoReturn

import numpy as np

import rdmamw
import rdmamw.collectives as coll

HDR = struct.Struct("<iii")          # sender, round, seq
STREAM_SIZES = (64, 3000, 64 << 10, (3 << 19))
LARGE = (270_000, 600_000)           # float32 elements: 1.03 to 2.3 MiB


class Closing(BaseException):
    """SIGUSR1: the driver's ``close`` fault, raised wherever this rank is (mid-call,
    as a KeyboardInterrupt would be); the rank then closes its communicator."""


#: SIGUSR1 came (the exception may be swallowed where it lands, in a finalizer, say:
#: "Exception ignored"; the loop then raises it at its next call)
close_asked: list[bool] = []


def closing(signum: int, frame: object) -> None:
    close_asked.append(True)
    raise Closing


def data(rank: int, call: int, n: int) -> np.ndarray:
    """Rank ``rank``'s input to call ``call``: small integers, exact in float32."""
    return ((rank + 1) + (np.arange(n) + call) % 5).astype(np.float32)


def summed(size: int, call: int, n: int) -> np.ndarray:
    """The sum of every rank's data(rank, call, n) over a world of ``size``."""
    return (size * (size + 1) // 2 + size * ((np.arange(n) + call) % 5)).astype(np.float32)


def message(sender: int, rnd: int, seq: int, size: int) -> bytes:
    fill = bytes([(sender * 37 + rnd * 11 + seq * 3) % 251 + 1])
    return HDR.pack(sender, rnd, seq) + fill * (size - HDR.size)


class Rank:
    def __init__(self, layer: str, seed: int, timeout: float, stream_timeout: float) -> None:
        if layer == "torch":
            import torch.distributed as dist

            from rdmamw import torch as _backend  # noqa: F401 - registers the backend
            # (a long one to start: torch's import staggers the ranks by seconds under
            # load; then the group of the trial, its collectives bound by ``timeout``)
            dist.init_process_group("rdmamw", timeout=datetime.timedelta(seconds=60))
            dist.barrier()
            self.pg = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
            self.me, self.n = dist.get_rank(), dist.get_world_size()
        else:
            w = rdmamw.init(timeout=60)
            self.me, self.n = w.rank, w.world_size
        self.layer, self.timeout, self.stream_timeout = layer, timeout, stream_timeout
        self.rng = random.Random(seed)     # the same draws on every rank
        self.calls = self.wrong = 0
        self.stream_error: str | None = None
        self.stream_peer: int | None = None
        self.stream_msg = ""
        partner = self.me ^ 1
        self.partner = partner if layer == "stream" and partner < self.n else None
        self.ch = rdmamw.Channel.open(self.partner, timeout=60) \
            if self.partner is not None else None

    def size(self) -> int:
        if self.rng.random() < 0.5:
            return self.rng.randint(1, 5000)
        return self.rng.randint(*LARGE)

    def check(self, ok: bool) -> None:
        self.calls += 1
        if not ok:
            self.wrong += 1

    def allreduce(self, i: int) -> None:
        algo = self.rng.choice(("ring", "rhd", "auto"))
        n = self.size()
        got = coll.allreduce(data(self.me, i, n), algorithm=algo, timeout=self.timeout)
        self.check(np.array_equal(got, summed(self.n, i, n)))

    def bcast_gather(self, i: int) -> None:
        if self.rng.random() < 0.5:
            root, n = self.rng.randrange(self.n), self.size()
            a = data(self.me, i, n) if self.me == root else np.zeros(n, np.float32)
            coll.broadcast(a, root=root, timeout=self.timeout)
            self.check(np.array_equal(a, data(root, i, n)))
        else:
            n = self.size() // 2 + 1
            got = coll.allgather(data(self.me, i, n), timeout=self.timeout)
            self.check(all(np.array_equal(got[r], data(r, i, n)) for r in range(self.n)))

    def torch(self, i: int) -> None:
        """torch.distributed.all_reduce (sum) on a group of the rdmamw backend."""
        import torch
        import torch.distributed as dist
        n = self.size()
        t = torch.from_numpy(data(self.me, i, n))
        dist.all_reduce(t, group=self.pg)
        self.check(np.array_equal(t.numpy(), summed(self.n, i, n)))

    def stream(self, i: int) -> None:
        sizes = [self.rng.choice(STREAM_SIZES) for _ in range(self.rng.randint(1, 6))]
        if self.ch is not None and self.stream_error is None:
            try:
                for seq, size in enumerate(sizes):
                    for sender in sorted((self.me, self.partner)):
                        if sender == self.me:
                            self.ch.send(message(sender, i, seq, size),
                                         timeout=self.stream_timeout).wait(self.stream_timeout)
                        else:
                            m = self.ch.recv(timeout=self.stream_timeout)
                            self.check(bytes(m) == message(sender, i, seq, size))
                            m.release()
            except rdmamw.RdmamwError as e:
                self.stream_error, self.stream_peer = type(e).__name__, self.partner
                self.stream_msg = str(e)
        # the checkpoint: every rank, whether it streams or not
        got = coll.allreduce(data(self.me, i, 16), algorithm="ring", timeout=self.timeout)
        self.check(np.array_equal(got, summed(self.n, i, 16)))

    def loop(self) -> dict:
        step = getattr(self, self.layer)
        step(0)
        signal.signal(signal.SIGUSR1, closing)
        print(json.dumps({"rank": self.me, "ready": True}), flush=True)
        i = 1
        try:
            while True:
                if close_asked:
                    raise Closing
                step(i)
                i += 1
        except Closing:
            self.close()
        except BaseException as e:      # noqa: BLE001 - typed or not, the driver judges
            return {"rank": self.me, "t": time.time(), "calls": self.calls,
                    "wrong": self.wrong, "error": type(e).__name__,
                    "named": getattr(e, "rank", None), "msg": str(e)[:300],
                    "stream_error": self.stream_error, "stream_peer": self.stream_peer,
                    "stream_msg": self.stream_msg[:300]}

    def close(self) -> NoReturn:
        """The ``close`` fault: close the stream channel, then the communicator (with
        its goodbyes, which wait for the peers', unless the signal came mid-collective
        and broke it), then stay alive, doing nothing, until the driver kills this
        process."""
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if self.ch is not None:
            self.ch.close()
        if self.layer == "torch":
            import torch.distributed as dist
            dist.destroy_process_group()
        else:
            coll.default_comm().close()
        print(json.dumps({"rank": self.me, "closed": time.time()}), flush=True)
        while True:
            time.sleep(3600)

    def after(self) -> dict:
        try:
            members, new_rank, got = self.torch_shrunk() if self.layer == "torch" \
                else self.shrunk()
        except BaseException as e:      # noqa: BLE001
            return {"rank": self.me, "t_after": time.time(),
                    "shrink_error": type(e).__name__, "msg": str(e)[:300]}
        want = float(sum(m + 1 for m in members))
        return {"rank": self.me, "members": members, "new_rank": new_rank,
                "sum": float(got[0]) if (got == got[0]).all() else None, "want": want,
                "t_after": time.time()}

    def shrunk(self) -> tuple[list[int], int, np.ndarray]:
        """The survivors' communicator: its members, this rank's place, and the
        allreduce of (world rank + 1) on it."""
        comm = coll.shrink()
        x = np.full(1000, float(self.me + 1), np.float64)
        return comm.members, comm.rank, coll.allreduce(x, comm=comm, timeout=self.timeout)

    def torch_shrunk(self) -> tuple[list[int], int, np.ndarray]:
        """The same through rdmamw.torch.shrink() and the shrunk group's allreduce."""
        import torch

        import rdmamw.torch as rt
        pg = rt.shrink(self.pg)
        x = torch.full((1000,), float(self.me + 1), dtype=torch.float64)
        pg.allreduce([x]).wait()
        return list(pg.comm.members), pg.rank(), x.numpy()


def main() -> None:
    layer, seed, timeout, stream_timeout = sys.argv[1:5]
    r = Rank(layer, int(seed), float(timeout), float(stream_timeout))
    print(json.dumps(r.loop()), flush=True)
    print(json.dumps(r.after()), flush=True)


if __name__ == "__main__":
    main()
