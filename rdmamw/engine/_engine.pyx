# cython: freethreading_compatible = False
"""The batch engine: one channel endpoint, orchestrating the units that own its state.

A batch of messages becomes ONE chained list of work requests handed to the provider
(one doorbell): the slot writes, then the arrival-bitmap words that changed, last; only
the last request is signaled. Receiving scans the arrival bitmap word-at-a-time,
checks each slot's sequence number and hands out zero-copy Message views; releases
flip reclaim bits locally and are written back lazily, in batches. The wire format is
in docs/protocol.md; who owns what in rdmamw/engine/__init__.py.

The engine itself holds only the locks (one sender and one receiver at a time), the
spin-then-block waits, and the calls users make: send_batch / recv_batch / close. The
data path runs with the GIL released and allocates no Python object per message on
the send side; on the receive side a Message (from a free list) is the view the user
asked for."""

from cpython.exc cimport PyErr_CheckSignals
from cpython.pythread cimport (
    NOWAIT_LOCK,
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)
from cpython.tuple cimport PyTuple_GET_SIZE
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

from rdmamw.engine._batch cimport SendBatch
from rdmamw.engine._eager_recv cimport EagerReceiver
from rdmamw.engine._eager_send cimport EagerSender
from rdmamw.engine._frames cimport (
    CTRL_CLOSED,
    CTRL_CREDIT_WAIT,
    CTRL_MAX_MSG,
    CTRL_RX_SLEEP,
    DESC_BYTES,
    REC_RNDV,
    RM_MAX_WR_BYTES,
    RM_NO_SLOT,
    WAIT_DONE,
    WAIT_ENTRY,
    WAIT_SLOTS,
    WORD_MAX_MSG,
    WORD_ONE,
    WORD_ZERO,
)
from rdmamw.engine._link cimport PEER_CHECK_NS, Link, deadline_of, slice_end
from rdmamw.engine._messages cimport (
    Dest,
    Endpoint,
    Message,
    SendHandle,
    new_dest,
    new_handle,
    new_message,
    take_eager,
)
from rdmamw.engine._rndv_recv cimport RndvReceiver
from rdmamw.engine._rndv_send cimport RndvSender
from rdmamw.transport._base cimport (
    RM_ERR_CLOSED,
    RM_REGION_ARRIVAL,
    RM_REGION_CTRL,
    RM_REGION_RECLAIM,
    RM_REGION_RING,
    Transport,
    now_ns,
)
from rdmamw.transport.atomics cimport (
    rm_cpu_relax,
    rm_fence_seq_cst,
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_unlock,
)

from rdmamw.errors import BufferTooSmall, ChannelClosed, PeerLost, ProtocolError, Timeout
from rdmamw.transport import layout
from rdmamw.vocabulary import RNDV_STRATEGIES, check_mode, check_rendezvous

cdef uint64_t NOGIL_BYTES = 16384       # batches from this size on copy without the GIL
cdef int64_t GIL_SPIN_NS = 3000         # a receive polls this long before releasing the GIL
cdef int64_t CLOSE_RNDV_NS = 5000000000 # close() waits this long for pending READs


