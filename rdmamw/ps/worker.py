"""KVWorker: pushes gradients to and pulls parameters from the servers that own each
key (``wire.shard``), in blocks no larger than each channel's eager limit."""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from rdmamw.channel import Channel
from rdmamw.errors import ProtocolError, RdmamwError, Timeout
from rdmamw.ps import wire
from rdmamw.ps.metrics import WorkerMetrics


class PSError(RdmamwError):
    """A server refused a request (unknown key, shape or dtype mismatch)."""


class KVWorker:
    """One worker's view of the servers: ``channels[i]`` goes to server ``i``.

    ``timeout``: how long a pull may wait for its answer (None: as long as the
    consistency model holds it back; a server that dies raises PeerLost anyway)."""

    def __init__(self, channels: Sequence[Channel], *, timeout: float | None = None) -> None:
        self.chans = list(channels)
        self.timeout = timeout
        self.shapes: dict[Hashable, tuple[tuple[int, ...], np.dtype]] = {}
        self.base = [0] * len(self.chans)       # model version each server last served
        self.clock = 0
        self.merged = 0         # gradients in the model at the last pull (fewest of any server)
        self.metrics = WorkerMetrics()
        self._ids = itertools.count()
        self._pulled_at: float | None = None

    def owner(self, key: Hashable) -> int:
        return wire.shard(key, len(self.chans))

    # -- public API -----------------------------------------------------------------

    def init(self, keys: Sequence[Hashable], values: Sequence[np.ndarray]) -> None:
        """Declare keys with their initial values (the first worker's values win; every
        worker must declare the same shapes and dtypes, else PSError naming the key)."""
        keys, values = list(keys), [np.ascontiguousarray(v) for v in values]
        self._pairs(keys, values)
        per: list[list] = [[] for _ in self.chans]
        for k, v in zip(keys, values, strict=True):
            s = self.owner(k)
            flat = v.reshape(-1)
            for o, b in wire.blocks(flat, self.chans[s].eager_limit):
                per[s] += [wire.pack(wire.INIT, k=k, o=o, shape=list(v.shape), dt=v.dtype.str,
                                     last=o + b.size >= flat.size), b]
        ids = {}
        for s, ch in enumerate(self.chans):
            ids[s] = next(self._ids)
            ch.send_batch(per[s] + [wire.pack(wire.SYNC, id=ids[s])]).wait()
        for s, h in self._await(ids, None).items():
            self.base[s] = h["version"]
        for k, v in zip(keys, values, strict=True):
            self.shapes[k] = (v.shape, v.dtype)

    def push(self, keys: Sequence[Hashable], values: Sequence[np.ndarray]) -> None:
        """Send one iteration's gradients (one clock tick on every server)."""
        t0 = time.monotonic()
        self._send(self._push_msgs(keys, values, t0))
        self.metrics.push.add(time.monotonic() - t0)

    def pull(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None = None
             ) -> list[np.ndarray]:
        """Fetch the servers' current values of ``keys`` (into ``out`` if given), as
        soon as the consistency model lets this worker read."""
        t0 = time.monotonic()
        out, dest, reqs = self._pull_msgs(keys, out)
        self._send({s: [m] for s, (m, _) in reqs.items()})
        self._pull_wait({s: rid for s, (_, rid) in reqs.items()}, dest, t0)
        return out

    def push_pull(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
                  out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """:meth:`push` then :meth:`pull` of the same keys, the pull request riding in
        the push's batch: one message exchange (and one server wake-up) fewer."""
        t0 = time.monotonic()
        out, dest, reqs = self._pull_msgs(keys, out)
        per = self._push_msgs(keys, values, t0)
        for s, (m, _) in reqs.items():
            per[s].append(m)
        self._send(per)
        t1 = time.monotonic()
        self.metrics.push.add(t1 - t0)
        self._pull_wait({s: rid for s, (_, rid) in reqs.items()}, dest, t1)
        return out

    def _push_msgs(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
                   t0: float) -> dict[int, list]:
        """Per server: the GRAD blocks of its keys and the clock tick (a push)."""
        if self._pulled_at is not None:
            self.metrics.compute.add(t0 - self._pulled_at)
        keys, values = list(keys), list(values)
        self._pairs(keys, values)
        for k, v in zip(keys, values, strict=True):
            self._check(k, v)
        per: dict[int, list] = {s: [] for s in range(len(self.chans))}
        for k, v in zip(keys, values, strict=True):
            s = self.owner(k)
            flat = np.ascontiguousarray(v).reshape(-1)
            for o, b in wire.blocks(flat, self.chans[s].eager_limit):
                per[s] += [wire.pack(wire.GRAD, k=k, o=o, dt=flat.dtype.str), b]
                self.metrics.bytes_pushed += b.nbytes
        t = self.metrics.compute.last if self._pulled_at is not None else None
        for s in per:
            per[s].append(wire.pack(wire.CLOCK, c=self.clock + 1, base=self.base[s], t=t))
        self.clock += 1
        return per

    def _pull_msgs(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None
                   ) -> tuple[list[np.ndarray], dict, dict[int, tuple[bytes, int]]]:
        """Check a pull: (out arrays, their flat views by key, per server the PULL
        request and its id)."""
        keys = list(keys)
        for k in keys:
            if k not in self.shapes:
                raise KeyError(f"pull of unknown key {k!r} (not declared with init)")
        if out is None:
            out = [np.empty(*self.shapes[k]) for k in keys]
        else:
            out = list(out)
            self._pairs(keys, out)
            for k, o in zip(keys, out, strict=True):
                self._check(k, o)
                if not o.flags.c_contiguous or not o.flags.writeable:
                    raise ValueError(f"out array for key {k!r} must be writeable, C-contiguous")
        dest = {k: o.reshape(-1) for k, o in zip(keys, out, strict=True)}
        by_server: dict[int, list] = {}
        for k in keys:
            by_server.setdefault(self.owner(k), []).append(k)
        reqs = {}
        for s, ks in by_server.items():
            rid = next(self._ids)
            reqs[s] = (wire.pack(wire.PULL, keys=ks, id=rid), rid)
        return out, dest, reqs

    def _send(self, per: dict[int, list]) -> None:
        handles = [self.chans[s].send_batch(msgs) for s, msgs in per.items() if msgs]
        for h in handles:
            h.wait()                            # the caller may reuse its arrays now

    def _pull_wait(self, ids: dict[int, int], dest: dict, t0: float) -> None:
        replies = self._await(ids, dest)
        for s, h in replies.items():
            self.base[s] = h["version"]
        self.merged = min(int(h.get("merged", 0)) for h in replies.values())
        self._pulled_at = time.monotonic()
        self.metrics.pull.add(self._pulled_at - t0)

    def done(self) -> None:
        """Tell the servers this worker is done (they stop counting on it); the
        channels stay open, so a new KVWorker / KVServer pair may use them next."""
        ids = {}
        for s, ch in enumerate(self.chans):
            try:
                ids[s] = next(self._ids)
                ch.send(wire.pack(wire.BYE, id=ids[s])).wait()
            except RdmamwError:
                ids.pop(s, None)
        try:        # the acknowledgement: nothing sent after it reaches this server object
            self._await(ids, None)
        except RdmamwError:
            pass

    def close(self) -> None:
        """:meth:`done`, then close the channels."""
        self.done()
        for ch in self.chans:
            ch.close()

    # -- helpers --------------------------------------------------------------------

    def _await(self, rids: dict[int, int], dest: dict | None) -> dict[int, dict]:
        """Receive from the servers in ``rids`` (server -> request id) until each reply
        has ended, draining all of them as data comes (one server's big reply never
        waits behind another's), copying VAL blocks into ``dest`` and releasing each
        ring slot at once. Returns each server's closing header."""
        hdr: dict[int, dict | None] = dict.fromkeys(rids)
        done: dict[int, dict] = {}
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while len(done) < len(rids):
            waiting = [s for s in rids if s not in done]
            for s in waiting:
                if len(waiting) == 1:      # one left: block (PeerLost / Timeout end it)
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    msgs = self.chans[s].recv_batch(timeout=left)
                else:
                    try:
                        msgs = self.chans[s].recv_batch(timeout=0.0005)
                    except Timeout:
                        continue
                for i, m in enumerate(msgs):
                    end = self._take(s, m, hdr, dest, rids[s])
                    if end is not None:
                        done[s] = end
                        if i + 1 < len(msgs):
                            raise ProtocolError(f"server {s} sent data after its reply")
            if deadline is not None and time.monotonic() > deadline and len(done) < len(rids):
                raise Timeout(f"no reply from servers {sorted(set(rids) - set(done))}")
        return done

    def _take(self, s: int, m: Any, hdr: dict, dest: dict | None, rid: int) -> dict | None:
        """One message of server ``s``'s reply stream; its END / OK header when done."""
        h = hdr[s]
        if h is not None:
            hdr[s] = None
            with m:
                tgt = dest.get(h["k"]) if dest is not None else None
                if tgt is not None:
                    blk = np.frombuffer(m, dtype=tgt.dtype)
                    tgt[h["o"]:h["o"] + blk.size] = blk
                    self.metrics.bytes_pulled += blk.nbytes
                    del blk
            return None
        h = wire.unpack(m)
        m.release()
        if h["op"] == wire.VAL:
            hdr[s] = h
        elif h["op"] == wire.ERR:
            raise PSError(h["msg"])
        elif h["op"] in (wire.END, wire.OK) and h["id"] == rid:
            return h
        return None

    def _pairs(self, keys: list, values: list) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} arrays")

    def _check(self, k: Hashable, v: np.ndarray) -> None:
        if k not in self.shapes:
            raise KeyError(f"unknown key {k!r} (not declared with init)")
        shape, dt = self.shapes[k]
        if v.shape != shape or v.dtype != dt:
            raise ValueError(f"key {k!r}: got {v.dtype} {v.shape}, expected {dt} {shape}")
