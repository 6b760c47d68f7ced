"""The Communicator: one channel per peer pair, opened lazily, and the two transfer
primitives every algorithm is written with (``exchange`` and ``relay``).

Why no per-chunk tags: a channel is FIFO and every rank runs the same collectives in
the same order (as in MPI and NCCL), so the k-th message on a channel belongs to a
known collective and chunk. What guards that assumption is the header round each
collective starts with (:meth:`Communicator.agree`): every rank learns the smallest
and largest header in the job, so a rank that calls a different collective, shape,
dtype or op makes *every* rank raise :class:`CollectiveMismatch` before any data moves.
Messages a fast peer already sent for the next collective wait in a per-peer queue.

Why steps: the transfer primitives and the algorithms built on them are generators
that yield the channel operations they need (:data:`SEND`, :data:`RECV`, :data:`INTO`,
:data:`WAIT`); rdmamw.aio.collectives awaits them, so both run one copy of every
schedule. In blocking mode (:meth:`Communicator.drive`) a schedule performs each step
where it stands, with a blocking call, instead of yielding it (as fast as before).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import GeneratorType
from typing import Any

import msgpack
import numpy as np

from rdmamw import config, observe
from rdmamw.channel import Channel, Message
from rdmamw.collectives import grow, revoke, survivors
from rdmamw.collectives._kernels import Copier
from rdmamw.collectives.waits import INTO, RECV, SEND, WAIT, Waits
from rdmamw.errors import (
    BufferTooSmall,
    ChannelClosed,
    PeerLost,
    PeerNotFound,
    ProtocolError,
    RdmamwError,
    Timeout,
)
from rdmamw.steps import Steps

# Chunks (docs/collectives.md, "Chunking and pipelining"): up to RDMAMW_COLL_CHUNK
# (4 MiB) on channels with rendezvous, else the eager limit (the collectives' rings are
# 16 x 1 MiB). Large chunks cut the per-chunk Python cost and the wake-ups of big
# arrays: a 64 MiB allreduce at 2 ranks on shm took 8.3 ms of CPU per call with 4 MiB
# chunks (copies received in place) against 10.5 ms with 1 MiB ones (bench/ab.py
# --allreduce 64M, docs/benchmarks/collectives.md).
# RDMAMW_COLL_PIECES: chunks a transfer is cut into below max_chunk. 1 (default): on
# shm a 1 MiB allreduce at 2 ranks took 0.19-0.22 ms whole vs 0.31 ms in quarters
# (per-chunk Python cost beats the overlap at that size); above max_chunk transfers
# are pipelined anyway.
MAGIC = "rdmamw-coll-1"

OnChunk = Callable[[int, int, np.ndarray], Any]



class CollectiveMismatch(RdmamwError, ValueError):
    """Ranks called a collective with different arguments (kind, shape, dtype, op,
    root or algorithm). Raised on every rank; the channels stay usable."""


class Communicator:
    """The ranks of :func:`rdmamw.init` as a group for collectives.

    Channels are opened on first use, one per peer pair, in ascending rank order
    (deadlock-free: see :meth:`ensure`). Collectives on one communicator run one at a
    time and must be called in the same order on every rank; use several
    communicators for independent streams of collectives.

    Each collective has a deadline: ``timeout`` (default RDMAMW_COLL_TIMEOUT), or the
    call's own ``timeout=``. When a member sees a peer lost, or waits past the
    deadline, the communicator is revoked (rdmamw.collectives.revoke): every member
    raises :class:`~rdmamw.errors.PeerLost` or :class:`~rdmamw.errors.Timeout` naming
    the failed rank (``.rank``), whether or not it talked to it; it is then broken and
    every later call raises. :func:`rdmamw.collectives.shrink` then gives the
    survivors a communicator of their own.

    ``members``: the world ranks of the group, in the order of their ranks here (the
    survivors of a shrink); default every rank of ``world``."""

    def __init__(self, world: Any = None, *, topology: Any = None,
                 timeout: float | None = None, window: int | None = None,
                 slots: int | None = None, slot_size: int | None = None,
                 members: Iterable[int] | None = None) -> None:
        if world is None:
            import rdmamw
            world = rdmamw.init()
        self.world = world
        #: rank here -> rank in the world
        self.members: list[int] = list(range(world.world_size)) if members is None \
            else list(members)
        if world.rank not in self.members or len(set(self.members)) != len(self.members):
            raise ValueError(f"members {self.members} must name each rank once, this one "
                             f"({world.rank}) among them")
        self.rank: int = self.members.index(world.rank)
        self.size: int = len(self.members)
        self.timeout: float = config.get("RDMAMW_COLL_TIMEOUT") if timeout is None else timeout
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, not {timeout!r}")
        #: the deadline of the collective running now and its waits (rdmamw.collectives
        #: .waits); begin/left/now/failure are its methods
        self.waits = Waits(self)
        self.begin, self.left = self.waits.begin, self.waits.left
        self.now, self.failure = self.waits.now, self.waits.failure
        self._notice = self.waits.notice
        slots = config.get("RDMAMW_COLL_SLOTS") if slots is None else slots
        self.slots = slots
        self.slot_size = config.get("RDMAMW_COLL_SLOT_SIZE") if slot_size is None else slot_size
        self.min_chunk = config.get("RDMAMW_COLL_MIN_CHUNK")
        #: largest chunk on channels that move big messages by rendezvous (the others
        #: stop at their eager limit); the header round agrees on the job's smallest
        self.chunk = config.get("RDMAMW_COLL_CHUNK")
        #: what our channels' waits spin before they sleep (None: RDMAMW_SPIN_US)
        self.spin_us = spin_for(world)
        self.pieces = config.get("RDMAMW_COLL_PIECES")
        #: chunks a rank may send ahead of what it received in one exchange; below a
        #: quarter of the ring so pairwise and ring exchanges can never fill it
        self.window = window or max(1, min(16, slots // 4))
        self.topology_spec = topology
        from rdmamw.collectives import policy
        #: the tuned cost model (policy.load()); replace it to steer "auto"
        self.model = policy.load()
        #: "auto"'s answers per size (policy.Choices: the cost model is O(ranks))
        self.choices = policy.Choices()
        #: group id per rank, resolved on first use by rdmamw.collectives.api.groups
        self.group_ids: list[int] | None = None
        self._chans: dict[int, Channel] = {}
        self._queues: dict[int, collections.deque[Message]] = {}
        #: the last send of the running collective per peer (see :meth:`_settle`)
        self._sent: dict[int, Any] = {}
        self._lock = threading.RLock()
        self._close_lock = threading.Lock()
        self.max_chunk = min(self.slot_size, self.chunk)
        #: the largest chunk our channels take (what the header round offers): kept as
        #: channels open rather than recomputed over all of them by every collective
        self._cap = self.chunk
        #: whether the header round's channels (dissemination_peers) are all open
        self._header_open = False
        self.seq = 0
        #: the last collective this member finished (its goodbye says it: a member
        #: still in that one goes on, revoke.py)
        self.done = 0
        self.broken: BaseException | None = None
        #: world ranks this member saw fail (what shrink() starts from)
        self.failed: set[int] = set()
        self._progress: Any = None          # progress.Progress, on the first async call
        #: schedules perform their steps at once (:meth:`drive`); rdmamw.aio.collectives
        #: clears it while it awaits them
        self.blocking = True

    # ---- channels --------------------------------------------------------------------

    def ensure(self, peers: Iterable[int]) -> None:
        """Open the missing channels to ``peers`` in ascending rank order.

        Each pair is opened when both ranks need it; since each rank walks its peers in
        ascending order, a chain of ranks each waiting for the next would need ever
        smaller ranks, so no cycle (deadlock) can form."""
        for p in sorted(set(peers) - {self.rank} - set(self._chans)):
            # chunks up to the eager limit are copied through the ring (no read back,
            # no wait for it at the end: less latency); larger ones go by rendezvous
            try:
                ch = Channel.open(self.members[p], timeout=self.left(), slots=self.slots,
                                  slot_size=self.slot_size, world=self.world,
                                  rndv_threshold=self.slot_size, spin_us=self.spin_us)
            except (PeerLost, PeerNotFound, ChannelClosed, Timeout) as e:
                raise unopened(e, p, self.seq) from e
            self._chans[p] = ch
            self._queues[p] = collections.deque()
            self._cap = min(self._cap, chunk_limit(ch, self.chunk))

    def channel(self, peer: int) -> Channel:
        """The open channel to ``peer`` (KeyError before :meth:`ensure` opened it)."""
        return self._chans[peer]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the communicator for one collective driven from outside (an event
        loop): RdmamwError, instead of waiting, while its progress thread still runs
        ``async_op`` collectives or another thread runs one."""
        if self._progress is not None and self._progress.busy():
            raise RdmamwError("the communicator still runs async_op collectives on its "
                              "thread; wait for their handles before awaiting one")
        if not self._lock.acquire(blocking=False):
            raise RdmamwError("the communicator runs a collective in another thread; "
                              "use one communicator per thread or loop")
        try:
            yield
        finally:
            self._lock.release()

    def chunk_elems(self, itemsize: int, n: int) -> int:
        """Elements per message of an ``n``-element transfer (both ends compute the
        same): a RDMAMW_COLL_PIECES-th of it (default: all of it), so a transfer
        larger than ``max_chunk`` is a pipeline of chunks; at least
        RDMAMW_COLL_MIN_CHUNK bytes (per-message overhead) and at most ``max_chunk``,
        the smallest eager limit of any channel of any rank (agreed in the header
        round: a channel accepted through init()'s tcp listener has that listener's
        ring)."""
        lo, hi = max(1, self.min_chunk // itemsize), max(1, self.max_chunk // itemsize)
        return min(hi, max(lo, -(-n // self.pieces)))

    @property
    def deadline(self) -> float:
        """time.monotonic() deadline of the collective running now (0: none runs)."""
        return self.waits.deadline

    @deadline.setter
    def deadline(self, value: float) -> None:
        self.waits.deadline = value

    def drive(self, steps: Steps) -> Any:
        """Run a schedule with blocking calls (each waits up to ``timeout``); its result.

        In this (the default) mode a schedule performs each step where it stands
        (:meth:`now`) instead of yielding it: no trip up and down the generators per
        step, so the blocking collectives cost what they did before schedules were
        generators. An awaiting driver clears ``blocking`` while it runs."""
        try:
            steps.send(None)
        except StopIteration as e:
            return e.value
        raise RuntimeError("a schedule yielded a step in blocking mode")

    def _settle(self) -> Steps:
        """Wait until every peer has taken what this collective sent it.

        A chunk above the eager limit goes by rendezvous: the peer reads it from our
        memory when it gets to it, which can be after we received everything we
        needed. Returning earlier would let the caller overwrite (the next backward
        pass into the same gradients) data a slower rank has yet to read. A channel's
        sends complete in order, so its last handle covers the others."""
        sent, self._sent = self._sent, {}
        for peer, h in sent.items():
            if self.blocking:
                self.now(WAIT, peer, h)
            else:
                yield (WAIT, peer, h)

    def recv(self, peer: int) -> Steps:
        """The next message from ``peer`` (queued ones first).

        One message per call: a rendezvous chunk is read when it is taken, so the next
        one can still go straight into its destination (:meth:`_take`)."""
        q = self._queues[peer]
        while True:         # (recv_raw inline: one generator less per message)
            if not q:
                q.extend(self.now(RECV, peer, None) if self.blocking
                         else (yield (RECV, peer, None)))
            m = q.popleft()
            if len(m) != revoke.NOTICE_LEN or not self._notice(m, peer):
                return m

    def recv_raw(self, peer: int) -> Steps:
        """The next message from ``peer``, a notice or not."""
        q = self._queues[peer]
        if not q:
            q.extend(self.now(RECV, peer, None) if self.blocking
                     else (yield (RECV, peer, None)))
        return q.popleft()

    # ---- transfer primitives ---------------------------------------------------------

    def exchange(self, to: int | None, src: np.ndarray | None, frm: int | None,
                 nrecv: int, on_chunk: OnChunk | None, dtype: np.dtype) -> None:
        """:meth:`exchange_steps` with blocking calls (inside :meth:`run`'s body)."""
        self.drive(self.exchange_steps(to, src, frm, nrecv, on_chunk, dtype))

    def exchange_steps(self, to: int | None, src: np.ndarray | None, frm: int | None,
                       nrecv: int, on_chunk: OnChunk | None, dtype: np.dtype) -> Steps:
        """Send ``src`` to ``to`` while receiving ``nrecv`` elements from ``frm``,
        chunked to the eager limit; ``on_chunk(start, stop, view)`` consumes each
        received chunk straight from the ring.

        Sends run at most ``window`` chunks ahead of receives, so the peer always has
        data to reduce while we reduce ours (the pipeline), and a ring or a pair of
        ranks that both send first can never fill each other's rings (no deadlock)."""
        chunks = []
        if to is not None and src is not None:
            c = self.chunk_elems(dtype.itemsize, len(src))
            chunks = [src[i:i + c] for i in range(0, len(src), c)]
        c = self.chunk_elems(dtype.itemsize, nrecv)
        nr = 0 if frm is None else -(-nrecv // c)
        s = r = 0
        while s < len(chunks) or r < nr:
            limit = len(chunks) if r >= nr else min(len(chunks), r + self.window)
            if s < limit:
                step = (SEND, to, chunks[s:limit])
                self._sent[to] = self.now(*step) if self.blocking else (yield step)
                s = limit
            if r < nr:
                yield from self._take(frm, r * c, min(nrecv, (r + 1) * c), on_chunk, dtype)
                r += 1

    def relay_steps(self, frm: int | None, tos: list[int], src: np.ndarray, n: int,
                    on_chunk: OnChunk | None, dtype: np.dtype) -> Steps:
        """Chunk by chunk: receive from ``frm`` (if any) into ``on_chunk``, then send
        that chunk of ``src`` to each of ``tos``: pipelined chains and trees."""
        c = self.chunk_elems(dtype.itemsize, n)
        for start in range(0, n, c):
            stop = min(n, start + c)
            if frm is not None:
                yield from self._take(frm, start, stop, on_chunk, dtype)
            for t in tos:
                step = (SEND, t, [src[start:stop]])
                self._sent[t] = self.now(*step) if self.blocking else (yield step)

    def _take(self, frm: int, start: int, stop: int, on_chunk: OnChunk | None,
              dtype: np.dtype) -> Steps:
        want = (stop - start) * dtype.itemsize
        dest = on_chunk.into(start, stop) if isinstance(on_chunk, Copier) else None
        if dest is not None and not self._queues[frm]:
            # the next message from ``frm`` straight into ``dest``
            while True:
                try:
                    got = self.now(INTO, frm, dest) if self.blocking \
                        else (yield (INTO, frm, dest))
                except BufferTooSmall as e:
                    if e.needed != revoke.NOTICE_LEN:
                        raise self._wrong_length(frm, e.needed, want) from e
                    # a notice? (it stays receivable): a WAITING one is taken, a final
                    # one raises
                    m = yield from self.recv_raw(frm)
                    if self._notice(m, frm):
                        continue
                    m.release()
                    raise self._wrong_length(frm, e.needed, want) from e
                if got != revoke.NOTICE_LEN or not self._notice(
                        memoryview(dest).cast("B")[:got], frm):
                    break
            if got != want:
                raise self._wrong_length(frm, got, want)
            return
        m = yield from self.recv(frm)
        if len(m) != want:
            m.release()
            raise self._wrong_length(frm, len(m), want)
        a = np.frombuffer(m, dtype)
        try:
            if on_chunk is not None:
                on_chunk(start, stop, a)
        finally:
            del a
            m.release()

    def _wrong_length(self, frm: int, got: int, want: int) -> RdmamwError:
        return RdmamwError(f"collective #{self.seq}: rank {frm} sent {got} bytes where "
                           f"{want} were due (collectives called out of order?)")

    # ---- one collective --------------------------------------------------------------

    def run(self, header: list, peers: Iterable[int], body: Callable[[], Any],
            timeout: float | None = None) -> Any:
        """Run one collective: open channels, agree on ``header``, then ``body``: a
        function returning the result, or a schedule (a generator of steps, see
        :data:`SEND`) returning it; only schedules can also be awaited
        (rdmamw.aio.collectives).

        A lost peer (or any failure past the header) breaks the communicator and
        closes its channels, so ranks waiting on us see it too instead of hanging."""
        watch = observe.collective          # None unless rdmamw.metrics records
        t0 = time.perf_counter() if watch is not None else 0.0
        tr = observe.tracer                 # None unless rdmamw.trace records
        with self._lock, self.guard(header):
            t1 = tr.clock() if tr is not None else 0
            self.begin(timeout)
            try:
                missing = self.missing(peers)
                if missing:
                    self.ensure(missing)
                    if tr is not None:
                        tr.span("connect", "channel", t1,
                                {"peers": [self.members[p] for p in missing]})
                return self.drive(self.steps(header, body))
            finally:
                self.deadline = 0.0
                if watch is not None:
                    watch(header[0], time.perf_counter() - t0)
                if tr is not None:
                    tr.collective(header, self.seq, [self.members[p] for p in peers], t1)

    def needs(self, peers: Iterable[int]) -> set[int]:
        """The peers a collective with ``peers`` needs channels to (the header round's too)."""
        return set(peers) | set(self.dissemination_peers())

    def missing(self, peers: Iterable[int]) -> list[int]:
        """Those of :meth:`needs` without a channel yet, in ascending order. Once the
        header round's channels are open it checks only ``peers`` (no set of every
        channel per call: O(peers), not O(ranks))."""
        chans, me = self._chans, self.rank
        if self._header_open and all(p in chans or p == me for p in peers):
            return []
        out = sorted(self.needs(peers) - set(chans) - {me})
        if not out:
            self._header_open = True
        return out

    def steps(self, header: list, body: Callable[[], Any]) -> Steps:
        """One collective past its channels: the header round, ``body``, the settling."""
        yield from self.agree([self.seq, *header])
        out = body()
        if type(out) is GeneratorType:
            out = yield from out
        yield from self._settle()
        return out

    def guard(self, header: list) -> _Guard:
        """Number one collective and turn its failures into the communicator's state
        (``with comm.guard(header): ...``): a mismatch leaves it usable, anything else
        (a lost peer, a cancelled await) breaks it."""
        if self.broken is not None:
            raise RdmamwError(f"communicator is broken by an earlier failure: "
                              f"{self.broken!r}")
        self.seq += 1
        return _Guard(self, header[0])

    def call(self, header: list, peers: Iterable[int], body: Callable[[], Any],
             async_op: bool = False, timeout: float | None = None) -> Any:
        """:meth:`run` now (returns ``body()``'s value), or with ``async_op`` on this
        communicator's progress thread (returns a progress.Handle). Calls keep their
        order either way: a blocking call queues behind pending asynchronous ones."""
        if async_op or (self._progress is not None and self._progress.busy()):
            if self._progress is None:
                from rdmamw.collectives.progress import Progress
                self._progress = Progress(f"rdmamw-coll-{self.rank}")
            h = self._progress.submit(lambda: self.run(header, peers, body, timeout))
            return h if async_op else h.wait()
        return self.run(header, peers, body, timeout)

    def shrink(self, timeout: float | None = None) -> Communicator:
        """The survivors' communicator, agreed by all of them (every survivor calls
        it; rdmamw.collectives.survivors)."""
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        if not self.broken:
            self._break(RdmamwError("shrunk"))      # its channels go: shrink starts afresh
        alive = survivors.agree(self.world, self.members, self.failed, end)
        depart = getattr(self.world, "depart", None)
        if depart is not None:              # rank 0's store lets them re-join
            depart(set(self.members) - set(alive))
        return self._like(alive)

    def grow(self, ranks: Iterable[int] | None = None,
             timeout: float | None = None) -> Communicator:
        """This communicator with re-joined ranks back (default: every world rank not
        in it), agreed by all of them; the new processes call :meth:`join`
        (rdmamw.collectives.grow)."""
        return self._like(grow.grow(self, ranks, timeout))

    @classmethod
    def join(cls, world: Any = None, members: Iterable[int] | None = None,
             timeout: float | None = None, **options: Any) -> Communicator:
        """On a re-joined process: the communicator the members' :meth:`grow` makes
        (``members``: its world ranks, default all)."""
        if world is None:
            import rdmamw
            world = rdmamw.init()
        t = config.get("RDMAMW_COLL_TIMEOUT") if timeout is None else timeout
        alive = grow.join(world, members, time.monotonic() + t)
        return cls(world, timeout=timeout, members=alive, **options)

    def _like(self, members: list[int]) -> Communicator:
        """A communicator of ``members`` with this one's options."""
        return type(self)(self.world, topology=self.topology_spec, timeout=self.timeout,
                          window=self.window, slots=self.slots, slot_size=self.slot_size,
                          members=members)

    def _break(self, e: BaseException) -> None:
        """Broken by ``e``: revoke (a notice naming the failed rank to every channel,
        when ``e`` names one), then close the channels: on a thread of its own after a
        revoke, so that the error is raised at once (a tcp channel to a stopped rank
        waits up to 2 s for it to take our close)."""
        self.broken = e
        self._sent.clear()
        rank = getattr(e, "rank", None)
        if rank is None:
            self.close()
            return
        self.failed.add(self.members[rank])
        kind = revoke.NO_PROGRESS if isinstance(e, Timeout) else revoke.LOST
        revoke.send_all([ch for p, ch in self._chans.items() if p != rank],
                        revoke.notice(kind, rank, getattr(e, "reporter", self.rank),
                                      self.seq))
        threading.Thread(target=self.close, name=f"rdmamw-coll-close-{self.rank}",
                         daemon=True).start()

    def dissemination_peers(self) -> list[int]:
        n, k, out = self.size, 1, []
        while k < n:
            out += [(self.rank + k) % n, (self.rank - k) % n]
            k *= 2
        return out

    def agree(self, header: list) -> Steps:
        """Dissemination min/max of every rank's header (ceil(log2 n) rounds, any n).

        Afterwards each rank holds the smallest and largest header and their ranks:
        equal means everyone agrees; otherwise all raise the same clear error. It is
        also a barrier: nobody leaves before every rank has arrived."""
        lo = hi = [header, self.rank]
        lo_key = hi_key = _order(lo)
        cap = self._cap
        k, n = 1, self.size
        while k < n:
            to, frm = (self.rank + k) % n, (self.rank - k) % n
            step = (SEND, to, [msgpack.packb([MAGIC, lo, hi, cap])])
            self._sent[to] = self.now(*step) if self.blocking else (yield step)
            m = yield from self.recv(frm)
            try:
                magic, olo, ohi, ocap = msgpack.unpackb(bytes(m))
            except Exception as e:  # noqa: BLE001 - anything malformed is the same error
                raise RdmamwError(f"collective #{self.seq}: rank {frm} sent data where a "
                                  f"header was due (collectives called out of order?)") from e
            finally:
                m.release()
            if magic != MAGIC:
                raise RdmamwError(f"collective #{self.seq}: bad header from rank {frm}")
            olo_key, ohi_key = self._checked(frm, olo, ohi, ocap, len(header))
            if olo_key < lo_key:
                lo, lo_key = olo, olo_key
            if ohi_key > hi_key:
                hi, hi_key = ohi, ohi_key
            cap = min(cap, ocap)
            k *= 2
        self.max_chunk = cap
        if lo[0] != hi[0]:
            raise CollectiveMismatch(
                f"collective #{lo[0][0]}: rank {lo[1]} called {describe(lo[0])} but rank "
                f"{hi[1]} called {describe(hi[0])}")

    def _checked(self, frm: int, lo: Any, hi: Any, cap: Any, fields: int) -> tuple:
        """The order keys of a peer's smallest and largest header, once each is
        ``[header, rank]`` with the header's fields of the types every rank sends
        (:func:`describe`'s) and ``cap`` a chunk size; else ProtocolError."""
        keys = []
        for entry in (lo, hi):
            if not _well_formed(entry, fields, self.size):
                raise ProtocolError(f"collective #{self.seq}: rank {frm} sent a malformed "
                                    f"header {entry!r:.120}")
            keys.append(_order(entry))
        if type(cap) is not int or not 1 <= cap <= 1 << 62:
            raise ProtocolError(f"collective #{self.seq}: rank {frm} sent a malformed header "
                                f"(chunk {cap!r:.40})")
        return tuple(keys)

    def close(self, linger: float = 5.0) -> None:
        """Close every channel; the communicator is done.

        Unless broken, it first trades a goodbye with each peer (waiting up to
        ``linger`` s in all): a tcp socket closed while the peer still has our data in
        flight can be reset and lose it, so we leave only once each peer has finished."""
        with self._close_lock:          # (a revoke's close may run on its own thread)
            self._close(linger)

    def _close(self, linger: float) -> None:
        if self._progress is not None:
            self._progress.stop(linger)
            self._progress = None
        if self.broken is None and self._chans:
            self._goodbye(linger)
        for q in self._queues.values():
            for m in q:
                m.release()
            q.clear()
        for ch in self._chans.values():
            ch.close()
        self._chans.clear()
        if self.broken is None:
            self.broken = ChannelClosed("communicator closed")

    def _goodbye(self, linger: float) -> None:
        """A LEFT notice to each peer, then each peer's: one still in a collective
        takes ours for what it is (PeerLost naming this rank, revoke.py)."""
        end = time.monotonic() + linger
        bye = revoke.notice(revoke.LEFT, self.rank, self.rank, self.done)
        for ch in self._chans.values():
            try:
                ch.send_batch([bye], timeout=max(0.0, end - time.monotonic()))
            except RdmamwError:
                pass
        for p, ch in self._chans.items():
            q = self._queues[p]
            try:
                while True:
                    m = q.popleft() if q else ch.recv(timeout=max(0.0, end - time.monotonic()))
                    if revoke.left(m, self.size) == p:
                        break
            except RdmamwError:
                pass

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Guard:
    """:meth:`Communicator.guard`'s context (a class: cheaper than a generator's)."""

    __slots__ = ("comm", "kind")

    def __init__(self, comm: Communicator, kind: str) -> None:
        self.comm, self.kind = comm, kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, e: Any, tb: Any) -> bool:
        comm = self.comm
        if e is None:
            comm.done = comm.seq
            return False
        if isinstance(e, CollectiveMismatch):
            comm._sent.clear()
            comm.done = comm.seq
            return False
        comm._break(e)
        if getattr(e, "rank", None) is not None:
            return False            # named already (Communicator.failure, a notice)
        what = f"collective #{comm.seq} ({self.kind})"
        if isinstance(e, ChannelClosed):
            raise PeerLost(f"{what}: {e}; it left mid-collective (it lost a rank or "
                           f"aborted)") from e
        if isinstance(e, PeerLost):
            raise PeerLost(f"{what}: {e}") from e
        return False


def name_peer(e: BaseException, peer: int) -> BaseException:
    """PeerLost / ChannelClosed of a channel, naming the rank at its other end."""
    if isinstance(e, (PeerLost, ChannelClosed)):
        named = type(e)(f"rank {peer}: {e}")
        named.__cause__ = e
        return named
    return e


def unopened(e: BaseException, peer: int, seq: int) -> RdmamwError:
    """A channel to ``peer`` that did not open, as the collective's failure naming it
    (``.rank``): a member that died after it was agreed on (a shrink's) is lost."""
    kind = Timeout if isinstance(e, Timeout) else PeerLost
    named = kind(f"collective #{seq}: rank {peer}: its channel did not open: {e}")
    named.rank = peer                   # type: ignore[attr-defined]
    return named


def spin_for(world: Any) -> float | None:
    """RDMAMW_COLL_SPIN_US, else 0 when this host runs more of the job's ranks than it
    has CPUs (a rank spinning for a peer that waits for its core only delays it; as
    MPI libraries yield when oversubscribed), else None: the channels' default
    (docs/collectives.md, "Waiting")."""
    spin = config.get("RDMAMW_COLL_SPIN_US")
    if spin is not None:
        return spin
    host = world.peers.get(world.rank, {}).get("host")
    here = sum(1 for d in world.peers.values() if host is not None and d.get("host") == host)
    # (a shrunk group's survivors spin as the world's ranks did: a dead rank's CPU
    # comes back, which only makes the choice conservative)
    return 0.0 if here > (os.cpu_count() or 1) else None


def chunk_limit(ch: Channel, chunk: int) -> int:
    """The largest chunk ``ch`` should carry: ``chunk`` when it has rendezvous (and the
    peer takes messages that large), else its eager limit."""
    if ch.rendezvous == "off":
        return ch.eager_limit
    return min(chunk, ch.peer_max_message_size or chunk)


#: the types of a header's fields: [seq, kind, dtype, shape, op, root, algorithm]
_FIELD_TYPES = (int, str, str, list, str, int, str)


def _well_formed(entry: Any, fields: int, size: int) -> bool:
    """Whether ``entry`` is ``[header, rank]`` as a rank sends it: ``fields`` fields
    of :data:`_FIELD_TYPES`, the shape a list of sizes (or ``"*"``), a rank of the job."""
    if not (type(entry) is list and len(entry) == 2):
        return False
    h, rank = entry
    return (type(h) is list and len(h) == fields == len(_FIELD_TYPES)
            and all(type(v) is t for v, t in zip(h, _FIELD_TYPES, strict=True))
            and all(type(d) is int or d == "*" for d in h[3])
            and type(rank) is int and 0 <= rank < size)


def _order(entry: list) -> tuple:
    """The order of well-formed ``[header, rank]`` entries: the lists' own, except that
    a shape's ``"*"`` (an uneven alltoall) sorts after every size instead of raising
    TypeError against one (``["*", 4]`` against ``[8, 4]``)."""
    h, rank = entry
    shape = tuple((1, 0) if d == "*" else (0, d) for d in h[3])
    return (*h[:3], shape, *h[4:], rank)


def describe(h: list) -> str:
    """A header as the user wrote the call: ``allreduce(float32[1000], op=sum, ...)``."""
    _seq, kind, dtype, shape, op, root, alg = h
    shape_s = "x".join(str(d) for d in shape) if shape else "scalar"
    parts = [f"{dtype}[{shape_s}]"]
    if op:
        parts.append(f"op={op}")
    if root >= 0:
        parts.append(f"root={root}")
    if alg:
        parts.append(f"algorithm={alg}")
    return f"{kind}({', '.join(parts)})"
