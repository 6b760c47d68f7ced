# cython: freethreading_compatible = False
"""The one wait loop of an endpoint: spin, ask the peer to wake us, sleep, re-check,
until the deadline.

Every wait of the engine goes through :meth:`Waiter.wait` (or, for an event loop,
:meth:`Waiter.arm`): a sender out of slots (WAIT_SLOTS), of rendezvous entries
(WAIT_ENTRY) or waiting for a rendezvous message to be done (WAIT_DONE), and a
receiver waiting for arrivals (WAIT_ARRIVAL). What differs by what is waited for is
only the condition and the flag raised at the peer before sleeping: CTRL_CREDIT_WAIT
(the peer writes its reclaim and done words back at once) or CTRL_RX_SLEEP (the peer
wakes us after each publish; our releases not yet written back go first)."""

cimport cython
from cpython.exc cimport PyErr_CheckSignals

from rdmamw.engine._frames cimport (
    CTRL_CREDIT_WAIT,
    WAIT_ARRIVAL,
    WAIT_DONE,
    WAIT_READ,
    WAIT_SLOTS,
)
from rdmamw.engine._link cimport PEER_CHECK_NS
from rdmamw.engine._trace cimport (
    TR_ARRIVAL_WAIT,
    TR_CREDIT_WAIT,
    TR_READ_WAIT,
    rm_trace_on,
    rm_trace_put,
)
from rdmamw.transport._base cimport RM_ERR_CLOSED, now_ns
from rdmamw.transport.atomics cimport rm_cpu_relax, rm_fence_seq_cst, rm_load_acquire64


from rdmamw.errors import PeerLost, Timeout

cdef int GRANT_ASK_MS = 20     # a sender short of granted slots asks again this often
cdef int READ_NAP_MS = 1       # a READ's wait sleeps this long at most (a READ's
                               # completion wakes nobody on verbs: it is looked for)
cdef int64_t READ_SPIN_NS = 1000000    # ... and spins this long more than spin_us

cdef extern from "sched.h" nogil:
    int sched_yield()


