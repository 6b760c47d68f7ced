# cython: freethreading_compatible = False
"""The transport interface's base class: what every provider's endpoint inherits.

The declarations (work requests, completions, return codes, the clock, the fields of
:class:`Transport`) are in ``_base.pxd``; the engine above and the providers below
both cimport them from here, and neither imports the other."""

from libc.stdint cimport uint32_t, uint64_t

from rdmamw.transport.atomics cimport rm_fence_seq_cst

import select

from rdmamw import _fork

# this process's pid, refreshed in a fork child: ``inherited()`` compares with it
cdef int _pid = _fork.pid()


cdef const int *current_pid() noexcept nogil:
    return &_pid


@_fork.at_child
def _refresh_pid():
    global _pid
    _pid = _fork.pid()


#: how often an event loop re-checks a transport without event descriptors (seconds)
NO_EVENT_POLL_S = 0.001


cdef class Transport:
    """Base of the providers' endpoints (mini-verbs). The required methods (``post``,
    ``wake_peer``, ``wait``, ``peer_state``, ``close``; ``poll`` unless the provider
    completes work in ``post``) are refused here, so a half-built transport fails
    loudly; the optional ones have the defaults of a provider without the feature
    (``_base.pxd`` lists which is which)."""

    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        return RM_ERR_CLOSED

    cdef void complete_now(self, uint64_t wr_id, uint32_t opcode) noexcept nogil:
        """Record the completion of a signaled WR that post() already finished."""
        cdef uint32_t slot
        if self.soft_len == RM_SOFT_CQ:     # overrun: keep the newest (ids are monotonic)
            self.soft_head = (self.soft_head + 1) % RM_SOFT_CQ
            self.soft_len -= 1
        slot = (self.soft_head + self.soft_len) % RM_SOFT_CQ
        self.soft_cq[slot].wr_id = wr_id
        self.soft_cq[slot].status = 0
        self.soft_cq[slot].opcode = opcode
        self.soft_len += 1

    cdef int poll(self, rm_wc *wcs, uint32_t maxn) noexcept nogil:
        cdef uint32_t k = 0
        while k < maxn and self.soft_len:
            wcs[k] = self.soft_cq[self.soft_head]
            self.soft_head = (self.soft_head + 1) % RM_SOFT_CQ
            self.soft_len -= 1
            k += 1
        self.n_completions += k
        return k

    cdef int wake_peer(self) noexcept nogil:
        return RM_ERR_CLOSED

    cdef int wait(self, int timeout_ms) noexcept nogil:
        """Block until woken by the peer (1), timeout (0) or a peer event (<0)."""
        return RM_ERR_CLOSED

    cdef int arm_fd(self) noexcept nogil:
        """Drain event_fd() and arm whatever makes it readable on the next wake-up,
        peer message or peer event; RM_OK, or <0 once the connection is down. The
        caller checks for what it waits for *after* this (check, arm, check). The
        default (a provider without event descriptors) has nothing to arm: the
        waiter re-checks every poll_interval()."""
        return RM_OK

    cdef void disarm_fd(self) noexcept nogil:
        pass

    cdef void reap_wakeups(self) noexcept nogil:
        """Take the peer's wake-ups that arrived without a wait taking them: a caller
        that polls (an event loop finding messages every time) calls it so they do not
        pile up (verbs: each is a receive WR, and an empty receive queue stalls the
        peer's sends)."""
        pass

    def _event_fds(self):
        """The descriptors that wake wait() (the provider's wake-up, its liveness
        socket); event_fd() watches them all. Default: none (see event_fd)."""
        return ()

    def poll_interval(self) -> float:
        """Seconds after which a wait on event_fd() looks again although it stayed
        quiet, for a wake-up that can slip by (0: none can). NO_EVENT_POLL_S for a
        provider without event descriptors."""
        return NO_EVENT_POLL_S if self.polled_events else 0.0

    def event_fd(self) -> int:
        """One descriptor for an event loop: readable when wait() would return (a
        wake-up from the peer, the peer closing or dying). Several descriptors are
        combined in an epoll set the transport owns (closed with it). A provider with
        none gets an empty epoll set, never readable: then poll_interval() makes the
        loop's waits look again every NO_EVENT_POLL_S (slower, never stuck)."""
        fds = self._event_fds()
        if len(fds) == 1:
            return fds[0]
        if self._epoll is None:
            ep = select.epoll()
            for fd in fds:
                ep.register(fd, select.EPOLLIN)
            self._epoll = ep
            self.polled_events = not fds
        return self._epoll.fileno()

    cdef int peer_state(self) noexcept nogil:
        """1 while the peer is reachable, RM_ERR_CLOSED or RM_ERR_PEER_LOST after."""
        return RM_ERR_CLOSED

    cdef int wake_self(self) noexcept nogil:
        return RM_ERR_UNSUPPORTED

    cdef int assist(self) noexcept nogil:
        """Called while the engine is idle (spinning or about to sleep): a provider
        whose peer's work requests are executed by CPUs may lend this one (shm: the
        assisted READ of rdmamw/providers/shm/rm_assist.h). The number of pieces done."""
        return 0

    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil:
        """Make [addr, addr+length) usable by work requests (RM_ACCESS_LOCAL) and by
        the peer's RM_WR_EXPOSED READs or WRITEs; fill ``out``. A provider that cannot
        says RM_ERR_UNSUPPORTED (the engine then sends eagerly only)."""
        return RM_ERR_UNSUPPORTED

    cdef int expose_cached(self, uint64_t addr, uint64_t length, uint32_t access,
                           uint32_t lkey, uint32_t rkey, rm_mem *out) noexcept nogil:
        """The range lies in a registration of mr_register(), whose keys are given: make
        it usable as expose() would. Here: those keys, nothing to undo (a provider
        that gives each exposure its own key overrides this)."""
        out.handle, out.lkey, out.rkey = 0, lkey, rkey
        return 0

    cdef int unexpose(self, uint32_t handle) noexcept nogil:
        return 0

    cdef bint peer_exited(self) noexcept nogil:
        return self.peer_state() < 0

    cdef bint inherited(self) noexcept nogil:
        return self.owner_pid != _pid

    cdef int set_rings(self, uint32_t nslots, uint64_t stride, uint32_t peer_nslots,
                       uint64_t peer_stride) except -1:
        return 0

    cdef bint take_grant(self) noexcept nogil:
        return False

    cdef int put_wake(self, rm_wr *wr) noexcept nogil:
        cdef int rc = self.post(wr, 1)
        rm_fence_seq_cst()      # the word is out before the peer is woken to read it
        self.wake_peer()
        return rc

    def __cinit__(self, *args, **kwargs):
        self.owner_pid = _pid
        self.local_granted = self.peer_granted = RM_ALL_SLOTS

    def error_detail(self):
        """What failed the connection, in the provider's words (a work completion's
        status, a failed call), or None: it goes into PeerLost's message."""
        return None

    def register_local(self, size_t addr, size_t length):
        """Make [addr, addr+length) usable as a work-request source or READ target;
        return its lkey. The engine registers its staging ring and bitmap shadows once
        at set-up. A provider that needs no registration returns 0."""
        return 0

    def close(self):
        pass

    def counters(self):
        return {
            "doorbells": self.n_doorbells,
            "work_requests": self.n_wrs,
            "signaled_completions": self.n_signaled,
            "completions_polled": self.n_completions,
            "wakeups_sent": self.n_wakeups,
            "bytes_written": self.bytes_written,
        }

    def _region_view(self, int region):
        """Writable view of one of my regions (the engine wires its bitmaps to it)."""
        if not 0 <= region < RM_NREGIONS or self.local[region].length == 0:
            raise ValueError(f"region {region} is not set up")
        return <unsigned char[:self.local[region].length]> <unsigned char *>self.local[region].addr
