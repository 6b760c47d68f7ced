"""KVServer: owns a shard of the keys, applies SGD with momentum, answers pulls from
the latest model when the consistency model allows.

One thread polls every worker's channel: the decisions of a consistency model are
then plain sequential code, and nothing waits on one worker while another sends."""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rdmamw import config, observe
from rdmamw.channel import Channel
from rdmamw.errors import ChannelClosed, PeerLost, Timeout
from rdmamw.ps import onesided, wire
from rdmamw.ps.consistency import APPLY, DROP, Adaptive, Async, Consistency, Policy
from rdmamw.ps.metrics import PeerMetrics
from rdmamw.ps.optim import SGD
from rdmamw.sched import Dsana

log = logging.getLogger("rdmamw.ps")
_SKIP: dict = {}        # expect[w]: the payload of a refused header, dropped unread


class KVServer:
    """Serve the workers on ``channels`` (worker index -> Channel) until each has
    said goodbye or is lost. ``lr`` / ``momentum``: the SGD step the server applies
    (to the mean gradient of a round, or to each gradient / n in ASP and SSP), with
    delay compensation when the consistency model asks for it (``dc``).

    ``scheduler``: a DSANA scheduler (rdmamw.sched) fed with every worker's compute
    time and samples; it re-plans when a round closes and the plan rides on the pull
    replies. Give it to one server of the job (every server's plan would agree only
    by luck). Round models weight each gradient by the samples it reports.

    ``pull``: "one-sided" exposes the shard to every worker, which then READs it
    (rdmamw/ps/onesided.py; ValueError for a consistency model that decides when a
    worker may read: every one but ASP without delay compensation); None: RDMAMW_PS_PULL."""

    def __init__(self, channels: dict[int, Channel] | Sequence[Channel], *,
                 consistency: Consistency | str = "bsp", lr: float = 0.1,
                 momentum: float = 0.9, idle_sleep: float = 0.02,
                 scheduler: Dsana | None = None, init_timeout: float | None = None,
                 reply_timeout: float | None = None, pull: str | None = None) -> None:
        if not isinstance(channels, dict):
            channels = dict(enumerate(channels))
        self.chans: dict[int, Channel] = dict(channels)
        c = consistency if isinstance(consistency, Consistency) else Consistency.parse(consistency)
        self.consistency = c
        self.policy: Policy = c.policy(sorted(self.chans))
        self.lr, self.momentum, self.idle_sleep = lr, momentum, idle_sleep
        self.opt = SGD(lr, momentum, c.dc)
        # ASP / SSP apply every gradient on arrival: blocks go straight from the ring
        # into the model; round models stage them until the worker's clock decides
        self.direct = isinstance(self.policy, Async)
        self.n = len(self.chans)
        self.model: dict[Any, np.ndarray] = {}
        self.velocity: dict[Any, np.ndarray] = {}
        self.pending: dict[Any, np.ndarray] = {}       # a round's gradient sum
        self.staging: dict[int, dict[Any, np.ndarray]] = {w: {} for w in self.chans}
        self.staged: dict[int, set] = {w: set() for w in self.chans}  # keys of this push
        self.backup: dict[int, dict[Any, np.ndarray]] = {w: {} for w in self.chans}  # dc
        self.expect: dict[int, dict | None] = {w: None for w in self.chans}  # header, payload due
        self.reads: dict[int, dict] = {}               # deferred pulls, one per worker
        self.bye: set[int] = set()
        # late joiners (rdmamw/ps/rejoin.py, :meth:`admit`): channels handed over by
        # another thread, then attached here; a joining worker is served its messages but
        # counted by nobody until its first read is answered at a round boundary
        self._arrivals: queue.SimpleQueue[tuple[int, Channel]] = queue.SimpleQueue()
        self.joining: dict[int, int] = {}   # worker -> the version when it arrived
        self.started: set[int] = set()      # joiners: their first read was their start
        self.joined: list[dict] = []        # admissions: worker, version, clock
        self.on_lost: list[Callable[[int], None]] = []   # called with each lost worker
        # keys still taking initial values -> the worker whose values they hold (the
        # lowest index declared so far); a key's first read or gradient ends it
        self._init_by: dict[Any, int] = {}
        # keys whose held initial values are still arriving (their worker has not sent
        # the last block): a read of such a key waits, and the blocks keep coming in
        # even after a read or gradient ended the lowest-index rule
        self._init_rest: dict[Any, int] = {}
        # when each of those last got a block: a read waits at most ``init_timeout`` s
        # from then (a worker that sent part of its values and stopped must not hold the
        # others for ever)
        self._init_since: dict[Any, float] = {}
        self.init_timeout = config.get("RDMAMW_PS_INIT_TIMEOUT") if init_timeout is None \
            else init_timeout
        # a reply a worker does not take within this many seconds drops that worker: one
        # thread serves them all, so a worker that never reads must not stall the rest
        self.reply_timeout = config.get("RDMAMW_PS_REPLY_TIMEOUT") if reply_timeout is None \
            else reply_timeout
        self.dropped = 0            # workers dropped by reply_timeout (stats: dropped_workers)
        self.lost: set[int] = set()
        self.peers: dict[int, PeerMetrics] = {w: PeerMetrics() for w in self.chans}
        self._last = -1                                # the worker heard from last
        self.scheduler = scheduler
        self.plan: dict[int, tuple[int, int]] = {} if scheduler is None \
            else scheduler.assignment()
        self._round_weight = 0.0                       # samples (or gradients) pending
        self._dirty: dict[Any, float] = {}             # closed round's steps not yet applied
        self._round_mark = 0                           # the timeline's last round close
        self.pull = onesided.pull_mode(pull)
        self.shard: onesided.ExposedShard | None = None
        if self.pull == "one-sided":
            why = onesided.one_sided_refusal(c.mode, c.dc, scheduler is not None)
            if why is not None:
                raise ValueError(f"pull='one-sided' (RDMAMW_PS_PULL): {why}; pull two-sided")
            self.shard = onesided.ExposedShard(
                self.chans, lambda: (self.policy.version, self.policy.merged))
        # every change of the model (and its version) inside ``with self.changing:``
        self.changing: Any = self.shard if self.shard is not None else contextlib.nullcontext()
        observe.serving(self)       # its stats() in the metrics (rdmamw/metrics/readings.py)

    # -- the loop -------------------------------------------------------------------

    def serve(self) -> dict:
        """Run until every worker is done or lost; return :meth:`stats`."""
        while not self.finished:
            if not self.serve_once():
                self.idle()
        return self.stats()

    @property
    def finished(self) -> bool:
        return not set(self.chans) - self.bye - self.lost

    def admit(self, w: int, ch: Channel) -> None:
        """Take worker ``w`` (a new index, or a lost worker's replacement) on ``ch`` into
        the running job; any thread may call it. The worker then calls ``init`` (its
        values lose to the model's) and ``pull_start`` or ``pull``: that first read is
        answered at a round boundary with the current model, and from then on the
        consistency model counts it (``stats()["joined"]``). Before it, nobody waits for
        it; a push before it is refused."""
        self._arrivals.put((w, ch))

    def serve_once(self) -> bool:
        """One pass over the channels, the round clock and the waiting reads; says
        whether anything happened (so the caller may wait briefly if not)."""
        busy = False
        while not self._arrivals.empty():
            self._attach(*self._arrivals.get())
            busy = True
        for w in list(self.chans):
            busy |= self._receive(w, 0)
        now = time.monotonic()
        while self.policy.close_due(now):
            self._close_round(now)
            busy = True
        self._answer_reads()
        return busy

    def idle(self) -> None:
        """Nothing to do: wait until a worker sends, at most ``idle_sleep`` s (rounds and
        initial values time out by the clock). One worker: a blocking receive (it spins
        briefly first, so a quick next message costs no wake-up); several: every
        channel's descriptor armed at once, as rdmamw.aio does (no turn-taking)."""
        here = [w for w in self.chans if w not in self.lost and w not in self.bye]
        if len(here) == 1:
            self._receive(here[0], self.idle_sleep)
            return
        live = [self.chans[w] for w in here]
        armed: list[Channel] = []
        try:
            wait = self.idle_sleep
            for ch in live:
                if ch.arm(False):       # something to take (or a loss to see) already
                    return
                armed.append(ch)
                if ch.poll_interval:    # a provider that reports some arrivals unasked
                    wait = min(wait, ch.poll_interval)
            if armed:
                select.select([ch.fileno() for ch in armed], [], [], wait)
        except (PeerLost, ChannelClosed):
            return                      # the next pass's receive sees it
        finally:
            for ch in armed:
                ch.disarm()

    def _receive(self, w: int, timeout: float) -> bool:
        """Take what worker ``w`` sent (waiting up to ``timeout`` s); whether any."""
        if w in self.lost or w in self.bye:
            return False
        try:
            msgs = self.chans[w].recv_batch(timeout=timeout)
        except Timeout:
            return False
        except (PeerLost, ChannelClosed) as e:
            self._lose(w, e)
            return False
        self._last = w
        for i, m in enumerate(msgs):
            if w in self.bye:           # nothing may follow a BYE (it waits for the ack)
                log.warning("rdmamw.ps: worker %d sent %d messages after bye; dropped",
                            w, len(msgs) - i)
                break
            if w in self.lost:
                break
            try:
                self._message(w, m)
            except wire.BadRequest as e:
                self._error(w, e.key, f"bad request from worker {w}: {e}")
            except Exception as e:  # noqa: BLE001 - one request must not end the loop
                # a request the checks let through and the server could not take: drop
                # that worker (its state may be half updated), serve the others
                log.error("rdmamw.ps: worker %d: request failed (%s: %s); dropping it",
                          w, type(e).__name__, e, exc_info=True)
                self.chans[w].close()
                self._lose(w, e)
        return True

    def stats(self) -> dict:
        s = dict(self.policy.stats)
        if self.scheduler is not None:
            s["dsana"] = {k: (dict(v) if isinstance(v, dict) else v)
                          for k, v in self.scheduler.stats.items()}
            s["dsana"]["shares"] = dict(self.scheduler.shares)
        s.update(version=self.policy.version, keys=len(self.model), lost=sorted(self.lost),
                 dropped_workers=self.dropped,
                 bytes_in=sum(p.bytes_in for p in self.peers.values()),
                 bytes_out=sum(p.bytes_out for p in self.peers.values()),
                 mode=self.consistency.mode, pull=self.pull, joined=list(self.joined),
                 one_sided_refused=0 if self.shard is None else self.shard.refused)
        return s

    def worker_metrics(self) -> dict[int, dict]:
        """Per worker: reported compute time, gradients received, bytes each way."""
        return {w: p.as_dict() for w, p in self.peers.items()}

    def close(self) -> None:
        for ch in self.chans.values():
            ch.close()

    # -- late joiners ----------------------------------------------------------------

    def _attach(self, w: int, ch: Channel) -> None:
        """A joiner's channel (see :meth:`admit`), in the loop from now on."""
        if w in self.chans and w not in self.lost and w not in self.bye:
            log.warning("rdmamw.ps: a second channel for live worker %d refused", w)
            ch.close()
            return
        if w in self.chans:
            self.chans[w].close()           # the lost (or finished) worker's
        else:
            self.n += 1                     # ASP and SSP scale by every worker's 1/n
            self.peers[w] = PeerMetrics()
        self.chans[w] = ch
        self.lost.discard(w)
        self.bye.discard(w)
        self.started.discard(w)
        self.joining[w] = self.policy.version
        self.staging[w], self.staged[w], self.backup[w] = {}, set(), {}
        self.expect[w] = None
        if self.shard is not None:
            self.shard.attach(w, self.model)
        log.warning("rdmamw.ps: worker %d is joining the running job (version %d)",
                    w, self.policy.version)

    def _join(self, w: int) -> None:
        """Joiner ``w``'s first read, at a round boundary: counted from now on (its
        read is then answered with the model as it is)."""
        self.policy.join(w)
        self.started.add(w)                 # out of the start barrier: it is past it
        self.joined.append({"worker": w, "version": self.policy.version,
                            "arrived": self.joining.pop(w), "clock": self.policy.clock[w]})
        log.warning("rdmamw.ps: worker %d joined at version %d", w, self.policy.version)

    def _not_joining(self, w: int, key: Any) -> None:
        if w in self.joining:
            raise wire.BadRequest(f"worker {w} pushed before it joined (its first pull, "
                                  f"answered at a round boundary, takes it in)", key=key)

    # -- messages -------------------------------------------------------------------

    def _message(self, w: int, m: Any) -> None:
        """One message of worker ``w``: a header (checked by wire.request), or the
        payload of the header before it; BadRequest for what does not fit."""
        hdr = self.expect[w]
        if hdr is not None:                        # the payload of the last header
            self.expect[w] = None
            with m:
                self.peers[w].bytes_in += len(m)
                if hdr is not _SKIP:               # its header was refused
                    self._payload(w, hdr, m)
            return
        try:
            h = wire.request(m)
        except wire.BadRequest as e:
            if e.payload:
                self.expect[w] = _SKIP
            raise
        finally:
            m.release()
        op = h["op"]
        if op in wire.WITH_PAYLOAD:
            self.expect[w] = h
        elif op == wire.SYNC:
            self._send(w, [wire.pack(wire.OK, id=h["id"], version=self.policy.version,
                                     **self._plan_of(w), **self._refs(w))])
        elif op == wire.CLOCK:
            self._gradient_done(w, h)
        elif op == wire.PULL:
            self.reads[w] = h
        elif op == wire.BYE:
            self.bye.add(w)
            self._forget(w)
            if "id" in h:               # acknowledged, so the worker's next messages wait
                self._send(w, [wire.pack(wire.OK, id=h["id"], version=self.policy.version)])

    def _payload(self, w: int, h: dict, m: Any) -> None:
        key, o = h["k"], h.get("o", 0)
        if len(m) % h["dt"].itemsize:
            raise wire.BadRequest(f"key {key!r}: a payload of {len(m)} bytes is not whole "
                                  f"{h['dt']} elements", key=key)
        if h["op"] == wire.INIT:
            self._init_block(w, h, m)
            return
        self._not_joining(w, key)
        cur = self.model.get(key)
        if cur is None:
            self._error(w, key, f"push of unknown key {key!r}")
            return
        if h["dt"] != cur.dtype:
            self._error(w, key, f"key {key!r}: pushed {h['dt']} but the server holds "
                                f"{cur.dtype} of shape {cur.shape}")
            return
        block = np.frombuffer(m, dtype=cur.dtype)
        if o + block.size > cur.size:
            self._error(w, key, f"key {key!r}: pushed {h['dt']} block [{o}:{o + block.size}] "
                                f"does not fit the server's {cur.dtype} of shape {cur.shape}")
            return
        e = o + block.size
        self._init_by.pop(key, None)
        if self.direct:
            bak = self.backup[w].get(key)
            with self.changing:
                self.opt.step(cur.reshape(-1)[o:e], self.velocity[key][o:e], block,
                              1.0 / self.n, None if bak is None else bak[o:e])
        else:
            st = self.staging[w].get(key)
            if st is None:                  # kept: a fresh model-sized array per push
                st = self.staging[w][key] = np.empty(cur.size, cur.dtype)  # page-faults
            st[o:e] = block
            self.staged[w].add(key)
        del block

    def _init_block(self, w: int, h: dict, m: Any) -> None:
        key, shape, dt = h["k"], h["shape"], h["dt"]
        cur = self.model.get(key)
        if cur is None and h.get("o", 0) == 0:
            try:
                cur = np.zeros(shape, dt)
            except (MemoryError, ValueError) as e:
                raise wire.BadRequest(f"key {key!r}: cannot hold {dt} {shape} ({e})",
                                      key=key) from None
            self.model[key] = cur
            self.velocity[key] = np.zeros(cur.size, dt)
            self.pending[key] = np.zeros(cur.size, dt)
            self._init_by[key] = w
            if self.shard is not None:
                self.shard.add(key, cur)
        if cur is None or cur.shape != shape or cur.dtype != dt:
            have = "nothing" if cur is None else f"{cur.dtype} {cur.shape}"
            self._error(w, key, f"key {key!r} initialised as {dt} {shape} but the server "
                                f"holds {have}")
            return
        o, n = h.get("o", 0), len(m) // dt.itemsize
        if o + n > cur.size:
            raise wire.BadRequest(f"key {key!r}: initial block [{o}:{o + n}] past its "
                                  f"{cur.size} elements", key=key)
        if w <= self._init_by.get(key, -1):    # the lowest worker index's values win
            self._init_by[key] = w
        elif self._init_rest.get(key) != w:     # not the values the key holds
            return
        block = np.frombuffer(m, dtype=dt)
        with self.changing:
            cur.reshape(-1)[o:o + block.size] = block
        del block
        if h.get("last"):
            self._init_rest.pop(key, None)
            self._init_since.pop(key, None)
        else:
            self._init_since[key] = time.monotonic()    # the last block seen
            self._init_rest[key] = w

    def _gradient_done(self, w: int, h: dict) -> None:
        """A worker's whole gradient for this shard is staged: let the model decide."""
        self._not_joining(w, None)
        self.peers[w].gradients += 1
        now = time.monotonic()
        n = h.get("n")
        if h.get("t") is not None:
            self.peers[w].compute.add(float(h["t"]))
            if isinstance(self.policy, Adaptive):
                self.policy.observe(w, self.peers[w].compute.ema)
            if self.scheduler is not None and n is not None:
                self.scheduler.observe(w, float(h["t"]), int(n), now)
        keys, self.staged[w] = self.staged[w], set()
        with self.changing:
            self._decide(w, h, keys, now)

    def _decide(self, w: int, h: dict, keys: set, now: float) -> None:
        """The model's decision on worker ``w``'s gradient of ``keys``, applied."""
        n = h.get("n")
        decision = self.policy.on_push(w, int(h.get("base", 0)), now,
                                       None if n is None else int(n))
        if decision == DROP or self.direct:        # direct: applied block by block already
            return
        weight = 1.0 if n is None else float(n)   # a round's mean is per sample
        if decision != APPLY:
            self._round_weight += weight
            self._flush(keys)
        for key in keys:
            g, bak = self.staging[w][key], self.backup[w].get(key)
            flat = self.model[key].reshape(-1)
            if decision == APPLY:
                self.opt.step(flat, self.velocity[key], g, 1.0 / self.n, bak)
            elif weight != 1.0 and self.opt.dc > 0 and bak is not None:
                t = np.zeros_like(g)        # weight the compensated gradient, not g
                self.opt.accumulate(t, g, flat, bak)
                t *= weight
                self.pending[key] += t
            else:
                if weight != 1.0:
                    g *= weight             # the staging buffer: rewritten by the next push
                self.opt.accumulate(self.pending[key], g, flat, bak)

    def _close_round(self, now: float) -> None:
        with self.changing:
            self._close(now)

    def _close(self, now: float) -> None:
        self._flush()
        done = self.policy.close(now)
        tr = observe.tracer                 # None unless rdmamw.trace records
        if tr is not None:
            self._trace_round(tr, done)
        if self.scheduler is not None:
            self.plan = self.scheduler.plan(now)
        if not done:
            return
        weight, self._round_weight = self._round_weight, 0.0
        for key, g in self.pending.items():
            if weight > 0:
                self._dirty[key] = 1.0 / weight
            else:
                g.fill(0)

    def _trace_round(self, tr: Any, done: list[int]) -> None:
        """The round that closed as a span of the timeline, from the last close (or
        from when the timeline started): the workers whose gradients it merged, the
        one whose gradient came last (``done`` is in arrival order: the worker the
        round waited for, unless its timeout closed it) and the live ones it left out
        (a straggler's, or ones not due in a bounded model)."""
        t0 = self._round_mark or tr.started
        live = sorted(getattr(self.policy, "live", ()))
        tr.span("round", "ps", t0, {"version": getattr(self.policy, "version", None),
                                    "merged": sorted(done),
                                    "last": done[-1] if done else None,
                                    "left_out": [w for w in live if w not in done]})
        self._round_mark = tr.clock()

    def _flush(self, keys: Sequence[Any] | set | None = None) -> None:
        """Apply the closed round's step to ``keys`` (None: all). The step is deferred
        from the close to the reply, key by key, so the first keys travel while the
        server is still stepping the next; it always happens within the same
        :meth:`serve_once`."""
        for key in list(self._dirty) if keys is None else [k for k in keys if k in self._dirty]:
            g = self.pending[key]
            with self.changing:
                self.opt.step(self.model[key].reshape(-1), self.velocity[key], g,
                              self._dirty.pop(key))
            g.fill(0)

    # -- replies --------------------------------------------------------------------

    def _answer_reads(self) -> None:
        starting = self._all_starting()
        for w in list(self.reads):
            if w in self.joining:
                if w in self.lost or not self.policy.boundary():
                    continue
                self._join(w)
            elif w in self.lost or not self.policy.can_read(w):
                continue
            elif self.reads[w].get("start") and not starting:
                continue
            if self._init_rest and self._hold_or_refuse(w):
                continue            # half of a key's initial values is not a value
            h = self.reads.pop(w)
            self._reply_pull(w, h)
        self._flush()

    def _hold_or_refuse(self, w: int) -> bool:
        """Whether worker ``w``'s deferred read is not to be answered now because a key
        it reads is still taking initial values: it waits; or, once those have stopped
        coming for ``init_timeout`` s (their worker is alive but stopped half way), it
        is refused here (an ERR: PSError on the reader's side) and dropped."""
        waiting = [k for k in self.reads[w]["keys"] if k in self._init_rest]
        if not waiting:
            return False
        now = time.monotonic()
        late = [k for k in waiting if now - self._init_since[k] > self.init_timeout]
        if not late:
            return True
        k = late[0]
        self.reads.pop(w)
        self._error(w, k, f"key {k!r}: worker {self._init_rest[k]} sent part of its initial "
                          f"values and nothing more for {now - self._init_since[k]:.1f} s; "
                          f"read refused (RDMAMW_PS_INIT_TIMEOUT {self.init_timeout:g} s)")
        return True

    def _all_starting(self) -> bool:
        """Every worker still here asks for its start values (``KVWorker.pull_start``):
        they are answered together, so none has pushed before all hold them."""
        here = set(self.chans) - self.lost - self.bye - set(self.joining) - self.started
        return all((self.reads.get(w) or {}).get("start") for w in here)

    def _reply_pull(self, w: int, h: dict) -> None:
        """The requested keys in the requested order, each sent as soon as its
        deferred step is applied (see :meth:`_flush`)."""
        ch = self.chans[w]
        for key in h["keys"]:
            if key not in self.model:
                self._error(w, key, f"pull of unknown key {key!r}")
                return
        for key in h["keys"]:
            self._flush([key])
            self._init_by.pop(key, None)    # what was read is the initial value
            cur = self.model[key]
            out: list = []
            if self.opt.dc > 0:             # what the worker computes its next gradient on
                bak = self.backup[w].get(key)
                if bak is None:
                    bak = self.backup[w][key] = np.empty(cur.size, cur.dtype)
                np.copyto(bak, cur.reshape(-1))
            last = cur.size
            for o, b in wire.blocks(cur.reshape(-1), ch.eager_limit):
                out.append(wire.pack(wire.VAL, k=key, o=o, last=o + b.size >= last))
                out.append(b)
                self.peers[w].bytes_out += b.nbytes
            if not self._send(w, out):
                return
        self._send(w, [wire.pack(wire.END, id=h["id"], version=self.policy.version,
                                 merged=self.policy.merged, **self._plan_of(w, True),
                                 **self._refs(w))])

    def _refs(self, w: int) -> dict:
        """Reply fields with the region references worker ``w`` has not had yet."""
        return {} if self.shard is None else self.shard.offer(w)

    def _plan_of(self, w: int, shares: bool = False) -> dict:
        """Header fields of DSANA's plan (none without a scheduler): ``plan`` =
        [offset, share, global batch] of worker ``w`` (share 0: not in the plan);
        ``shares``: every worker's share in index order (for reports)."""
        if self.scheduler is None:
            return {}
        off, share = self.plan.get(w, (0, 0))
        out: dict = {"plan": [off, share, self.scheduler.global_batch]}
        if shares:
            out["shares"] = [self.plan.get(v, (0, 0))[1] for v in sorted(self.chans)]
        return out

    def _error(self, w: int, key: Any, text: str) -> None:
        log.warning("rdmamw.ps: worker %d: %s", w, text)
        self._send(w, [wire.pack(wire.ERR, k=key, msg=text)])

    def _send(self, w: int, msgs: list) -> bool:
        """Send and wait (the model may change right after); False if ``w`` is gone.
        A worker that has not taken its replies within ``reply_timeout`` s (its ring
        stays full: it sends and never reads) is dropped, its channel closed."""
        t = self.reply_timeout
        deadline = time.monotonic() + t
        try:
            self.chans[w].send_batch(msgs, timeout=t).wait(
                max(0.0, deadline - time.monotonic()))
            return True
        except (PeerLost, ChannelClosed) as e:
            self._lose(w, e)
        except Timeout:
            self.dropped += 1
            self.chans[w].close()
            self._lose(w, None, f"rdmamw.ps: worker %d has not taken its replies for "
                                f"RDMAMW_PS_REPLY_TIMEOUT {t:g} s; dropped, serving the others")
        return False

    def _lose(self, w: int, e: Exception | None,
              why: str = "rdmamw.ps: worker %d lost (%s); serving the others") -> None:
        if w in self.lost or w in self.bye:
            return
        log.warning(why, w, *(() if e is None else (e,)))
        self.lost.add(w)
        self._forget(w)
        for hook in self.on_lost:
            hook(w)

    def _forget(self, w: int) -> None:
        self.policy.lost(w)
        self.joining.pop(w, None)
        for key in [k for k, v in self._init_rest.items() if v == w]:
            del self._init_rest[key]        # its values will not finish: stop waiting
            self._init_since.pop(key, None)
        if self.scheduler is not None:
            self.scheduler.lost(w)
        self.reads.pop(w, None)
        self.staging[w], self.staged[w], self.backup[w] = {}, set(), {}
        if self.shard is not None:
            self.shard.forget(w)
