# cython: freethreading_compatible = False
"""The connection under one endpoint: its transport, the control words both ways, the
lock every post takes, the completion queue, and whether the peer is still there.

Every other unit of the engine holds the Link; it owns the state they share, so each
of them owns only its own (docs/architecture.md, "The engine")."""

cimport cython
from libc.stdlib cimport calloc, free

from rdmamw.engine._frames cimport (
    CTRL_CLOSED,
    CTRL_CREDIT_WAIT,
    CTRL_MAX_MSG,
    CTRL_RX_SLEEP,
    RM_RNDV_WRID,
    WORD_ASK,
    WORD_MAX_MSG,
    WORD_ONE,
    WORD_ZERO,
)
from rdmamw.engine._trace cimport (
    TR_COMPLETED,
    TR_SLEEP,
    rm_trace_on,
    rm_trace_put,
    rm_trace_put_chan,
)
from rdmamw.transport._base cimport (
    current_pid,
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_OS,
    RM_ERR_PEER_LOST,
    RM_ERR_UNSUPPORTED,
    RM_OK,
    RM_REGION_CTRL,
    RM_REGION_RING,
)
from rdmamw.transport.atomics cimport (
    rm_fence_seq_cst,
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_unlock,
)

import logging
import os
import threading

from rdmamw import _fork
from rdmamw.errors import ChannelClosed, MessageTooLarge, PeerLost, ProtocolError

_log = logging.getLogger("rdmamw.channel")

cdef extern from "rm_sleepers.h" nogil:
    enum:
        RM_SLEEP_POLL, RM_SLEEP_LOOK
    int rm_sleepers_enter(rm_sleepers *s, uint64_t seen, int ms)
    void rm_sleepers_polled(rm_sleepers *s)


cdef int64_t DYING_NS = 200000000       # a refused READ: how long to look for the peer's death


cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    pthread_t pthread_self()

cdef pthread_t _main_thread = <pthread_t>threading.main_thread().ident


def _main_thread_in_child() -> None:
    global _main_thread
    _main_thread = pthread_self()   # the thread that forked is the child's only one


os.register_at_fork(after_in_child=_main_thread_in_child)


# off the main thread (no signal handlers run there), over a transport whose close wakes
# its sleepers: how long one sleep may last (an hour; a bound for wait()'s timeout_ms)
cdef int64_t LONG_SLICE_NS = 3600 * <int64_t>1000000000


cdef bint on_main_thread() noexcept nogil:
    """Python runs signal handlers on its main thread only: the one thread whose waits
    must come back to the interpreter every SLICE_NS."""
    return pthread_self() == _main_thread


cdef int64_t deadline_of(object timeout) except -1:
    """now + ``timeout`` seconds in now_ns() time; 0 for None (no deadline)."""
    if timeout is None:
        return 0
    t = float(timeout)
    if t < 0:
        raise ValueError("timeout must be >= 0 or None")
    return now_ns() + <int64_t>(t * 1e9) + 1


# the timeline's records (rdmamw/include/rm_trace.h): one per process, every Link
# points at it; rdmamw.engine._engine starts and stops it
cdef rm_trace _trace
cdef uint64_t _serials = 0


cdef rm_trace *trace_state() noexcept nogil:
    return &_trace


cdef inline void take_completions(Link self) noexcept nogil:
    """reap()'s part under its lock: the transport's completions into batch_done (a
    chain's) or read_done (a READ's)."""
    cdef int i, k
    while True:
        k = self.tp.poll(self.wcs, 64)
        if k <= 0:
            break
        for i in range(k):
            if self.wcs[i].wr_id & RM_RNDV_WRID:        # a rendezvous READ (receiver)
                self.read_status = self.wcs[i].status
                self.read_done = self.wcs[i].wr_id & ~RM_RNDV_WRID
                continue
            if self.wcs[i].status != 0:
                self.peer_gone = True
            if self.wcs[i].wr_id > self.batch_done:
                self.batch_done = self.wcs[i].wr_id
        if k < 64:      # fewer than asked for: none were left (no second poll)
            break