@cython.final
cdef class Waiter:
    """The waits of one endpoint, over the units whose state they wait on."""

    def __cinit__(self, Link link, EagerSender tx, RndvSender rs, EagerReceiver rx):
        self.link, self.tx, self.rs, self.rx = link, tx, rs, rx

    cdef bint ready(self, int what, uint64_t target) noexcept nogil:
        cdef uint64_t done
        cdef int status
        if what == WAIT_ARRIVAL:
            return self.rx.has_arrivals()
        if what == WAIT_READ:       # the READ whose wr index is target completed
            self.link.reap()
            self.link.read_result(&done, &status)
            return done == target
        if what == WAIT_SLOTS:
            return self.tx.sbm.count_free() != 0 or self.tx.take_grant()
        return self.rs.ready(what, target)

    cdef int spin(self, int what, uint64_t target, int64_t until, uint32_t relax) noexcept nogil:
        """Look until ready (1), ``until`` passes (0) or the peer goes (<0), with
        ``relax`` pauses between looks when the transport has nothing to help with.
        A waiting receiver writes its releases back when the peer asks for them."""
        cdef int64_t t, next_check = now_ns() + PEER_CHECK_NS
        cdef int st
        cdef uint32_t _i
        while True:
            if self.ready(what, target):
                return 1
            self._serve(what)
            if what == WAIT_READ:
                sched_yield()   # the answer needs CPU here too (tcp's progress thread)
            elif self.link.assist() == 0:
                for _i in range(relax):
                    rm_cpu_relax()
            t = now_ns()
            if t >= next_check:
                st = self.link.peer_status()
                if st < 0:      # what arrived before the peer went is still delivered
                    return 1 if what == WAIT_ARRIVAL and self.ready(what, target) else st
                next_check = t + PEER_CHECK_NS
            if t >= until:
                return 0

    cdef int wait(self, int what, uint64_t target, int64_t until, bint spin,
                  bint keep=False, bint closer=False) noexcept nogil:
        """Until ``what`` (``target``: the rendezvous index of WAIT_DONE) is ready: 1;
        ``until`` passes: 0; the peer goes: <0. ``spin``: the first wait of a call,
        which spins spin_us before it sleeps. ``keep`` (a receive's slice): when
        ``until`` passes, the sleep flag stays raised for the next slice, so an idle
        receiver does not write it down and up at the peer every slice; the caller
        lowers it with lower() when the call ends. A wait ends when another thread
        closes the channel, but close()'s own (``closer``).

        A sender's wait (slots, an entry, done bits; not close()'s) adds its time to
        ``credit_wait_ns``: one clock read more, only here, where a send already waits."""
        cdef int64_t t = now_ns()
        cdef int r = self._wait(what, target, until, spin, keep, closer, t)
        if what < WAIT_ARRIVAL and not closer:
            self.link.cnt.credit_wait_ns += <uint64_t>(now_ns() - t)
        if rm_trace_on(self.link.trace):
            rm_trace_put(self.link.trace, TR_CREDIT_WAIT if what < WAIT_ARRIVAL else
                         TR_ARRIVAL_WAIT if what == WAIT_ARRIVAL else TR_READ_WAIT,
                         self.link.serial, t, now_ns(), <uint64_t>what, closer, target,
                         <uint32_t>r)
        return r

    cdef int _wait(self, int what, uint64_t target, int64_t until, bint spin, bint keep,
                   bint closer, int64_t t) noexcept nogil:
        """:meth:`wait`, from ``t`` (now)."""
        cdef int st, r, ms
        cdef bint asked = False
        cdef uint64_t seen
        cdef int64_t spin_ns = self.link.spin_ns
        if spin and what < WAIT_ARRIVAL:
            self.link.cnt.credit_waits += 1
        if what == WAIT_READ:       # the answer of a READ comes soon: spin longer
            spin_ns += READ_SPIN_NS
        r = self.spin(what, target, min(until, t + spin_ns) if spin else t,
                      32 if what == WAIT_ARRIVAL else 64)
        if r != 0:
            if self.arrival_up and what == WAIT_ARRIVAL:
                self.lower()
            return r
        if not (self.arrival_up and what == WAIT_ARRIVAL):
            self._flag(what, True)
        while True:
            seen = self.link.sleep_gen()
            if self.ready(what, target):
                r = 1
                break
            st = self.link.peer_status()
            if st < 0:
                r = 1 if what == WAIT_ARRIVAL and self.ready(what, target) else st
                break
            t = now_ns()
            if t >= until or (self.link.closed and not closer):
                r = 0           # (closed by another thread: the caller ends the call)
                break
            self._serve(what)
            ms = <int>((until - t) // 1000000) + 1
            if what == WAIT_READ:
                ms = min(ms, READ_NAP_MS)
            if what == WAIT_SLOTS and self.tx.sbm.usable < self.tx.peer_nslots:
                # a ring that grows: _flag's wake-up asked the peer for more slots;
                # ask again each GRANT_ASK_MS in case that request found no room
                if asked:
                    self.link.wake_peer()
                asked = True
                ms = min(ms, GRANT_ASK_MS)
            st = self.link.sleep(ms, seen)
            if self.link.closed and not closer:     # (its close woke us)
                r = 0
                break
            if st < 0 and st != RM_ERR_CLOSED:
                st = self.link.peer_status()
                if st < 0:
                    r = 1 if what == WAIT_ARRIVAL and self.ready(what, target) else st
                    break
        if r == 0 and keep and what == WAIT_ARRIVAL:
            self.arrival_up = True
            return r
        self.arrival_up = False
        self._flag(what, False)
        return r

    cdef void waited(self, uint64_t ns) noexcept nogil:
        """A sender waited ``ns`` outside :meth:`wait` (an event loop's, after arm())."""
        self.link.cnt.credit_wait_ns += ns

    cdef void lower(self) noexcept nogil:
        """Lower a sleep flag kept raised between slices (the receive is over)."""
        if self.arrival_up:
            self.arrival_up = False
            self._flag(WAIT_ARRIVAL, False)

    cdef bint arm(self, int what, uint64_t target, int64_t spin_ns) noexcept nogil:
        """An event loop's wait (Engine.arm): check, arm the transport's descriptor,
        raise the flag, check again. True: no need to wait."""
        self.link.reap_wakeups()
        if self.ready(what, target):
            return True
        if spin_ns > 0 and self.spin(what, target, now_ns() + spin_ns, 32) != 0:
            return True
        if self.link.arm_fd() < 0:
            return True
        if what != WAIT_ARRIVAL:
            self.link.cnt.credit_waits += 1
        self._flag(what, True)
        return self.ready(what, target) or self.link.peer_status() < 0

    cdef void disarm(self) noexcept nogil:
        self.link.credit_flag(False)
        self.link.sleep_flag(False)
        self.link.disarm_fd()

    cdef void _serve(self, int what) noexcept nogil:
        """A waiting receiver writes its releases back when the peer asks for them."""
        if what == WAIT_ARRIVAL and rm_load_acquire64(&self.link.ctrl[CTRL_CREDIT_WAIT]) \
                and self.rx.unflushed():
            self.rx.flush()

    cdef void _flag(self, int what, bint up) noexcept nogil:
        """Raise (before a sleep) or lower (after) what makes the peer wake us (a
        READ's answer needs no flag: tcp wakes us when it lands, verbs is looked at)."""
        if what == WAIT_READ:
            return
        if what != WAIT_ARRIVAL:
            # raised, with the wake-up: the peer writes its reclaim and done words now
            # (short of slots of a ring that grows: the flag names the slots needed)
            self.link.credit_flag(up, self.tx.ask if what == WAIT_SLOTS else 0)
            return
        if not up:
            self.link.sleep_flag(False)
            return
        self.link.cnt.arrival_waits += 1
        self.link.lock()
        if self.rx.unflushed():         # the peer may be waiting for them
            self.rx.flush_locked()
        self.link.sleep_flag_locked(True)
        self.link.unlock()
        rm_fence_seq_cst()

    cdef int handle(self, uint64_t batch, uint64_t rndv, int64_t deadline) except -1:
        """SendHandle.wait(): until chain ``batch`` completed and the first ``rndv``
        rendezvous messages are done (their done bits back), or ``deadline``."""
        cdef Link link = self.link
        cdef int st, first = True
        while not link.poll_done(batch):
            if link.peer_gone:
                raise PeerLost(link.lost("peer lost before the batch completed"))
            if deadline and now_ns() > deadline:
                raise Timeout("send batch did not complete in time")
            with nogil:
                rm_cpu_relax()
        while not self.rs.poll(rndv):
            if deadline and now_ns() > deadline:   # (done bits just before its end count)
                if link.peer_status() >= 0 or not self.rs.poll(rndv):
                    link.raise_if_gone("waiting for the rendezvous done bits")
                    raise Timeout("the receiver has not taken the batch's rendezvous messages")
                break
            with nogil:     # ask the receiver for its done bits, as for free slots
                st = self.wait(WAIT_DONE, rndv, link.wait_until(deadline), first)
            first = False
            if st < 0:
                self.rs.poll(rndv)
                if self.rs.upto >= rndv:
                    break
                link.raise_peer(st, "waiting for the rendezvous done bits")
            PyErr_CheckSignals()
            if link.closed and not self.rs.poll(rndv):
                link.refuse()
        return 0