cdef class Engine(Endpoint):
    """One channel endpoint. Created by a provider's connect/accept, never directly."""
    cdef Link link
    cdef SendBatch batch
    cdef EagerSender tx
    cdef RndvSender rs
    cdef RndvReceiver rr                # (rx, the EagerReceiver: a field of Endpoint)
    cdef readonly str mode
    cdef readonly str rendezvous        # "off", "read" or "write" (as resolved)
    cdef bint ack
    cdef bint rndv_on
    cdef bint cache_ok                  # the transport's keys come from the caches
    cdef object _regcache, _regcache_dst
    cdef int blocked_on                 # what _post_available ran out of (WAIT_*)
    cdef PyThread_type_lock send_lock
    cdef PyThread_type_lock recv_lock

    def __cinit__(self, *args, **kwargs):
        self.send_lock = PyThread_allocate_lock()
        self.recv_lock = PyThread_allocate_lock()
        if self.send_lock == NULL or self.recv_lock == NULL:
            raise MemoryError()
        self.link = Link()

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
        if tp.local[RM_REGION_RING].length < <uint64_t>nslots * layout.slot_stride(slot_size):
            raise ValueError("transport ring region is smaller than the ring")
        if tp.peer[RM_REGION_RING].length < \
                <uint64_t>peer_nslots * layout.slot_stride(peer_slot_size):
            raise ValueError("peer ring region is smaller than its ring")
        self.mode = mode
        self.ack = mode == "ack"
        self.rndv_on = rendezvous != "off" and tp.can_expose
        self.rendezvous = rendezvous if self.rndv_on else "off"
        self.cache_ok = tp.registers_memory
        threshold = peer_slot_size if rndv_threshold is None else min(
            <uint64_t>rndv_threshold, peer_slot_size)
        link.attach(tp, spin_us)
        self.rx = EagerReceiver(link, nslots, slot_size, tp._region_view(RM_REGION_ARRIVAL),
                                gap_timeout, flush_fraction, self.ack)
        self.batch = SendBatch(link, peer_slot_size, self.ack, self.rndv_on, threshold,
                               min(RM_MAX_WR_BYTES, tp.max_expose or RM_MAX_WR_BYTES),
                               self.rendezvous)
        self.rs = RndvSender(link, self.batch, self.rndv_on and rendezvous == "write")
        self.tx = EagerSender(link, self.batch, self.rs, peer_nslots, peer_slot_size,
                              tp._region_view(RM_REGION_RECLAIM))
        self.rr = RndvReceiver(link, self.rx, self.rndv_on and rendezvous == "write",
                               min(max_message_size, RM_MAX_WR_BYTES))
        self.regcache, self.regcache_dst = self._regcache, self._regcache_dst
        link.words[WORD_MAX_MSG] = self.rr.max_msg  # announce it in the peer's CTRL_MAX_MSG
        link.put_word(RM_REGION_CTRL, CTRL_MAX_MSG, &link.words[WORD_MAX_MSG])
        link.closed = False

    def __dealloc__(self):
        cdef Link link = self.link
        if link is not None and not link.closed and link.tp is not None \
                and not link.peer_gone and not link.inherited():
            # dropped without close(): still tell the peer it was a clean close
            link.put_word(RM_REGION_CTRL, CTRL_CLOSED, &link.words[WORD_ONE])
            rm_fence_seq_cst()
            link.tp.wake_peer()
        if self.send_lock != NULL:
            PyThread_free_lock(self.send_lock)
        if self.recv_lock != NULL:
            PyThread_free_lock(self.recv_lock)

    cdef int _lock(self, PyThread_type_lock lock) except -1:
        if not PyThread_acquire_lock(lock, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(lock, WAIT_LOCK)
        return 0

    # ---- sending ------------------------------------------------------------------

    def send_batch(self, msgs, timeout=None) -> SendHandle:
        """Send every message of ``msgs`` (bytes-like objects, numpy arrays, ...) in
        order, as few chained work-request lists as the free slots allow.

        Either the whole batch is accepted or, on a bad item (``TypeError``) or an
        oversized one (``MessageTooLarge``), nothing is sent. If the ring stays full
        past ``timeout``, :class:`Timeout` says how many messages went (``.sent``)."""
        if isinstance(msgs, (bytes, bytearray, memoryview, str)):
            raise TypeError("send_batch takes an iterable of messages; use send() for one")
        return self._send(msgs if type(msgs) is tuple else tuple(msgs), timeout)

    def send(self, msg, timeout=None) -> SendHandle:
        """Send one message (a batch of one)."""
        return self._send((msg,), timeout)

    cdef SendHandle _send(self, tuple fast, object timeout):
        cdef Link link = self.link
        cdef SendBatch b
        cdef Py_ssize_t n
        cdef int64_t deadline
        cdef uint32_t nplan = 0, k = 0, got
        cdef bint first_wait = True
        cdef int rc = 0, st
        n = PyTuple_GET_SIZE(fast)
        link.check_usable()
        if n >= 0xFFFF0000:
            raise ValueError("batch too large")
        deadline = deadline_of(timeout)
        if link.peer_closing():
            link.raise_peer(link.peer_status(), "send")
        b = self.batch
        self._lock(self.send_lock)
        try:
            b.grow(<uint32_t>n + 1)
            self.tx.grow(<uint32_t>n + 1)
            b.acquire(fast, n)
            self.rs.prep_i = 0
            if self.rs.released < self.rs.next:
                self.rs.poll(self.rs.next)
            if self.rx.done_unflushed:      # done bits of what we received ride along
                self.rx.flush()
            try:
                # tiny batches cost less than a GIL release; big copies run without it
                if b.bytes >= NOGIL_BYTES:
                    with nogil:
                        nplan = b.plan(<uint32_t>n)
                        k = self._post_available(0, nplan, &rc)
                else:
                    nplan = b.plan(<uint32_t>n)
                    k = self._post_available(0, nplan, &rc)
                while k < nplan or rc:
                    if rc != 0:
                        link.raise_post(rc)
                    # ring full (or no rendezvous entry): wait for reclaim (done) bits,
                    # a slice at a time (signals)
                    with nogil:
                        st = self._wait_credit(slice_end(deadline), first_wait,
                                               self.blocked_on)
                    first_wait = False
                    self.rs.poll(self.rs.next)
                    if st < 0:
                        link.raise_peer(st, "waiting for free slots")
                    if st == 0:
                        PyErr_CheckSignals()
                        if deadline and now_ns() >= deadline:
                            raise Timeout(
                                f"ring full for the whole timeout; {b.plan_start[k]} of "
                                f"{n} messages sent", sent=b.plan_start[k])
                        continue
                    with nogil:
                        got = self._post_available(k, nplan, &rc)
                    if got > k:
                        first_wait = True
                    k = got
            finally:
                if nplan and self.rs.prep_i > b.plan_start[k]:
                    self.rs.unprepare(b.plan_start[k])
                b.release_bufs(n)
            link.cnt.msgs_sent += n
            link.cnt.bytes_sent += b.bytes
            link.cnt.slots_sent += nplan
            link.cnt.batches += 1
        finally:
            PyThread_release_lock(self.send_lock)
        return new_handle(self, link.batch_posted, n, self.rs.next)

    cdef uint32_t _post_available(self, uint32_t k, uint32_t nplan, int *rc) noexcept nogil:
        """Post planned slots from k on while free slots (and rendezvous entries)
        last; return the new k."""
        cdef uint32_t got, want
        rc[0] = 0
        self.blocked_on = WAIT_SLOTS
        while k < nplan:
            want = 1 if self.ack else nplan - k
            if self.rs.prep_i < self.batch.plan_start[k + want]:
                want = self.rs.prepare(k, want, rc)
                if rc[0] != 0:
                    break
                if want == 0:
                    self.blocked_on = WAIT_ENTRY
                    break
            got = self.tx.alloc(want)
            if got == 0:
                break
            rc[0] = self.tx.post_slots(k, got)
            if rc[0] != 0:
                break
            k += got
        return k

    cdef bint _credit_ready(self, int what, uint64_t target) noexcept nogil:
        if what == WAIT_SLOTS:
            return self.tx.sbm.count_free() != 0
        return self.rs.ready(what, target)

    cdef int _wait_credit(self, int64_t until, bint spin, int what=WAIT_SLOTS,
                          uint64_t target=0) noexcept nogil:
        """Spin, then sleep, until a slot is free (WAIT_SLOTS), a rendezvous entry can be
        recycled (WAIT_ENTRY) or rendezvous ``target`` is done (WAIT_DONE): 1; ``until``
        passes: 0; the peer goes: <0. While asleep a flag in the peer's control words
        asks it to write its reclaim and done words back now."""
        cdef int64_t t = now_ns(), spin_end = t + (self.link.spin_ns if spin else 0)
        cdef int64_t next_check = t + PEER_CHECK_NS
        cdef int st, r
        cdef uint32_t i
        if spin:
            self.link.cnt.credit_waits += 1
        while True:
            if self._credit_ready(what, target):
                return 1
            if self.link.tp.assist() == 0:
                for i in range(64):
                    rm_cpu_relax()
            t = now_ns()
            if t >= next_check:
                st = self.link.peer_status()
                if st < 0:
                    return st
                next_check = t + PEER_CHECK_NS
            if t >= spin_end or t >= until:
                break
        self.link.set_flag(CTRL_CREDIT_WAIT, &self.link.credit_flag_set, True)
        rm_fence_seq_cst()
        self.link.tp.wake_peer()
        while True:
            if self._credit_ready(what, target):
                r = 1
                break
            st = self.link.peer_status()
            if st < 0:
                r = st
                break
            t = now_ns()
            if t >= until:
                r = 0
                break
            self.link.tp.n_sleeps += 1
            st = self.link.tp.wait(<int>((until - t) // 1000000) + 1)
            if st < 0 and st != RM_ERR_CLOSED:
                st = self.link.peer_status()
                if st < 0:
                    r = st
                    break
        self.link.set_flag(CTRL_CREDIT_WAIT, &self.link.credit_flag_set, False)
        return r

    # ---- an event loop's waits (docs/api.md, "Event loops") -------------------------

    def fileno(self) -> int:
        """A descriptor that turns readable when this channel may have something to
        deliver (messages, the peer closing or dying) or, after ``arm(send=True)``,
        when send credit returns. Call :meth:`arm` before every wait on it: it says
        whether to wait at all, and only an armed channel wakes the descriptor.
        Readiness may be spurious (look, then arm again). Stop watching it before
        ``close()``."""
        self.link.check_usable()
        return self.link.tp.event_fd()

    @property
    def poll_interval(self) -> float:
        """Seconds after which a wait on :meth:`fileno` should look again even if it
        stayed quiet: 0 (never) but on a verbs connection whose peer sends plain
        WRITEs (no completion event: ``RDMAMW_VERBS_EVENT=0``), as ``wait`` does."""
        return self.link.tp.poll_interval() if self.link.tp is not None else 0.0

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
        cdef int what = self.blocked_on
        cdef uint64_t target = 0
        link.check_owner()
        if link.closed or link.broken is not None or link.tp is None:
            return True
        if not send:
            with nogil:
                ready = self._arm_arrival(<int64_t>(spin_us * 1000.0))
            return ready
        if handle is not None:
            if not link.poll_done(handle.batch):
                return True         # a completion the NIC reports without an event: poll
            what, target = WAIT_DONE, handle.rndv
        with nogil:
            ready = self._arm_credit(what, target)
        return ready

    def disarm(self) -> None:
        """Lower the wake-up flags :meth:`arm` raised at the peer (it stops waking this
        side for every batch)."""
        cdef Link link = self.link
        if link.tp is None or link.closed or link.peer_gone:
            return
        with nogil:
            link.set_flag(CTRL_CREDIT_WAIT, &link.credit_flag_set, False)
            link.set_flag(CTRL_RX_SLEEP, &link.sleep_flag_set, False)
            link.tp.disarm_fd()

    cdef bint _arm_arrival(self, int64_t spin_ns) noexcept nogil:
        cdef int64_t end
        cdef uint32_t i
        self.link.tp.reap_wakeups()
        if self.rx.has_arrivals():
            return True
        if spin_ns > 0:
            end = now_ns() + spin_ns
            while True:
                if self.rx.has_arrivals():
                    return True
                if self.link.tp.assist() == 0:
                    for i in range(32):
                        rm_cpu_relax()
                if now_ns() >= end:
                    break
        if self.link.tp.arm_fd() < 0:
            return True
        self.link.cnt.arrival_waits += 1
        rm_spin_lock(&self.link.spin)
        if self.rx.unflushed():     # as before a sleep: the peer may wait for them
            self.rx.flush_locked()
        if not self.link.sleep_flag_set:
            self.link.put_word(RM_REGION_CTRL, CTRL_RX_SLEEP, &self.link.words[WORD_ONE])
            self.link.sleep_flag_set = True
        rm_spin_unlock(&self.link.spin)
        rm_fence_seq_cst()
        return self.rx.has_arrivals() or self.link.peer_status() < 0

    cdef bint _arm_credit(self, int what, uint64_t target) noexcept nogil:
        self.link.tp.reap_wakeups()
        if self._credit_ready(what, target):
            return True
        if self.link.tp.arm_fd() < 0:
            return True
        self.link.cnt.credit_waits += 1
        self.link.set_flag(CTRL_CREDIT_WAIT, &self.link.credit_flag_set, True)
        rm_fence_seq_cst()
        self.link.tp.wake_peer()         # the peer writes its reclaim and done words back now
        return self._credit_ready(what, target) or self.link.peer_status() < 0

    # ---- what SendHandles ask ------------------------------------------------------

    cdef bint handle_done(self, uint64_t batch, uint64_t rndv) except -1:
        self.link.check_owner()
        return self.link.poll_done(batch) and self.rs.poll(rndv)

    cdef int handle_wait(self, uint64_t batch, uint64_t rndv, object timeout) except -1:
        cdef Link link = self.link
        cdef int64_t deadline = deadline_of(timeout)
        cdef int st
        cdef bint first = True
        link.check_owner()
        while not link.poll_done(batch):
            if link.peer_gone:
                raise PeerLost(link.lost("peer lost before the batch completed"))
            if deadline and now_ns() > deadline:
                raise Timeout("send batch did not complete in time")
            with nogil:
                rm_cpu_relax()
        while not self.rs.poll(rndv):
            if deadline and now_ns() > deadline:
                raise Timeout("the receiver has not taken the batch's rendezvous messages")
            with nogil:     # ask the receiver for its done bits, as for free slots
                st = self._wait_credit(slice_end(deadline), first, WAIT_DONE, rndv)
            first = False
            if st < 0:
                self.rs.poll(rndv)
                if self.rs.upto >= rndv:
                    break
                link.raise_peer(st, "waiting for the rendezvous done bits")
            PyErr_CheckSignals()
        return 0

    # ---- receiving ----------------------------------------------------------------

    cdef Py_ssize_t _deliver(self, list out, Py_ssize_t maxn) except -1:
        cdef EagerReceiver rx = self.rx
        cdef Py_ssize_t got = 0
        cdef char *rndv
        cdef uint32_t opened = 0, slot
        cdef Dest dst
        while True:
            got = take_eager(self, out, got, maxn, &opened, &rndv)
            if rndv == NULL or got:     # a failing READ must not take earlier messages
                return got
            dst = self.rr.receive(rndv, None)
            out.append(new_message(self, <char *>dst.view.buf,
                                   <Py_ssize_t>self.rr.last_len, RM_NO_SLOT, dst))
            slot = rx.cur_slot
            rx.advance(DESC_BYTES, self.rr.last_len)
            rx.release_one(slot)
            got = 1

    cdef Py_ssize_t _deliver_into(self, Dest into) except -2:
        """The next message into ``into``: its length, or -1 if none has arrived."""
        cdef EagerReceiver rx = self.rx
        cdef char *base
        cdef uint32_t L, fl, slot
        cdef uint64_t n
        if not rx.peek(&base, &L, &fl):
            return -1
        if fl == REC_RNDV:
            self.rr.receive(base, into)
            n = self.rr.last_len
        else:
            if L > <uint64_t>into.view.len:
                raise BufferTooSmall(f"the next message is {L} bytes; the buffer holds "
                                     f"{into.view.len}", needed=L)
            memcpy(into.view.buf, base, L)
            n = L
        slot = rx.cur_slot
        rx.advance(L, n)
        rx.release_one(slot)
        return <Py_ssize_t>n

    def post_recv(self, buffer) -> None:
        """Post ``buffer`` (writable, C-contiguous: numpy array, bytearray, ...) as the
        destination of the next rendezvous message that has none yet. It is lent to the
        channel until that message was received (recv/recv_batch return a Message that
        views it); with ``rendezvous="write"`` the sender WRITEs straight into it."""
        cdef Dest d = new_dest(buffer)
        self.link.check_usable()
        self._lock(self.recv_lock)
        try:
            if not self.rndv_on:
                raise ValueError("rendezvous is off on this channel; nothing to post for")
            self.rr.post(d)
        finally:
            PyThread_release_lock(self.recv_lock)

    def recv_into(self, buffer, timeout=None) -> int:
        """Receive the next message into ``buffer`` (writable, C-contiguous) and return
        its length, like ``socket.recv_into``. A small message is copied out of the
        ring; a rendezvous message is READ straight into ``buffer``. Too small a buffer
        raises :class:`BufferTooSmall` (``.needed``) and the message stays receivable."""
        return self._recv(0, timeout, new_dest(buffer))

    cdef bint _spin_with_gil(self) noexcept:
        """Poll a few microseconds before giving up the GIL: a reply that is about to
        land (ping-pong) costs less than a GIL release and re-acquire."""
        cdef int64_t end = now_ns() + GIL_SPIN_NS
        cdef uint32_t i
        while True:
            if self.rx.has_arrivals():
                return True
            for i in range(16):
                rm_cpu_relax()
            if now_ns() >= end:
                return False

    cdef int _wait_arrival(self, int64_t until, bint spin) noexcept nogil:
        """Spin, then sleep, until something arrived (1), ``until`` passes (0), or
        the peer goes (<0). Before sleeping, unflushed releases are written back and
        a flag in the peer's control words asks it to wake us after publishing."""
        cdef int64_t t = now_ns(), spin_end = t + (self.link.spin_ns if spin else 0)
        cdef int64_t next_check = t + PEER_CHECK_NS
        cdef int st, r
        cdef uint32_t i
        while True:
            if self.rx.has_arrivals():
                return 1
            if rm_load_acquire64(&self.link.ctrl[CTRL_CREDIT_WAIT]) and self.rx.unflushed():
                self.rx.flush()
            if self.link.tp.assist() == 0:
                for i in range(32):
                    rm_cpu_relax()
            t = now_ns()
            if t >= next_check:
                st = self.link.peer_status()
                if st < 0:
                    return 1 if self.rx.has_arrivals() else st
                next_check = t + PEER_CHECK_NS
            if t >= spin_end or t >= until:
                break
        self.link.cnt.arrival_waits += 1
        rm_spin_lock(&self.link.spin)
        if self.rx.unflushed():
            self.rx.flush_locked()
        self.link.put_word(RM_REGION_CTRL, CTRL_RX_SLEEP, &self.link.words[WORD_ONE])
        self.link.sleep_flag_set = True
        rm_spin_unlock(&self.link.spin)
        rm_fence_seq_cst()
        while True:
            if self.rx.has_arrivals():
                r = 1
                break
            st = self.link.peer_status()
            if st < 0:
                r = 1 if self.rx.has_arrivals() else st
                break
            t = now_ns()
            if t >= until:
                r = 0
                break
            if rm_load_acquire64(&self.link.ctrl[CTRL_CREDIT_WAIT]) and self.rx.unflushed():
                self.rx.flush()
            self.link.tp.n_sleeps += 1
            self.link.tp.wait(<int>((until - t) // 1000000) + 1)
        rm_spin_lock(&self.link.spin)
        self.link.put_word(RM_REGION_CTRL, CTRL_RX_SLEEP, &self.link.words[WORD_ZERO])
        self.link.sleep_flag_set = False
        rm_spin_unlock(&self.link.spin)
        return r

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
        return self._recv(maxn, timeout, None)

    def recv(self, timeout=None) -> Message:
        """Receive one message (see :meth:`recv_batch`)."""
        return self._recv(1, timeout, None)[0]

    cdef object _recv(self, Py_ssize_t maxn, object timeout, Dest into):
        cdef Link link = self.link
        cdef int64_t deadline
        cdef int st
        cdef bint first_wait = True
        cdef list out = []
        cdef Py_ssize_t n
        link.check_owner()
        if link.broken is not None:
            raise ProtocolError(link.broken)
        if self.rx is None:
            raise ChannelClosed("channel is closed")
        deadline = deadline_of(timeout)
        self._lock(self.recv_lock)
        self.rr.rx_until = deadline
        try:
            while True:
                if link.broken is not None:
                    raise ProtocolError(link.broken)
                if into is None:
                    if self._deliver(out, maxn):
                        if self.rx.done_unflushed:  # one done write-back per call
                            self.rx.flush()
                        return out
                else:
                    n = self._deliver_into(into)
                    if n >= 0:
                        if self.rx.done_unflushed:
                            self.rx.flush()
                        return n
                if link.closed:
                    raise ChannelClosed("channel is closed")
                if timeout is not None and deadline <= now_ns():
                    st = link.peer_status()
                    if st < 0:
                        link.raise_peer(st, "receive")
                    raise Timeout("no message within the timeout")
                if first_wait and self._spin_with_gil():
                    first_wait = False
                    continue
                with nogil:
                    st = self._wait_arrival(slice_end(deadline), first_wait)
                first_wait = False
                if st < 0:
                    link.raise_peer(st, "receive")
                if st == 0:
                    PyErr_CheckSignals()
        finally:
            PyThread_release_lock(self.recv_lock)

    # ---- lifetime and introspection ------------------------------------------------

    def close(self) -> None:
        """Close this endpoint; the peer sees :class:`ChannelClosed` once it has
        received what was sent. Messages already received stay readable."""
        cdef Link link = self.link
        cdef int64_t until
        if link.closed:
            return
        if link.inherited():
            link.closed = True      # a fork child: the connection is the parent's
            return
        if self.rs.released < self.rs.next:
            # the receiver may still be READing our sources: give it a bounded time
            until = now_ns() + CLOSE_RNDV_NS
            while not self.rs.poll(self.rs.next) and now_ns() < until:
                with nogil:
                    if self._wait_credit(slice_end(until), False, WAIT_DONE,
                                         self.rs.next) < 0:
                        break
            self.rs.upto = self.rs.next     # give the sources back regardless
            self.rs.release()
        link.closed = True
        while self.rr.posted:
            self.rr.drop_posted()
        for cache in (self._regcache, self._regcache_dst):
            if self.cache_ok and cache is not None:
                cache.close()       # idle MRs go now, those still leased when released
        with nogil:
            rm_spin_lock(&link.spin)
            if not link.peer_gone:
                if self.rx.unflushed():
                    self.rx.flush_locked()
                link.put_word(RM_REGION_CTRL, CTRL_CLOSED, &link.words[WORD_ONE])
                rm_fence_seq_cst()
                link.tp.wake_peer()
            rm_spin_unlock(&link.spin)
        link.tp.close()
        self.rr.end_read()          # a READ left in flight: nothing writes into it now

    def stats(self) -> dict:
        """Counters of this endpoint; everything that hit the transport is counted."""
        cdef Link link = self.link
        d = {
            "messages": link.cnt.msgs_sent,
            "batches": link.cnt.batches,
            "bytes": link.cnt.bytes_sent,
            "slots_sent": link.cnt.slots_sent,
            "messages_received": link.cnt.msgs_recv,
            "bytes_received": link.cnt.bytes_recv,
            "slots_received": link.cnt.slots_recv,
            "reclaim_writebacks": link.cnt.reclaim_wb,
            "credit_waits": link.cnt.credit_waits,
            "arrival_sleeps": link.cnt.arrival_waits,
            "free_send_slots": self.tx.sbm.count_free() if self.tx is not None else 0,
            "rndv_sends": link.cnt.rndv_sends,
            "rndv_writes": link.cnt.rndv_writes,
            "rndv_bytes": link.cnt.rndv_bytes,
            "rndv_received": link.cnt.rndv_recv,
            "rndv_reads": link.cnt.rndv_reads,
            "rndv_bytes_received": link.cnt.rndv_bytes_recv,
            "rndv_done_writebacks": link.cnt.done_wb,
            "rndv_refused": link.cnt.rndv_refused,
        }
        if link.tp is not None:
            d.update(link.tp.counters())
        return d

    def diagnostics(self) -> dict:
        """The engine's sequence numbers, bitmap words, control words and rendezvous
        state, for diagnosing a stuck channel (docs/api.md, "Diagnostics"); the keys
        may change between versions, unlike ``stats()``'s."""
        cdef Link link = self.link
        cdef EagerReceiver rx = self.rx
        cdef uint32_t i, held = 0
        if rx is None:
            return {"peer_gone": link.peer_gone, "transport_error": None}
        for i in range(rx.nslots):
            if rx.slot_refs[i]:
                held += 1
        return {
            "send_seq": self.tx.send_seq, "recv_seq": rx.recv_seq,
            "unflushed": rx.rbm.unflushed, "slots_held": held,
            "ready_len": rx.ready_len, "cur_left": rx.cur_left,
            "pending": rx.rbm.pending_slots(),
            "free_send_slots": self.tx.sbm.count_free(),
            "ctrl": [link.ctrl[0], link.ctrl[8], link.ctrl[16]],
            "arrival": list(rx.rbm.arrival_words), "consumed": list(rx.rbm.consumed_words),
            "reclaim_shadow": list(rx.rbm.reclaim_words),
            "send_arrival_shadow": list(self.tx.sbm.arrival_words),
            "send_reclaim_seen": list(self.tx.sbm.reclaim_words),
            "rndv_next": self.rs.next, "rndv_upto": self.rs.upto,
            "rndv_released": self.rs.released, "rrndv_next": self.rr.next,
            "rndv_read_done": link.read_done, "rndv_read_status": link.read_status,
            "peer_gone": link.peer_gone,
            "ring": {"address": <size_t>rx.ring, "stride": rx.stride, "slots": rx.nslots},
            "transport_error": link.tp.error_detail(),
        }

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
        self.link.peer = value

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
            self.batch.regcache = cache if self.cache_ok else None

    @property
    def regcache_dst(self):
        return self._regcache_dst

    @regcache_dst.setter
    def regcache_dst(self, cache):
        self._regcache_dst = cache
        if self.rr is not None:
            self.rr.regcache_dst = cache if self.cache_ok else None

    @property
    def allocate(self):
        return self.rr.allocate if self.rr is not None else None

    @allocate.setter
    def allocate(self, fn):
        if self.rr is None:
            raise ChannelClosed("the channel is not set up yet")
        self.rr.allocate = fn