@cython.final
cdef class Link:
    """The transport and control words of one endpoint, shared by its units."""

    def __cinit__(self):
        self.words = <uint64_t *>calloc(8, 8)
        if self.words == NULL:
            raise MemoryError()
        self.words[1] = 1
        if rm_sleepers_init(&self.sleepers) != 0:
            free(self.words)
            self.words = NULL
            raise MemoryError()
        self.sleepers_ok = True
        self.closed = True          # until attach() and the engine's set-up succeed
        self.pid_now = current_pid()
        self.owner_pid = self.pid_now[0]
        global _serials
        _serials += 1
        self.serial = _serials
        self.trace = &_trace

    def __dealloc__(self):
        free(self.words)
        if self.sleepers_ok:
            rm_sleepers_destroy(&self.sleepers)

    cdef int attach(self, Transport tp, double spin_us) except -1:
        self.tp = tp
        self.owner_pid = tp.owner_pid
        self.ctrl = <uint64_t *>tp.local[RM_REGION_CTRL].addr
        self.lkey_words = tp.register_local(<size_t>self.words, 64)
        self.spin_ns = <int64_t>(spin_us * 1000.0)
        return 0

    cdef int check_rings(self, uint32_t nslots, uint64_t stride, uint32_t peer_nslots,
                         uint64_t peer_stride) except -1:
        """The transport's ring regions hold the rings (rdmamw/transport/layout.py)."""
        if self.tp.local[RM_REGION_RING].length < <uint64_t>nslots * stride:
            raise ValueError("transport ring region is smaller than the ring")
        if self.tp.peer[RM_REGION_RING].length < <uint64_t>peer_nslots * peer_stride:
            raise ValueError("peer ring region is smaller than its ring")
        return self.tp.set_rings(nslots, stride, peer_nslots, peer_stride)

    cdef object region_view(self, int region):
        """Writable view of one of my regions (the units wire their bitmaps to it)."""
        return self.tp._region_view(region)

    cdef object register_local(self, size_t addr, size_t length):
        return self.tp.register_local(addr, length)

    cdef int set_peer(self, object peer) except -1:
        self.peer = peer
        return 0

    cdef int open(self) except -1:
        """The engine's set-up succeeded: the channel is usable."""
        self.closed = False
        return 0

    cdef int shut(self) except -1:
        """No more sends or receives on this side (close(); in a fork child that is
        all: the connection is the parent's, rdmamw/_fork.py)."""
        self.closed = True
        return 0

    cdef int64_t wait_until(self, int64_t deadline) noexcept nogil:
        """Where the next sleep of a wait that ends at ``deadline`` (0: never) stops:
        after SLICE_NS on the main thread, for its signal handlers, and with a transport
        whose close() does not wake its sleepers; elsewhere at the deadline (or after
        LONG_SLICE_NS), so an idle thread does not wake 20 times a second to look."""
        cdef int64_t t
        if self.tp is None or not self.tp.close_wakes or on_main_thread():
            return slice_end(deadline)
        t = now_ns() + LONG_SLICE_NS
        return deadline if deadline and deadline < t else t

    cdef int end(self) except -1:
        """close()'s last step: the transport goes (and wakes whoever sleeps in it)."""
        self.tp.close()
        self.ended = True
        return 0

    cdef void announce_closed(self) noexcept nogil:
        """Tell the peer this side closed cleanly (CTRL_CLOSED) and wake it; the
        caller holds the post lock, so what it wrote back before goes first."""
        if self.peer_gone:
            return
        self.put_word(RM_REGION_CTRL, CTRL_CLOSED, &self.words[WORD_ONE])
        rm_fence_seq_cst()
        self.tp.wake_peer()

    cdef int refuse(self) except -1:
        """Raise what check_usable() found (its slow path): the fork child's error,
        the protocol error that broke the channel, or that it is closed."""
        if self.inherited():
            _fork.refuse("channel", self.owner_pid)
        if self.broken is not None:
            raise ProtocolError(self.broken)
        if self.closed:
            raise ChannelClosed("this side closed the channel")
        return 0

    cdef int put_word(self, uint32_t region, uint32_t word, uint64_t *src) noexcept nogil:
        cdef rm_wr wr
        fill_wr(&wr, src, self.lkey_words, region, word * 8, 8)
        self.cnt.word_writes += 1
        return self.tp.post(&wr, 1)

    cdef int announce_max_msg(self, uint64_t max_msg) except -1:
        """Write the largest message this side takes into the peer's CTRL_MAX_MSG."""
        self.words[WORD_MAX_MSG] = max_msg
        self.put_word(RM_REGION_CTRL, CTRL_MAX_MSG, &self.words[WORD_MAX_MSG])
        return 0

    cdef void credit_flag(self, bint up, uint32_t ask=0) noexcept nogil:
        """Raise (1) or lower (0) CTRL_CREDIT_WAIT at the peer: a sender out of slots
        (or rendezvous entries) asks for the reclaim and done words now. Raised, the
        word is ``ask`` when more than 1 (the slots of a ring that grows the sender
        needs granted in total, docs/protocol.md "Rings that grow"), and the peer is
        woken to read it, in one doorbell where the transport can (put_wake)."""
        cdef rm_wr wr
        self.lock()
        if self.credit_flag_set != up:
            if up:
                self.words[WORD_ASK] = ask if ask > 1 else 1
                fill_wr(&wr, &self.words[WORD_ASK], self.lkey_words, RM_REGION_CTRL,
                        CTRL_CREDIT_WAIT * 8, 8)
                self.cnt.word_writes += 1
                self.tp.put_wake(&wr)
                rm_fence_seq_cst()      # raised before the caller looks again
                self.credit_flag_ns = now_ns()
            else:
                self.put_word(RM_REGION_CTRL, CTRL_CREDIT_WAIT, &self.words[WORD_ZERO])
            self.credit_flag_set = up
        elif up:
            self.tp.wake_peer()
        self.unlock()

    cdef void sleep_flag(self, bint up) noexcept nogil:
        self.lock()
        self.sleep_flag_locked(up)
        self.unlock()

    cdef void sleep_flag_locked(self, bint up) noexcept nogil:
        """Raise (1) or lower (0) CTRL_RX_SLEEP at the peer: a receiver about to sleep
        asks to be woken after each publish (caller holds the post lock)."""
        if self.sleep_flag_set != up:
            self.put_word(RM_REGION_CTRL, CTRL_RX_SLEEP, &self.words[1 if up else 0])
            self.sleep_flag_set = up
            if up:
                self.sleep_flag_ns = now_ns()

    cdef void read_result(self, uint64_t *done, int *status) noexcept nogil:
        """The last rendezvous READ completed and its status, as one completion's."""
        rm_spin_lock(&self.reap_lock)
        done[0], status[0] = self.read_done, self.read_status
        rm_spin_unlock(&self.reap_lock)

    cdef void mark_lost(self) noexcept nogil:
        self.peer_gone = True

    # ---- the transport's calls of a waiting thread --------------------------------

    cdef int sleep(self, int timeout_ms, uint64_t seen) noexcept nogil:
        """Block in the transport until woken or ``timeout_ms`` pass (counted); ``seen``:
        sleep_gen() before the caller's last look. One thread sleeps in the transport,
        the others wait for its return (rdmamw/include/rm_sleepers.h): a wake-up one
        thread takes is never lost to another. 1: look again; 0: timed out; <0: the
        transport's error."""
        cdef int r = rm_sleepers_enter(&self.sleepers, seen, timeout_ms)
        if r != RM_SLEEP_POLL:
            return 1 if r == RM_SLEEP_LOOK else 0
        cdef int64_t t0 = 0
        self.cnt.sleeps += 1
        if rm_trace_on(self.trace):
            t0 = now_ns()
        r = self.tp.wait(timeout_ms)
        rm_sleepers_polled(&self.sleepers)
        if t0:
            rm_trace_put(self.trace, TR_SLEEP, self.serial, t0, now_ns(), <uint64_t>timeout_ms,
                         0, 0, <uint32_t>r)
        return r

    cdef int arm_fd(self) noexcept nogil:
        return self.tp.arm_fd()

    cdef void disarm_fd(self) noexcept nogil:
        self.tp.disarm_fd()

    cdef void reap_wakeups(self) noexcept nogil:
        self.tp.reap_wakeups()

    cdef object event_fd(self):
        return self.tp.event_fd()

    cdef double poll_interval(self):
        return self.tp.poll_interval() if self.tp is not None else 0.0

    cdef dict counters(self):
        """The transport's counters, and the sleeps this Link counted (the engine
        decides to sleep; the transport only waits)."""
        if self.tp is None:
            return {}
        d = self.tp.counters()
        d["sleeps"] = self.cnt.sleeps
        return d

    cdef dict stats(self):
        """The counters by their names in ``stats()`` (the names are API), and the
        transport's."""
        d = {
            "messages": self.cnt.msgs_sent,
            "batches": self.cnt.batches,
            "bytes": self.cnt.bytes_sent,
            "slots_sent": self.cnt.slots_sent,
            "messages_received": self.cnt.msgs_recv,
            "bytes_received": self.cnt.bytes_recv,
            "slots_received": self.cnt.slots_recv,
            "reclaim_writebacks": self.cnt.reclaim_wb,
            "control_writes": self.cnt.word_writes,
            "credit_waits": self.cnt.credit_waits,
            "credit_wait_seconds": self.cnt.credit_wait_ns / 1e9,
            "arrival_sleeps": self.cnt.arrival_waits,
            "rndv_sends": self.cnt.rndv_sends,
            "rndv_writes": self.cnt.rndv_writes,
            "rndv_bytes": self.cnt.rndv_bytes,
            "rndv_received": self.cnt.rndv_recv,
            "rndv_reads": self.cnt.rndv_reads,
            "rndv_bytes_received": self.cnt.rndv_bytes_recv,
            "rndv_done_writebacks": self.cnt.done_wb,
            "rndv_refused": self.cnt.rndv_refused,
        }
        d.update(self.counters())
        return d

    cdef dict diagnostics(self):
        return {
            "ctrl": [self.ctrl[0], self.ctrl[8], self.ctrl[16]],
            "rndv_read_done": self.read_done, "rndv_read_status": self.read_status,
            "peer_gone": self.peer_gone, "transport_error": self.error_detail(),
            "waiting": self.waiting(),
        }

    cdef dict waiting(self):
        """What this side sleeps waiting for from the peer now, and for how many
        seconds: "credit" (a send: free slots, rendezvous entries or done bits),
        "arrival" (a receive); a wait still spinning is not shown."""
        cdef int64_t t = now_ns()
        d = {}
        if self.credit_flag_set:
            d["credit"] = (t - self.credit_flag_ns) / 1e9
        if self.sleep_flag_set:
            d["arrival"] = (t - self.sleep_flag_ns) / 1e9
        return d

    cdef object error_detail(self):
        return self.tp.error_detail() if self.tp is not None else None

    cdef bint peer_closing(self) noexcept nogil:
        return self.peer_gone or rm_load_acquire64(&self.ctrl[CTRL_CLOSED]) != 0

    cdef int peer_status(self) noexcept nogil:
        """RM_OK while the peer is there; RM_ERR_CLOSED / RM_ERR_PEER_LOST after."""
        cdef int st
        if self.peer_gone:
            return RM_ERR_PEER_LOST
        if rm_load_acquire64(&self.ctrl[CTRL_CLOSED]):
            return RM_ERR_CLOSED
        st = self.tp.peer_state()
        if st == RM_ERR_CLOSED or rm_load_acquire64(&self.ctrl[CTRL_CLOSED]):
            return RM_ERR_CLOSED
        if st < 0:
            self.peer_gone = True
            return RM_ERR_PEER_LOST
        return RM_OK

    cdef int peer_dying(self) noexcept nogil:
        """After a refused READ: is the peer dying? A process killed mid-READ may have
        its memory registrations torn down before its connection shows EOF (verbs: the
        NIC answers 'remote access error' and the QP fails), so while our connection is
        failed but the peer's end not yet seen closed, look for up to DYING_NS."""
        cdef int64_t until = now_ns() + DYING_NS
        while not self.tp.peer_exited():
            if self.tp.peer_state() >= 0 or now_ns() >= until:
                return RM_OK        # (a connection still up: the peer refused, alive)
            self.sleep(10, self.sleep_gen())     # one sleeper in the transport
        self.peer_gone = True
        return RM_ERR_PEER_LOST

    cdef void reap(self) noexcept nogil:
        """Take the transport's completions: a chain's (batch_done) or a READ's."""
        cdef uint64_t before
        cdef int64_t t
        rm_spin_lock(&self.reap_lock)
        before = self.batch_done
        take_completions(self)
        if rm_trace_on(self.trace) and self.batch_done != before:
            t = now_ns()
            rm_trace_put_chan(self.trace, TR_COMPLETED, self.serial, t, t, 0, 0,
                              self.batch_done, 0, 0)
        rm_spin_unlock(&self.reap_lock)

    cdef void reap_posted(self, uint64_t chain) noexcept nogil:
        """reap() right after a sender posted ``chain``: when it completes just that
        chain (shm, tcp: within the post), no record says so; the batch's own does
        (SendBatch.put_batch: its last chain done by the end of its posting)."""
        cdef uint64_t before
        cdef int64_t t
        rm_spin_lock(&self.reap_lock)
        before = self.batch_done
        take_completions(self)
        if (rm_trace_on(self.trace) and self.batch_done != before
                and not (before + 1 == chain and self.batch_done == chain)):
            t = now_ns()
            rm_trace_put_chan(self.trace, TR_COMPLETED, self.serial, t, t, 0, 0,
                              self.batch_done, 0, 0)
        rm_spin_unlock(&self.reap_lock)

    cdef bint poll_done(self, uint64_t batch) noexcept:
        if self.batch_done < batch:
            with nogil:
                self.reap()
        return self.batch_done >= batch

    # ---- the errors that end a channel --------------------------------------------

    cdef int fail(self, str why) except -1:
        """The peer broke the protocol: the channel is unusable from now on."""
        self.broken = why
        raise ProtocolError(why)

    cdef int raise_post(self, int rc) except -1:
        if rc == RM_ERR_BOUNDS:
            self.broken = "a work request fell outside the peer's registered regions"
            raise ProtocolError(self.broken)
        if rc == RM_ERR_CLOSED and self.closed:
            raise ChannelClosed("channel was closed during the send")
        if rc == RM_ERR_UNSUPPORTED or rc == RM_ERR_OS:
            raise MessageTooLarge(f"the transport could not expose a rendezvous source ({rc})")
        self.peer_gone = True
        raise PeerLost(self.lost(f"the transport failed the post ({rc})"))

    cdef int raise_peer(self, int st, str where) except -1:
        if st == RM_ERR_CLOSED:
            raise ChannelClosed(f"the peer closed the channel ({where})")
        raise PeerLost(self.lost(f"peer lost ({where})"))

    cdef int raise_if_gone(self, str where) except -1:
        """raise_peer if the peer is gone (a look, no wait: a call whose deadline passed
        says the peer's end, not Timeout, even at timeout=0, as rdmamw.aio polls)."""
        cdef int st = self.peer_status()
        if st < 0:
            self.raise_peer(st, where)
        return 0

    cdef str lost(self, str what):
        """``what``, with the provider's account of the failure when it has one."""
        detail = self.error_detail()
        msg = f"{what}: {detail}" if detail else what
        if not self.lost_logged:
            self.lost_logged = True
            _log.info("PeerLost on the channel with %s: %s",
                      self.peer if self.peer is not None else "?", msg)
        return msg
