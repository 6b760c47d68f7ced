# cython: freethreading_compatible = False
"""The batch engine: one channel endpoint, orchestrating the units that own its state.

A batch of messages becomes ONE chained list of work requests handed to the provider
(one doorbell): the slot writes, then the arrival-bitmap words that changed, last; only
the last request is signaled. Receiving scans the arrival bitmap word-at-a-time,
checks each slot's sequence number and hands out zero-copy Message views; releases
flip reclaim bits locally and are written back lazily, in batches. The wire format is
in docs/protocol.md; who owns what in rdmamw/engine/__init__.py.

The engine itself holds only the locks (one sender and one receiver at a time) and
the calls users make: send_batch / recv_batch / close; its waits are the Waiter's
(_waits.pyx), and each unit writes only its own fields. The
data path runs with the GIL released and allocates no Python object per message on
the send side; on the receive side a Message (from a free list) is the view the user
asked for."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport PyThread_get_thread_ident
from cpython.object cimport Py_SIZE
from libc.stdint cimport int64_t, uint32_t, uint64_t
from posix.mman cimport (
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_PRIVATE,
    mmap,
    PROT_READ,
    PROT_WRITE,
)

from rdmamw.engine._batch cimport Packed, SendBatch
from rdmamw.engine._calllock cimport give, take_until, try_take
from rdmamw.engine._eager_recv cimport EagerReceiver
from rdmamw.engine._eager_send cimport EagerSender
from rdmamw.engine._frames cimport (
    CTRL_MAX_MSG,
    RM_MAX_WR_BYTES,
    WAIT_ARRIVAL,
    WAIT_DONE,
)
from rdmamw.engine._link cimport Link, deadline_of, slice_end, trace_state
from rdmamw.engine._messages cimport (
    Dest,
    Endpoint,
    Message,
    SendHandle,
    new_dest,
    new_handle,
    take_eager,
    take_one,
)
from rdmamw.engine._rndv_recv cimport RndvReceiver
from rdmamw.engine._rndv_send cimport RndvSender
from rdmamw.engine._trace cimport (
    TR_ARRIVAL_WAIT,
    TR_BATCH,
    TR_BATCH_ONE,
    TR_COMPLETED,
    TR_CREDIT_WAIT,
    TR_DOORBELL,
    TR_READ_WAIT,
    TR_RNDV_DONE,
    TR_RNDV_EXPOSE,
    TR_RNDV_RECV,
    TR_SLEEP,
    rm_trace,
    rm_trace_claimed,
    rm_trace_copy,
    rm_trace_ready,
    rm_trace_rec,
    rm_trace_switch,
)
from rdmamw.engine._waits cimport Waiter
from rdmamw.transport._base cimport (
    RM_ERR_LATE,
    RM_REGION_ARRIVAL,
    RM_REGION_RECLAIM,
    Transport,
    now_ns,
)
from rdmamw.transport.atomics cimport rm_cpu_relax, rm_load_acquire64

from rdmamw.errors import ChannelClosed, ProtocolError, Timeout
from rdmamw.transport import layout
from rdmamw.vocabulary import RNDV_STRATEGIES, check_mode, check_rendezvous

cdef uint64_t NOGIL_BYTES = 16384       # batches from this size on copy without the GIL
cdef int64_t GIL_SPIN_NS = 3000         # a receive polls this long before releasing the GIL
cdef int64_t CLOSE_RNDV_NS = 5000000000 # close() waits this long for pending READs
cdef int64_t CLOSE_LOCK_NS = 2000000000  # ... and this long for a running call to end
cdef int64_t CLOSE_POST_NS = 500000000  # close()'s last words wait this long for the peer


#: the kinds of the timeline's records of the compiled path (rdmamw/engine/_trace.pxd)
TRACE_KINDS = {"batch": TR_BATCH, "doorbell": TR_DOORBELL, "completed": TR_COMPLETED,
               "credit wait": TR_CREDIT_WAIT, "arrival wait": TR_ARRIVAL_WAIT,
               "sleep": TR_SLEEP, "rndv expose": TR_RNDV_EXPOSE, "rndv done": TR_RNDV_DONE,
               "rndv recv": TR_RNDV_RECV, "read wait": TR_READ_WAIT,
               "batch one": TR_BATCH_ONE}
#: the bytes of one record (rm_trace_rec)
TRACE_RECORD_BYTES = sizeof(rm_trace_rec)
cdef uint64_t _trace_room = 0           # records the array holds (it only grows)
cdef uint64_t _trace_keep = 0           # the session's capacity: the latest it keeps


def trace_start(uint64_t capacity) -> None:
    """Record the channels' batches, doorbells, completions, waits and rendezvous
    phases (rdmamw/include/rm_trace.h) from now on, until :func:`trace_stop`, which
    returns the latest ``capacity`` of them (older ones are counted, not kept)."""
    global _trace_room, _trace_keep
    cdef rm_trace *t = trace_state()
    cdef uint64_t ring = 1
    cdef uint32_t shift = 0
    cdef void *p
    if t.on:
        raise RuntimeError("the engine records a timeline already")
    if capacity == 0:
        raise ValueError("capacity must be at least 1")
    if capacity > (<uint64_t>1 << 40):
        raise ValueError("capacity must be at most 2**40")
    while ring < capacity:          # the ring: a power of two (its slot: index & mask)
        ring <<= 1
        shift += 1
    if ring > _trace_room:          # (the old array leaks: a late writer may hold it)
        # zeroed pages, touched as they fill, page-aligned: a record is one cache line
        p = mmap(NULL, ring * sizeof(rm_trace_rec), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if p == MAP_FAILED:
            raise MemoryError()
        t.recs, _trace_room = <rm_trace_rec *>p, ring
    t.cap, t.mask, t.shift, t.next = ring, ring - 1, shift, 0
    _trace_keep = capacity
    t.gen += 1
    rm_trace_switch(t, 1)


def trace_stop() -> tuple:
    """Stop recording: (the latest records written, at most the capacity, as bytes of
    TRACE_RECORD_BYTES each, in the order their writers claimed them; how many were
    not kept: older ones, overwritten in the ring or past the capacity, and any still
    being written)."""
    cdef rm_trace *t = trace_state()
    cdef uint64_t n, i, kept = 0, claimed
    cdef int64_t until
    cdef bytearray out
    cdef rm_trace_rec *dst
    if not t.on:
        return b"", 0
    rm_trace_switch(t, 0)
    claimed = rm_trace_claimed(t)
    n = min(claimed, _trace_keep)
    out = bytearray(n * sizeof(rm_trace_rec))
    dst = <rm_trace_rec *><char *>out
    until = now_ns() + 1000000          # a writer that saw `on` finishes within this
    for i in range(claimed - n, claimed):
        while not rm_trace_ready(t, i) and now_ns() < until:
            rm_cpu_relax()
        if rm_trace_copy(t, i, &dst[kept]):
            kept += 1
    return bytes(out[:kept * sizeof(rm_trace_rec)]), <object>(claimed - kept)


cdef inline void count_batch(EagerSender tx, SendBatch b, Py_ssize_t n,
                             uint32_t nplan) noexcept:
    """A send call posted its whole batch: the counters, and its timeline record."""
    tx.count(n, b.bytes, nplan)
    b.trace_end(n)


cdef bint claim(int *lock, long owner) except -1:
    """close(): take the lock of a call in progress once that call has ended (its
    waits end on the close). False when the call is this thread's own (a signal
    handler's close) or does not end within CLOSE_LOCK_NS: it then releases what it
    holds itself, as it leaves (it sees ``link.ended``)."""
    if owner != 0 and owner == PyThread_get_thread_ident():
        return False
    return take_until(lock, now_ns() + CLOSE_LOCK_NS)


cdef int let_reads_finish(RndvSender rs, Waiter w) except -1:
    """close(): the receiver may still be READing our rendezvous sources: give it a
    bounded time (CLOSE_RNDV_NS) to flip their done bits (close()'s own wait)."""
    cdef int64_t until = now_ns() + CLOSE_RNDV_NS
    while not rs.poll(rs.next) and now_ns() < until:
        with nogil:
            if w.wait(WAIT_DONE, rs.next, slice_end(until), False, False, True) < 0:
                break
    return 0


cdef int drop_receives(RndvReceiver rr, int *lock, long owner) except -1:
    """close(), after the transport went: under the receive lock, what the receiving
    side holds goes (else the receive call that holds the lock lets it go itself)."""
    if claim(lock, owner):
        try:
            rr.drop_all()
        finally:
            give(lock)
    return 0


cdef int take_lock(Link link, int *lock, int64_t deadline, str what) except -1:
    """Take a call's lock, which another thread's call holds until it ends (the
    caller tried once without waiting): in slices (signals), until this side closes or
    the deadline (Timeout)."""
    while True:
        if take_until(lock, slice_end(deadline)):
            return 0
        if link.closed:
            link.refuse()
        if deadline and now_ns() >= deadline:
            raise Timeout(f"another thread's {what} on this channel went on for the "
                          f"whole timeout; this one did nothing")
        PyErr_CheckSignals()


cdef class Engine(Endpoint):
    """One channel endpoint. Created by a provider's connect/accept, never directly."""
    # (its fields: _engine.pxd)

    def __cinit__(self, *args, **kwargs):
        self.link = Link()
        self.trace_id = self.link.serial

    def _setup(self, Transport tp, uint32_t nslots, uint32_t slot_size, uint32_t peer_nslots,
               uint32_t peer_slot_size, str mode="batched", double spin_us=100.0,
               double gap_timeout=2.0, flush_fraction=0.25, str rendezvous="off",
               rndv_threshold=None, uint64_t max_message_size=1 << 30):
        """Wire the engine to a connected transport whose regions follow
        rdmamw/transport/layout.py.

        ``rendezvous`` is "off", "read" or "write" (rdmamw/channel/rendezvous.py resolves
        "auto"); messages above ``rndv_threshold`` (at most, and by default, the peer's
        slot_size) then go by rendezvous when the transport can expose memory. A
        rendezvous message above ``max_message_size`` is refused (MessageTooLarge); the
        limit is announced to the peer, whose sender then refuses it locally."""
        cdef Link link = self.link
        cdef uint64_t threshold
        check_mode(mode)
        check_rendezvous(rendezvous, allowed=RNDV_STRATEGIES)
        if rndv_threshold is not None and rndv_threshold < 0:
            raise ValueError("rndv_threshold must be >= 0")
        if not 0.0 < flush_fraction <= 1.0:
            raise ValueError("flush_fraction must be in (0, 1]")
        if max_message_size == 0:
            raise ValueError("max_message_size must be at least 1")
        layout.check_ring(nslots, slot_size)
        layout.check_ring(peer_nslots, peer_slot_size)
        link.attach(tp, spin_us)
        link.check_rings(nslots, layout.slot_stride(slot_size), peer_nslots,
                         layout.slot_stride(peer_slot_size))
        self.mode = mode
        self.ack = mode == "ack"
        self.rndv_on = rendezvous != "off" and link.can_expose()
        self.rendezvous = rendezvous if self.rndv_on else "off"
        self.cache_ok = link.registers_memory()
        threshold = peer_slot_size if rndv_threshold is None else min(
            <uint64_t>rndv_threshold, peer_slot_size)
        self.rx = EagerReceiver(link, nslots, slot_size, link.region_view(RM_REGION_ARRIVAL),
                                gap_timeout, flush_fraction, self.ack)
        self.batch = SendBatch(link, peer_slot_size, self.ack, self.rndv_on, threshold,
                               min(RM_MAX_WR_BYTES, link.max_expose() or RM_MAX_WR_BYTES),
                               self.rendezvous)
        self.rs = RndvSender(link, self.batch, self.rndv_on and rendezvous == "write")
        self.tx = EagerSender(link, self.batch, self.rs, peer_nslots, peer_slot_size,
                              link.region_view(RM_REGION_RECLAIM))
        self.w = Waiter(link, self.tx, self.rs, self.rx)
        self.rr = RndvReceiver(link, self.rx, self.rndv_on and rendezvous == "write",
                               min(max_message_size, RM_MAX_WR_BYTES), self.w)
        self.regcache, self.regcache_dst = self._regcache, self._regcache_dst
        link.announce_max_msg(self.rr.max_msg)     # into the peer's CTRL_MAX_MSG
        link.open()

    def __dealloc__(self):
        cdef Link link = self.link
        if link is not None and not link.closed and link.attached() and not link.inherited():
            self._say_closed()      # dropped without close(): still a clean close

    cdef void _say_closed(self) noexcept nogil:
        """Tell the peer this side closed, after the releases not yet written back."""
        self.link.lock()
        if not self.link.peer_gone and self.rx is not None and self.rx.unflushed():
            self.rx.flush_locked()
        self.link.announce_closed()
        self.link.unlock()

    # ---- sending ------------------------------------------------------------------

    def send_batch(self, msgs, timeout=None) -> SendHandle:
        """Send every message of ``msgs`` (bytes-like objects, numpy arrays, ...) in
        order, as few chained work-request lists as the free slots allow.

        Either the whole batch is accepted or, on a bad item (``TypeError``) or an
        oversized one (``MessageTooLarge``), nothing is sent. If the ring stays full
        past ``timeout``, :class:`Timeout` says how many messages went (``.sent``)."""
        cdef SendHandle h
        if type(msgs) is list or type(msgs) is tuple:       # (the usual two first)
            if Py_SIZE(msgs) == 1 and (h := self._send_one(msgs[0], timeout)) is not None:
                return h
            return self._send(msgs, timeout)
        if isinstance(msgs, (bytes, bytearray, memoryview, str)):
            raise TypeError("send_batch takes an iterable of messages; use send() for one")
        return self._send(tuple(msgs), timeout)

    def send(self, msg, timeout=None) -> SendHandle:
        """Send one message (a batch of one)."""
        cdef SendHandle h = self._send_one(msg, timeout)
        return h if h is not None else self._send((msg,), timeout)

    cdef SendHandle _send_one(self, object msg, object timeout):
        """A batch of one eager bytes object on a synchronous transport, without the
        batch's machinery (EagerSender.send_one); None when the general path must send
        it (another type or size, a call of another thread running, no free slot)."""
        cdef Link link = self.link
        cdef int64_t deadline
        cdef int rc
        if not PyBytes_CheckExact(msg) or not self.tx.takes_one(PyBytes_GET_SIZE(msg)):
            return None
        link.check_usable()
        deadline = deadline_of(timeout)
        if link.peer_closing():
            link.raise_peer(link.peer_status(), "send")
        if not try_take(&self.send_lock):
            return None
        try:
            if link.closed:             # by another thread meanwhile
                link.refuse()
            self.rs.begin()
            if self.rx.done_unflushed:      # done bits of what we received ride along
                self.rx.flush()
            if deadline:
                link.deadline_posts(deadline)
            rc = self.tx.send_one(PyBytes_AS_STRING(msg), <uint32_t>PyBytes_GET_SIZE(msg))
            if deadline:
                link.deadline_posts(0)
            if rc < 0:
                link.raise_post(rc)
        finally:
            if link.ended:
                self.rs.give_back()
            give(&self.send_lock)
        return new_handle(self, link.batch_posted, 1, self.rs.next) if rc else None

    cdef SendHandle _send(self, object fast, object timeout, Packed packed=None):
        """``fast``: a tuple or a list (SendBatch.acquire holds a list's messages);
        None with ``packed``: send_many's messages, cut out of one buffer."""
        cdef Link link = self.link
        cdef SendBatch b
        cdef Py_ssize_t n
        cdef int64_t deadline
        cdef uint32_t nplan = 0, k = 0, got
        cdef bint first_wait = True
        cdef int rc = 0, st
        link.check_usable()
        deadline = deadline_of(timeout)
        if link.peer_closing():
            link.raise_peer(link.peer_status(), "send")
        b = self.batch
        if not try_take(&self.send_lock):
            take_lock(link, &self.send_lock, deadline, "send")
        try:
            # (a list's, as acquire() finds it: no Python runs between)
            n = Py_SIZE(fast) if packed is None else packed.n
            if n >= <int64_t>0xFFFF0000:  # (cast: the bare literal made it a Python compare)
                raise ValueError("batch too large")
            if link.closed:             # by another thread while this one waited
                link.refuse()
            b.grow(<uint32_t>n + 1)
            self.tx.grow(<uint32_t>n + 1)
            if packed is None:
                b.acquire(fast, n)
            else:
                b.acquire_packed(packed)
            self.rs.begin()
            if self.rx.done_unflushed:      # done bits of what we received ride along
                self.rx.flush()
            if deadline:
                link.deadline_posts(deadline)    # a post waits for the peer until then
            b.trace_begin()
            try:
                # tiny batches cost less than a GIL release; big copies run without it
                if b.bytes >= NOGIL_BYTES:
                    with nogil:
                        nplan = b.plan(<uint32_t>n)
                        k = self.tx.post_planned(0, nplan, &rc)
                else:
                    nplan = b.plan(<uint32_t>n)
                    k = self.tx.post_planned(0, nplan, &rc)
                while k < nplan or rc:
                    if rc == RM_ERR_LATE:       # accepted (queued in the transport) by
                        rc = 0                      # the deadline: what is left is not
                        if k < nplan:
                            raise Timeout(
                                f"the peer read nothing until the deadline; "
                                f"{b.plan_start[k]} of {n} messages were accepted (they go "
                                f"if it reads again)", sent=b.plan_start[k])
                        break
                    if rc != 0:
                        link.raise_post(rc)
                    # ring full (or no rendezvous entry): wait for reclaim (done) bits,
                    # a slice at a time (signals, where a close from this thread may come)
                    self.send_owner = PyThread_get_thread_ident()
                    with nogil:
                        st = self.w.wait(self.tx.blocked_on, 0, link.wait_until(deadline),
                                         first_wait)
                    first_wait = False
                    self.rs.poll(self.rs.next)
                    if st < 0:
                        link.raise_peer(st, "waiting for free slots")
                    if st == 0:
                        PyErr_CheckSignals()
                        if link.closed:     # by another thread
                            link.refuse()
                        if deadline and now_ns() >= deadline:
                            raise Timeout(
                                f"ring full for the whole timeout; {b.plan_start[k]} of "
                                f"{n} messages sent", sent=b.plan_start[k])
                        continue
                    with nogil:
                        got = self.tx.post_planned(k, nplan, &rc)
                    if got > k:
                        first_wait = True
                    k = got
            finally:
                if deadline:
                    link.deadline_posts(0)
                if nplan:
                    self.rs.end(b.plan_start[k])
                b.release_bufs(n)
            count_batch(self.tx, b, n, nplan)
        finally:
            if link.ended:      # a close() that could not wait for this call: the
                self.rs.give_back()     # sources it left are this call's to release
            self.send_owner = 0
            b.drop_srcs()
            give(&self.send_lock)
        return new_handle(self, link.batch_posted, n, self.rs.next)

    # ---- an event loop's waits (docs/api.md, "Event loops") -------------------------

    def fileno(self) -> int:
        """A descriptor that turns readable when this channel may have something to
        deliver (messages, the peer closing or dying) or, after ``arm(send=True)``,
        when send credit returns. Call :meth:`arm` before every wait on it: it says
        whether to wait at all, and only an armed channel wakes the descriptor.
        Readiness may be spurious (look, then arm again). Stop watching it before
        ``close()``."""
        self.link.check_usable()
        return self.link.event_fd()

    @property
    def poll_interval(self) -> float:
        """Seconds after which a wait on :meth:`fileno` should look again even if it
        stayed quiet: 0 (never) but on a verbs connection whose peer sends plain
        WRITEs (no completion event: ``RDMAMW_VERBS_EVENT=0``), as ``wait`` does."""
        return self.link.poll_interval()

    def arm(self, bint send=False, SendHandle handle=None, double spin_us=0.0) -> bool:
        """Prepare :meth:`fileno` for a wait (check, arm, check): False when armed (wait
        until it is readable), True when there is no need to wait. ``send=False``:
        ready when ``recv_batch(timeout=0)`` has something to return or raise (a
        message, the peer closed or lost, this side closed). ``send=True``: ready when
        the last ``send_batch`` that ran out of slots can go on; with ``handle``, when
        that handle may be done. Arming asks the peer to wake this side (the flags
        ``recv`` sets before it sleeps); :meth:`disarm` lowers them. ``spin_us``: a
        receive first polls this long (a reply about to land costs less than a trip
        through the event loop)."""
        cdef Link link = self.link
        cdef bint ready
        cdef int what = WAIT_ARRIVAL
        cdef uint64_t target = 0
        cdef int64_t spin_ns = <int64_t>(spin_us * 1000.0)
        link.check_owner()
        if link.closed or link.broken is not None or not link.attached():
            return True
        if send:
            what, spin_ns = self.tx.blocked_on, 0
            if handle is not None:
                if not link.poll_done(handle.batch):
                    return True     # a completion the NIC reports without an event: poll
                what, target = WAIT_DONE, handle.rndv
        with nogil:
            ready = self.w.arm(what, target, spin_ns)
        return ready

    def disarm(self) -> None:
        """Lower the wake-up flags :meth:`arm` raised at the peer (it stops waking this
        side for every batch)."""
        cdef Link link = self.link
        if not link.attached() or link.closed or link.peer_gone:
            return
        with nogil:
            self.w.disarm()

    # ---- what SendHandles ask ------------------------------------------------------

    cdef bint handle_done(self, uint64_t batch, uint64_t rndv) except -1:
        self.link.check_owner()
        return self.link.poll_done(batch) and self.rs.poll(rndv)

    cdef int handle_wait(self, uint64_t batch, uint64_t rndv, object timeout) except -1:
        self.link.check_owner()
        return self.w.handle(batch, rndv, deadline_of(timeout))

    # ---- receiving ----------------------------------------------------------------

    cdef list _deliver(self, Py_ssize_t maxn):
        """The messages that have arrived, at most ``maxn``: a list, or None if none."""
        cdef list out = None
        cdef Py_ssize_t got = 0
        cdef char *rndv
        cdef uint32_t opened = 0
        while True:
            out = take_eager(self, out, &got, maxn, &opened, &rndv)
            if rndv == NULL or got:     # a failing READ must not take earlier messages
                return out
            out = [self.rr.take(self, rndv)]
            got = 1

    def post_recv(self, buffer) -> None:
        """Post ``buffer`` (writable, C-contiguous: numpy array, bytearray, ...) as the
        destination of the next rendezvous message that has none yet. It is lent to the
        channel until that message was received (recv/recv_batch return a Message that
        views it); with ``rendezvous="write"`` the sender WRITEs straight into it."""
        cdef Dest d = new_dest(buffer)
        self.link.check_usable()
        if not try_take(&self.recv_lock):
            take_lock(self.link, &self.recv_lock, 0, "receive")
        try:
            if not self.rndv_on:
                raise ValueError("rendezvous is off on this channel; nothing to post for")
            self.rr.post(d)
        finally:
            give(&self.recv_lock)

    def recv_into(self, buffer, timeout=None) -> int:
        """Receive the next message into ``buffer`` (writable, C-contiguous) and return
        its length, like ``socket.recv_into``. A small message is copied out of the
        ring; a rendezvous message is READ straight into ``buffer``. Too small a buffer
        raises :class:`BufferTooSmall` (``.needed``) and the message stays receivable."""
        return self._recv(0, timeout, new_dest(buffer))

    def recv_batch(self, max_messages=None, timeout=None) -> list:
        """Return the messages that have arrived (at least one, at most
        ``max_messages``, from at most a quarter of the ring's slots), waiting up to
        ``timeout`` seconds for the first.

        ``timeout=0`` polls; ``None`` waits until a message, a clean close of the peer
        (:class:`ChannelClosed`) or its loss (:class:`PeerLost`). Messages that arrived
        before the peer went are still delivered first."""
        cdef Py_ssize_t maxn
        if max_messages is None:
            maxn = 1 << 40
        else:
            maxn = max_messages
            if maxn <= 0:
                raise ValueError("max_messages must be positive")
        cdef object out = self._first_look(maxn)
        return out if out is not None else self._recv(maxn, timeout, None)

    def recv(self, timeout=None) -> Message:
        """Receive one message (see :meth:`recv_batch`)."""
        cdef object m = self._first_look(0)
        return m if m is not None else self._recv(1, timeout, None)[0]

    cdef object _first_look(self, Py_ssize_t maxn):
        """A receive's first look, without the wait loop's machinery: the eager
        messages that have arrived (``maxn`` 0: recv()'s one, a Message; else a list of
        at most ``maxn``, as _deliver takes them), or None (then _recv looks again,
        delivers a rendezvous message, or waits)."""
        cdef object out = None
        cdef Py_ssize_t got = 0
        cdef uint32_t opened = 0
        cdef char *rndv
        self.link.check_owner()
        if self.link.broken is None and self.rx is not None and try_take(&self.recv_lock):
            try:
                if maxn == 0:
                    out = take_one(self)
                else:
                    out = take_eager(self, None, &got, maxn, &opened, &rndv)
                    if out is not None and self.rx.done_unflushed:
                        self.rx.flush()
            finally:
                if self.link.ended:     # a close() that could not wait for this call
                    self.rr.drop_all()
                give(&self.recv_lock)
        return out

    cdef object _recv(self, Py_ssize_t maxn, object timeout, Dest into):
        cdef Link link = self.link
        cdef int64_t deadline
        cdef int st
        cdef bint first_wait = True
        cdef Py_ssize_t n
        link.check_owner()
        if link.broken is not None:
            raise ProtocolError(link.broken)
        if self.rx is None:
            raise ChannelClosed("this side closed the channel")
        deadline = deadline_of(timeout)
        if not try_take(&self.recv_lock):
            take_lock(link, &self.recv_lock, deadline, "receive")
        self.rr.set_deadline(deadline)
        try:
            while True:
                if link.broken is not None:
                    raise ProtocolError(link.broken)
                if into is None:
                    if (out := self._deliver(maxn)) is not None:
                        if self.rx.done_unflushed:  # one done write-back per call
                            self.rx.flush()
                        return out
                else:
                    n = self.rr.deliver_into(into)
                    if n >= 0:
                        if self.rx.done_unflushed:
                            self.rx.flush()
                        return n
                if link.closed:
                    raise ChannelClosed("this side closed the channel")
                if timeout is not None and deadline <= now_ns():
                    st = link.peer_status()
                    if st < 0:
                        # the close word came after the peer's last data: what landed
                        # since the look above is delivered first (the waits re-check
                        # the same way; docs/protocol.md, "Closing")
                        if self.rx.has_arrivals():
                            continue
                        link.raise_peer(st, "receive")
                    raise Timeout("no message within the timeout")
                # first a few microseconds with the GIL: a reply about to land
                # (ping-pong) costs less than a GIL release and re-acquire
                if first_wait and self.w.spin(WAIT_ARRIVAL, 0, now_ns() + GIL_SPIN_NS, 16):
                    first_wait = False
                    continue
                self.recv_owner = PyThread_get_thread_ident()     # (signals, as sending)
                with nogil:
                    st = self.w.wait(WAIT_ARRIVAL, 0, link.wait_until(deadline), first_wait,
                                     True)
                first_wait = False
                if st < 0:
                    link.raise_peer(st, "receive")
                if st == 0:
                    PyErr_CheckSignals()
        finally:
            self.w.end_receive()    # a flag kept raised between slices goes down
            if link.ended:          # a close() that could not wait for this call
                self.rr.drop_all()
            self.recv_owner = 0
            give(&self.recv_lock)

    # ---- lifetime and introspection ------------------------------------------------

    def close(self) -> None:
        """Close this endpoint; the peer sees :class:`ChannelClosed` once it has
        received what was sent. Messages already received stay readable. Safe from any
        thread at any moment: the calls waiting on this channel end first, each buffer
        is released once, by its owner (docs/protocol.md, "Closing")."""
        cdef Link link = self.link
        cdef bint have
        if link.closed:
            return
        if link.inherited():
            link.shut()             # a fork child: the connection is the parent's
            return
        link.shut()                 # no call starts now; a waiting one ends at its next
        with nogil:                 # look, which this wake-up brings now
            link.wake_self()
        have = claim(&self.send_lock, self.send_owner)
        try:
            if have:
                let_reads_finish(self.rs, self.w)
            for cache in (self._regcache, self._regcache_dst):
                if self.cache_ok and cache is not None:
                    cache.close()   # idle MRs go now, those still leased when released
            link.deadline_posts(now_ns() + CLOSE_POST_NS)     # a peer that reads nothing
            with nogil:
                self._say_closed()
            link.end()              # wakes whoever still sleeps in the transport
            if have:
                self.rs.give_back()     # the sources go back regardless
        finally:
            if have:
                give(&self.send_lock)
        drop_receives(self.rr, &self.recv_lock, self.recv_owner)

    def _credit_waited(self, double seconds) -> None:
        """An event loop's sender waited ``seconds`` for slots or done bits (rdmamw.aio):
        counted in ``credit_wait_seconds`` as a blocking send's wait is."""
        self.w.waited(<uint64_t>(seconds * 1e9))

    def stats(self) -> dict:
        """Counters of this endpoint; everything that hit the transport is counted."""
        d = self.link.stats()
        d["free_send_slots"] = self.tx.sbm.count_free() if self.tx is not None else 0
        return d

    def diagnostics(self) -> dict:
        """The engine's sequence numbers, bitmap words, control words and rendezvous
        state, for diagnosing a stuck channel (docs/api.md, "Diagnostics"); the keys
        may change between versions, unlike ``stats()``'s."""
        if self.rx is None:
            return {"peer_gone": self.link.peer_gone, "transport_error": None}
        d = self.tx.diagnostics()
        d.update(self.rx.diagnostics())
        d.update(self.link.diagnostics())
        d.update(rndv_next=self.rs.next, rndv_upto=self.rs.upto,
                 rndv_released=self.rs.released, rrndv_next=self.rr.next)
        return d

    # ---- attributes ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.link.closed

    @property
    def peer_gone(self) -> bool:
        return self.link.peer_gone

    @property
    def peer(self):
        """The peer's address (set by the channel layer; used in log lines)."""
        if self.link.peer is None:
            raise AttributeError("peer")
        return self.link.peer

    @peer.setter
    def peer(self, value):
        self.link.set_peer(value)

    @property
    def nslots(self) -> int:
        """Slots of the ring this side receives on."""
        return self.rx.nslots if self.rx is not None else 0

    @property
    def slot_size(self) -> int:
        return self.rx.slot_size if self.rx is not None else 0

    @property
    def peer_nslots(self) -> int:
        """Slots of the peer's ring, which this side sends into."""
        return self.tx.peer_nslots if self.tx is not None else 0

    @property
    def peer_slot_size(self) -> int:
        return self.tx.peer_slot_size if self.tx is not None else 0

    @property
    def eager_limit(self) -> int:
        """Largest message the peer's ring takes (its slot_size)."""
        return self.peer_slot_size

    @property
    def flush_threshold(self) -> int:
        """Releases gathered before the reclaim words are written back."""
        return self.rx.flush_threshold if self.rx is not None else 0

    @property
    def rndv_threshold(self) -> int:
        """Messages above this many bytes go by rendezvous (when it is on)."""
        return self.batch.rndv_threshold if self.batch is not None else 0

    @property
    def rndv_upto(self) -> int:
        """Rendezvous messages sent whose done bit came back (in order)."""
        return self.rs.upto if self.rs is not None else 0

    @property
    def rndv_pending(self) -> int:
        """Rendezvous messages sent whose sources the receiver has not released yet."""
        return self.rs.next - self.rs.released if self.rs is not None else 0

    @property
    def max_message_size(self) -> int:
        """Largest message this side takes (larger ones are refused: MessageTooLarge)."""
        return self.rr.max_msg if self.rr is not None else 0

    @property
    def peer_max_message_size(self) -> int:
        """Largest message the peer takes, as it announced (0 until it has)."""
        return rm_load_acquire64(&self.link.ctrl[CTRL_MAX_MSG]) if self.link.ctrl != NULL else 0

    # the registration caches of a transport that registers memory (verbs), and the
    # allocator of rendezvous destinations: the channel layer passes them in
    @property
    def regcache(self):
        return self._regcache

    @regcache.setter
    def regcache(self, cache):
        self._regcache = cache
        if self.batch is not None:
            self.batch.use(cache if self.cache_ok else None)

    @property
    def regcache_dst(self):
        return self._regcache_dst

    @regcache_dst.setter
    def regcache_dst(self, cache):
        self._regcache_dst = cache
        if self.rr is not None:
            self.rr.use(cache if self.cache_ok else None, self.rr.allocate)

    @property
    def allocate(self):
        return self.rr.allocate if self.rr is not None else None

    @allocate.setter
    def allocate(self, fn):
        if self.rr is None:
            raise ChannelClosed("the channel is not set up yet")
        self.rr.use(self.rr.regcache_dst, fn)
