"""KVWorker: pushes gradients to and pulls parameters from the servers that own each
key (``wire.shard``), in blocks no larger than each channel's eager limit.

Each request is written once as an operation (rdmamw/steps.py) that yields its two
kinds of wait, :data:`SEND` (batches to servers, until sent) and :data:`REPLIES` (the
servers' replies, until each ended); :meth:`KVWorker.run` performs them blocking and
rdmamw.aio.ps.KVWorker awaits them, so both share the encoding and decoding."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from rdmamw import config
from rdmamw.bootstrap import ranklist
from rdmamw.channel import Channel
from rdmamw.errors import ProtocolError, RdmamwError, Timeout
from rdmamw.ps import onesided, wire
from rdmamw.ps.metrics import ComputeClock, WorkerMetrics
from rdmamw.ps.stream import PullStream, PushQueue
from rdmamw.steps import Driving, Steps

#: the waits a request yields: SEND ``(SEND, {server: messages})`` returns once each
#: batch is sent (its buffers reusable); REPLIES ``(REPLIES, {server: request id}, dest)``
#: returns :meth:`KVWorker.receive_pull`'s closing headers
SEND, REPLIES = 0, 1


class PSError(RdmamwError):
    """A server refused a request (unknown key, shape or dtype mismatch)."""


class KVWorker:
    """One worker's view of the servers: ``channels[i]`` goes to server ``i``.

    ``timeout``: how long a pull may wait for its answer (None: as long as the
    consistency model holds it back; a server that dies raises PeerLost anyway).
    ``chunk``: bytes per block of a push or init (None: each channel's eager limit);
    ``send_thread``: :meth:`push_part` copies out on a thread (docs/dsana.md).
    ``pull``: "one-sided" makes :meth:`pull` READ the shards the servers exposed to
    it (rdmamw/ps/onesided.py; two-sided, counted, where a server exposed none, or
    after ``tries`` reads that each overlapped a change); None: RDMAMW_PS_PULL and
    RDMAMW_PS_PULL_TRIES."""

    def __init__(self, channels: Sequence[Channel], *, timeout: float | None = None,
                 chunk: int | None = None, send_thread: bool = False,
                 pull: str | None = None, tries: int | None = None) -> None:
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1 byte, not {chunk}")
        self.pull_mode = onesided.pull_mode(pull)
        self.tries = config.get("RDMAMW_PS_PULL_TRIES") if tries is None else tries
        if self.tries < 1:
            raise ValueError(f"tries must be >= 1, not {self.tries}")
        self.chans = list(channels)
        self.timeout = timeout
        self.chunk, self.send_thread = chunk, send_thread
        self.shapes: dict[Hashable, tuple[tuple[int, ...], np.dtype]] = {}
        self.base = [0] * len(self.chans)       # model version each server last served
        self.clock = 0
        self.merged = 0         # gradients in the model at the last pull (fewest of any server)
        self.metrics = WorkerMetrics()
        #: DSANA's current assignment (offset, share, global batch) from the server
        #: that schedules; None without a scheduler
        self.assignment: tuple[int, int, int] | None = None
        self.plan_shares: list[int] | None = None   # every worker's share, for reports
        self._ids = itertools.count()
        self.compute_clock = ComputeClock()
        self._handles: list = []                # push_part sends not yet waited
        self._part_t0: float | None = None
        self._sender: PushQueue | None = None
        self.readers = [onesided.ShardReader(ch) for ch in self.chans]
        #: pulls made one-sided, and pulls asked one-sided that went two-sided
        self.one_sided_pulls = self.one_sided_fallbacks = 0
        self._until: float | None = None     # a pull's deadline set by pull() itself

    def owner(self, key: Hashable) -> int:
        return wire.shard(key, len(self.chans))

    # -- public API -----------------------------------------------------------------

    def init(self, keys: Sequence[Hashable], values: Sequence[np.ndarray]) -> None:
        """Declare keys with their initial values (every worker must declare the same
        shapes and dtypes, else PSError naming the key). Of the values a server has
        when a key is first read or pushed, the lowest worker index's win: after
        :meth:`pull_start`, worker 0's."""
        self.run(self.init_steps(keys, values))

    def init_steps(self, keys: Sequence[Hashable], values: Sequence[np.ndarray]) -> Steps:
        keys, values = list(keys), [np.ascontiguousarray(v) for v in values]
        self._pairs(keys, values)
        per: list[list] = [[] for _ in self.chans]
        for k, v in zip(keys, values, strict=True):
            s = self.owner(k)
            flat = v.reshape(-1)
            for o, b in wire.blocks(flat, self.block_size(s)):
                per[s] += [wire.pack(wire.INIT, k=k, o=o, shape=list(v.shape), dt=v.dtype.str,
                                     last=o + b.size >= flat.size), b]
        ids = {}
        for s in range(len(self.chans)):
            ids[s] = next(self._ids)
            per[s].append(wire.pack(wire.SYNC, id=ids[s]))
        yield (SEND, dict(enumerate(per)))
        for s, h in (yield (REPLIES, ids, None)).items():
            self._served(s, h)
        for k, v in zip(keys, values, strict=True):
            self.shapes[k] = (v.shape, v.dtype)

    def pull_start(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None = None
                   ) -> list[np.ndarray]:
        """:meth:`pull` the initial values (after :meth:`init`), answered once every
        worker still connected has asked (a start barrier): all start from worker 0's
        values and nothing is merged before each holds them. Waits up to ``timeout``
        for the others; a worker that said :meth:`done` or was lost is not waited for."""
        return self._pull(keys, out, start=True)

    def push(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
             samples: int | None = None) -> None:
        """Send one iteration's gradients (one clock tick on every server). ``samples``:
        how many samples they are the mean over; round models then weight each
        gradient by it (needed when workers compute unequal shares: DSANA)."""
        self.run(self.push_steps(keys, values, samples))

    def push_steps(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
                   samples: int | None = None) -> Steps:
        t0 = time.monotonic()
        yield (SEND, self._push_msgs(keys, values, t0, samples))
        self.metrics.push.add(time.monotonic() - t0)

    def push_part(self, keys: Sequence[Hashable], values: Sequence[np.ndarray]) -> None:
        """Send some of this iteration's gradients now (say one layer's, as soon as
        backward has computed it), so they travel while the rest is computed, in
        blocks of ``chunk`` bytes; with ``send_thread`` a thread copies them out while
        the caller goes on. :meth:`push_end` completes the iteration; the arrays may
        not be changed before. Bad keys, shapes or dtypes raise here, before anything
        of this call is sent."""
        t0 = time.monotonic()
        if self._part_t0 is None:
            self._part_t0 = t0
        keys, values = list(keys), list(values)
        self._validate(keys, values)
        if not self.send_thread:
            self._handles += self.send_parts(keys, values)
        else:
            if self._sender is None:
                self._sender = PushQueue(self)
            self._sender.put(keys, values)
        self.compute_clock.add_comm(time.monotonic() - t0)

    def push_end(self, samples: int | None = None) -> None:
        """End the iteration begun by :meth:`push_part`: the clock to every server."""
        t0 = time.monotonic() if self._part_t0 is None else self._part_t0
        self.send_batches(self._push_msgs([], [], time.monotonic(), samples))
        self.metrics.push.add(time.monotonic() - t0)

    def pull(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None = None
             ) -> list[np.ndarray]:
        """Fetch the servers' current values of ``keys`` (into ``out`` if given), as
        soon as the consistency model lets this worker read; with ``pull="one-sided"``,
        READ from the servers' shards (whole: each server's keys at one version)."""
        if self.pull_mode == "one-sided":
            t0 = time.monotonic()
            got = self._pull_one_sided(keys, out)
            if got is not None:
                return got
            self.one_sided_fallbacks += 1
            if self.timeout is not None:    # the fallback has what is left of the timeout
                self._until = t0 + self.timeout
                try:
                    return self._pull(keys, out)
                finally:
                    self._until = None
        return self._pull(keys, out)

    def _pull_one_sided(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None
                        ) -> list[np.ndarray] | None:
        """A pull by READs; None (nothing of the model taken) where it must go two-sided."""
        t0 = time.monotonic()
        out, dest, reqs = self.prepare_pull(keys, out)
        per: dict[int, list] = {}
        for k in dest:
            per.setdefault(self.owner(k), []).append(k)
        if not all(self.readers[s].has(ks) for s, ks in per.items()):
            return None
        replies = {}
        deadline = None if self.timeout is None else t0 + self.timeout
        for s, ks in per.items():
            h = self.readers[s].read(ks, dest, self.tries, deadline)
            if h is None:
                return None
            replies[s] = h
        self.complete_pull(replies, t0)
        self.metrics.bytes_pulled += sum(dest[k].nbytes for k in dest)
        self.one_sided_pulls += 1
        return out

    def pull_counts(self) -> dict[str, int]:
        """One-sided pulls, those that went two-sided, shard reads thrown away torn, and
        servers' references given up as bad (rdmamw/ps/onesided.py)."""
        return {"one_sided": self.one_sided_pulls, "fallbacks": self.one_sided_fallbacks,
                "torn": sum(r.torn for r in self.readers),
                "refused": sum(r.refused for r in self.readers)}

    def _pull(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None,
              start: bool = False) -> list[np.ndarray]:
        return self.run(self.pull_steps(keys, out, start))

    def pull_steps(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None = None,
                   start: bool = False) -> Steps:
        """:meth:`pull` (``start``: :meth:`pull_start`) as an operation."""
        t0 = time.monotonic()
        out, dest, reqs = self.prepare_pull(keys, out, start)
        yield (SEND, {s: [m] for s, (m, _) in reqs.items()})
        yield from self._pull_wait({s: rid for s, (_, rid) in reqs.items()}, dest, t0)
        return out

    def push_pull(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
                  out: Sequence[np.ndarray] | None = None, samples: int | None = None
                  ) -> list[np.ndarray]:
        """:meth:`push` then :meth:`pull` of the same keys, the pull request riding in
        the push's batch: one message exchange (and one server wake-up) fewer."""
        return self.run(self.push_pull_steps(keys, values, out, samples))

    def push_pull_steps(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
                        out: Sequence[np.ndarray] | None = None, samples: int | None = None
                        ) -> Steps:
        t0 = time.monotonic()
        out, dest, reqs = self.prepare_pull(keys, out)
        per = self._push_msgs(keys, values, t0, samples)
        for s, (m, _) in reqs.items():
            per[s].append(m)
        yield (SEND, per)
        t1 = time.monotonic()
        self.metrics.push.add(t1 - t0)
        yield from self._pull_wait({s: rid for s, (_, rid) in reqs.items()}, dest, t1)
        return out

    def _push_msgs(self, keys: Sequence[Hashable], values: Sequence[np.ndarray],
                   t0: float, samples: int | None) -> dict[int, list]:
        """Per server: the GRAD blocks of its keys and the clock tick (a push). The
        compute time reported leaves out time spent in push_part / stream waits."""
        if samples is not None and samples < 0:
            raise ValueError(f"samples must be >= 0, not {samples}")
        keys, values = list(keys), list(values)
        self._validate(keys, values)
        t = self.compute_clock.compute(t0)
        if t is not None:
            self.metrics.compute.add(t)
        if self._sender is not None:
            self._handles += self._sender.drain()     # queued parts go before the clock
        per = self._grad_msgs(keys, values)
        for s in per:
            extra = {} if samples is None else {"n": samples}
            per[s].append(wire.pack(wire.CLOCK, c=self.clock + 1, base=self.base[s], t=t,
                                    **extra))
        self.clock += 1
        self._part_t0 = None
        return per

    def _validate(self, keys: list, values: list) -> None:
        self._pairs(keys, values)
        for k, v in zip(keys, values, strict=True):
            self._check(k, v)

    def _grad_msgs(self, keys: list, values: list) -> dict[int, list]:
        """Per server: the GRAD blocks (``block_size`` bytes) of its keys."""
        per: dict[int, list] = {s: [] for s in range(len(self.chans))}
        for k, v in zip(keys, values, strict=True):
            s = self.owner(k)
            flat = np.ascontiguousarray(v).reshape(-1)
            for o, b in wire.blocks(flat, self.block_size(s)):
                per[s] += [wire.pack(wire.GRAD, k=k, o=o, dt=flat.dtype.str), b]
                self.metrics.bytes_pushed += b.nbytes
        return per

    # -- what rdmamw.ps.stream uses (its StreamWorker protocol) -----------------------

    def send_parts(self, keys: list, values: list) -> list:
        """Send GRAD blocks without a clock; the handles (waited for at the clock)."""
        return [self.chans[s].send_batch(m) for s, m in self._grad_msgs(keys, values).items()
                if m]

    def block_size(self, s: int) -> int:
        """Bytes per block to server ``s``: ``chunk``, at most the channel's eager limit."""
        lim = self.chans[s].eager_limit
        return lim if self.chunk is None else min(self.chunk, lim)

    def pull_stream(self, keys: Sequence[Hashable], out: Sequence[np.ndarray]) -> PullStream:
        """Like :meth:`pull` into ``out``, but return at once: a thread copies the
        blocks in as they come, ``stream.wait(key)`` blocks only until that key is
        there (so the next forward pass starts on the first layer while the others
        are still arriving), ``stream.join()`` until all are."""
        return PullStream(self, list(keys), out)

    def push_end_pull(self, keys: Sequence[Hashable], out: Sequence[np.ndarray],
                      samples: int | None = None) -> PullStream:
        """:meth:`push_end` and :meth:`pull_stream` at once: the pull requests ride in
        the clock's batch (one message exchange and one server wake-up fewer)."""
        t0 = time.monotonic() if self._part_t0 is None else self._part_t0
        per = self._push_msgs([], [], time.monotonic(), samples)
        stream = PullStream(self, list(keys), out, first=per)
        self.metrics.push.add(stream.t0 - t0)
        return stream

    def prepare_pull(self, keys: Sequence[Hashable], out: Sequence[np.ndarray] | None,
                     start: bool = False
                     ) -> tuple[list[np.ndarray], dict, dict[int, tuple[bytes, int]]]:
        """Check a pull: (out arrays, their flat views by key, per server the PULL
        request and its id); ``start``: :meth:`pull_start`'s."""
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
            extra = {"start": True} if start else {}
            reqs[s] = (wire.pack(wire.PULL, keys=ks, id=rid, **extra), rid)
        return out, dest, reqs

    def run(self, steps: Steps) -> Any:
        """Perform an operation's waits with blocking calls; its result."""
        run = Driving(steps)
        for step in run:
            try:
                if step[0] == SEND:
                    self.send_batches(step[1])
                else:
                    run.value = self.receive_pull(step[1], step[2])
            except BaseException as e:  # noqa: BLE001 - handed to the operation
                run.exc = e
        return run.result

    def send_batches(self, per: dict[int, list]) -> None:
        handles = [self.chans[s].send_batch(msgs) for s, msgs in per.items() if msgs]
        handles, self._handles = self._handles + handles, []
        for h in handles:
            h.wait()                            # the caller may reuse its arrays now

    def _pull_wait(self, ids: dict[int, int], dest: dict, t0: float) -> Steps:
        self.complete_pull((yield (REPLIES, ids, dest)), t0)

    def complete_pull(self, replies: dict[int, dict], t0: float,
                      restart_clock: bool = True) -> None:
        """A pull is complete: model versions, merged count, DSANA's plan, timing
        (a stream's caller has been computing already: it keeps the clock going)."""
        for s, h in replies.items():
            self._served(s, h)
        self.merged = min(int(h.get("merged", 0)) for h in replies.values())
        now = time.monotonic()
        if restart_clock:
            self.compute_clock.restart(now)
        self.metrics.pull.add(now - t0)

    def _served(self, s: int, h: dict) -> None:
        """Server ``s``'s closing header: the model version read, maybe a plan and
        region references (one-sided pulls)."""
        self.base[s] = h["version"]
        if h.get("rm") is not None:
            self.readers[s].take(h["rm"])
        if h.get("plan") is not None:
            self.assignment = tuple(h["plan"])  # type: ignore[assignment]
        if h.get("shares") is not None:
            self.plan_shares = list(h["shares"])

    def done(self) -> None:
        """Tell the servers this worker is done (they stop counting on it); the
        channels stay open, so a new KVWorker / KVServer pair may use them next."""
        if self._sender is not None:
            self._sender.stop()
            self._sender = None
        self.run(self.done_steps())

    def done_steps(self) -> Steps:
        ids = {}
        for s in range(len(self.chans)):
            try:
                ids[s] = next(self._ids)
                yield (SEND, {s: [wire.pack(wire.BYE, id=ids[s])]})
            except RdmamwError:
                ids.pop(s, None)
        try:        # the acknowledgement: nothing sent after it reaches this server object
            yield (REPLIES, ids, None)
        except RdmamwError:
            pass

    def close(self) -> None:
        """:meth:`done`, then close the channels."""
        self.done()
        for ch in self.chans:
            ch.close()

    # -- helpers --------------------------------------------------------------------

    def receive_pull(self, rids: dict[int, int], dest: dict | None,
               arrived: Callable[[Hashable], None] | None = None) -> dict[int, dict]:
        """Receive from the servers in ``rids`` (server -> request id) until each reply
        has ended, draining all of them as data comes (one server's big reply never
        waits behind another's), copying VAL blocks into ``dest`` and releasing each
        ring slot at once (``arrived(key)`` after a key's last block). Returns each
        server's closing header."""
        hdr: dict[int, dict | None] = dict.fromkeys(rids)
        done: dict[int, dict] = {}
        deadline = self._until if self._until is not None else \
            None if self.timeout is None else time.monotonic() + self.timeout
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
                end = self.take_batch(s, msgs, hdr, dest, rids[s], arrived)
                if end is not None:
                    done[s] = end
            if deadline is not None and time.monotonic() > deadline and len(done) < len(rids):
                raise Timeout(f"no reply from servers "
                              f"{ranklist.compact(set(rids) - set(done))}")
        return done

    def take_batch(self, s: int, msgs: list, hdr: dict, dest: dict | None, rid: int,
                   arrived: Callable[[Hashable], None] | None = None) -> dict | None:
        """Messages of server ``s``'s reply stream (``hdr[s]``: the VAL header whose
        payload is due, None at first); its END / OK header when the reply ended."""
        for i, m in enumerate(msgs):
            end = self._take(s, m, hdr, dest, rid, arrived)
            if end is not None:
                if i + 1 < len(msgs):
                    for rest in msgs[i + 1:]:
                        rest.release()
                    raise ProtocolError(f"server {s} sent data after its reply")
                return end
        return None

    def _take(self, s: int, m: Any, hdr: dict, dest: dict | None, rid: int,
              arrived: Callable[[Hashable], None] | None = None) -> dict | None:
        """One message of server ``s``'s reply stream; its END / OK header when done."""
        h = hdr[s]
        if h is not None:
            hdr[s] = None
            with m:
                tgt = dest.get(h["k"]) if dest is not None else None
                if tgt is not None:
                    o = h.get("o", 0)
                    n, odd = divmod(len(m), tgt.dtype.itemsize)
                    if odd or o + n > tgt.size:
                        raise ProtocolError(f"server {s}: a block of {len(m)} bytes at "
                                            f"{o} does not fit key {h['k']!r}")
                    blk = np.frombuffer(m, dtype=tgt.dtype)
                    tgt[o:o + blk.size] = blk
                    self.metrics.bytes_pulled += blk.nbytes
                    del blk
            if arrived is not None and h.get("last"):
                arrived(h["k"])
            return None
        try:
            h = wire.reply(m)
        finally:
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
