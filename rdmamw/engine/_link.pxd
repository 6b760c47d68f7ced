from libc.stdint cimport int64_t, uint32_t, uint64_t

from rdmamw.engine._counters cimport rm_counters
from rdmamw.engine._trace cimport rm_trace
from rdmamw.transport._base cimport (
    RM_REGION_CTRL,
    RM_WR_INLINE,
    RM_WR_PUBLISH,
    RM_WR_WRITE,
    Transport,
    now_ns,
    rm_mem,
    rm_wc,
    rm_wr,
)
from rdmamw.transport.atomics cimport rm_spin_lock, rm_spin_unlock


cdef extern from "rm_sleepers.h" nogil:
    ctypedef struct rm_sleepers:
        pass
    int rm_sleepers_init(rm_sleepers *s)
    void rm_sleepers_destroy(rm_sleepers *s)
    uint64_t rm_sleepers_gen(rm_sleepers *s)


cdef class Link:
    # the only holder of the transport: the other units reach it through the methods
    # below (the inline ones cost what the direct call did)
    cdef Transport tp
    cdef uint64_t *ctrl             # my control words (the peer writes them)
    cdef uint64_t *words            # sources of the control words I write (WORD_*)
    cdef uint32_t lkey_words
    cdef int spin                   # guards posts, the reclaim shadow and the done word
    cdef int reap_lock              # wcs and what reap() updates (send and receive threads)
    cdef rm_wc wcs[64]
    cdef uint64_t batch_posted      # signaled chains posted / completed (wr_id order)
    cdef uint64_t batch_done
    cdef uint64_t read_done         # async transports: last rendezvous READ completed
    cdef int read_status            # ... and its status
    cdef readonly bint closed         # close() began: no call starts, none goes on
    cdef readonly bint ended          # close() closed the transport: nothing is written
                                      # into our memory any more (READ destinations)
    cdef readonly bint peer_gone
    cdef bint lost_logged           # PeerLost is logged once, with its cause
    cdef object broken              # why a peer broke the protocol (None: it did not)
    cdef readonly object peer       # the peer's address, for log lines (set_peer)
    cdef bint credit_flag_set       # CTRL_CREDIT_WAIT raised at the peer
    cdef bint sleep_flag_set        # CTRL_RX_SLEEP raised at the peer
    cdef int64_t credit_flag_ns     # when each was raised (now_ns: for diagnostics())
    cdef int64_t sleep_flag_ns
    cdef int64_t spin_ns            # how long a wait spins before it sleeps
    cdef rm_counters cnt
    cdef const int *pid_now         # this process's pid, current across fork (transport)
    cdef int owner_pid              # the process that made the transport
    cdef rm_sleepers sleepers       # one thread at a time sleeps in the transport
    cdef bint sleepers_ok
    cdef rm_trace *trace            # the timeline's records (the process's one: trace_state)
    cdef readonly uint64_t serial   # this endpoint's number in them (Engine.trace_id)

    cdef int attach(self, Transport tp, double spin_us) except -1
    cdef int check_rings(self, uint32_t nslots, uint64_t stride, uint32_t peer_nslots,
                         uint64_t peer_stride) except -1
    cdef object region_view(self, int region)
    cdef int set_peer(self, object peer) except -1
    cdef int open(self) except -1
    cdef int shut(self) except -1
    cdef int64_t wait_until(self, int64_t deadline) noexcept nogil
    cdef int end(self) except -1
    cdef void announce_closed(self) noexcept nogil
    cdef int refuse(self) except -1

    # inline: every send, receive and release asks (a load and a compare, no call)
    cdef inline bint inherited(self) noexcept nogil:
        """True in a fork child: the connection is the parent's (rdmamw/_fork.py)."""
        return self.owner_pid != self.pid_now[0]

    cdef inline int check_owner(self) except -1:
        if self.owner_pid != self.pid_now[0]:
            return self.refuse()
        return 0

    cdef inline int check_usable(self) except -1:
        if self.owner_pid != self.pid_now[0] or self.closed or self.broken is not None:
            return self.refuse()
        return 0

    # the post lock (the spin word is the Link's; every unit that posts takes it)
    cdef inline void lock(self) noexcept nogil:
        rm_spin_lock(&self.spin)

    cdef inline void unlock(self) noexcept nogil:
        rm_spin_unlock(&self.spin)

    # the transport, for the units (inline: a call through the Link costs nothing)
    cdef inline int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        return self.tp.post(wrs, n)

    cdef inline int wake_peer(self) noexcept nogil:
        return self.tp.wake_peer()

    cdef inline int wake_self(self) noexcept nogil:
        """Wake a thread of ours asleep in the transport (close() ends its wait)."""
        return self.tp.wake_self()

    cdef inline bint peer_hung_up(self) noexcept nogil:
        """The peer's end of the connection is gone: nothing more arrives from it."""
        return self.tp.peer_exited()

    cdef inline void deadline_posts(self, int64_t deadline) noexcept nogil:
        self.tp.deadline_posts(deadline)    # this thread's posts return by then (0: none)

    cdef inline int assist(self) noexcept nogil:
        return self.tp.assist()

    cdef inline int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                           rm_mem *out) noexcept nogil:
        return self.tp.expose(addr, length, access, out)

    cdef inline int expose_cached(self, uint64_t addr, uint64_t length, uint32_t access,
                                  uint32_t lkey, uint32_t rkey, rm_mem *out) noexcept nogil:
        return self.tp.expose_cached(addr, length, access, lkey, rkey, out)

    cdef inline int unexpose(self, uint32_t handle) noexcept nogil:
        return self.tp.unexpose(handle)

    cdef inline bint synchronous(self) noexcept nogil:
        return self.tp.synchronous

    cdef inline bint direct_source(self) noexcept nogil:
        return self.tp.direct_source

    cdef inline bint async_read(self) noexcept nogil:
        return self.tp.async_read

    cdef inline char *local_addr(self, int region) noexcept nogil:
        return self.tp.local[region].addr

    cdef inline uint64_t local_length(self, int region) noexcept nogil:
        return self.tp.local[region].length

    cdef inline uint64_t next_batch(self) noexcept nogil:
        """The wr_id of the next signaled chain (completions come back in order)."""
        self.batch_posted += 1
        return self.batch_posted

    cdef inline void completed_in_post(self) noexcept nogil:
        """A chain posted unsignaled on a synchronous transport (post() executed it)
        is the next one posted and completed: no completion queued and reaped. Only
        when none is outstanding (batch_done == batch_posted), under the reap lock:
        a reap of another thread moves batch_done too."""
        rm_spin_lock(&self.reap_lock)
        self.batch_posted += 1
        self.batch_done = self.batch_posted
        rm_spin_unlock(&self.reap_lock)

    cdef inline bint can_expose(self) noexcept nogil:
        return self.tp.can_expose

    cdef inline bint registers_memory(self) noexcept nogil:
        return self.tp.registers_memory

    cdef inline uint64_t max_expose(self) noexcept nogil:
        return self.tp.max_expose

    cdef inline bint attached(self) noexcept nogil:
        return self.tp is not None

    # a ring that grows (Transport.local_granted / peer_granted / take_grant)
    cdef inline uint32_t local_granted(self) noexcept nogil:
        return self.tp.local_granted

    cdef inline uint32_t peer_granted(self) noexcept nogil:
        return self.tp.peer_granted

    cdef inline bint take_grant(self) noexcept nogil:
        return self.tp.take_grant()

    cdef object register_local(self, size_t addr, size_t length)
    cdef int sleep(self, int timeout_ms, uint64_t seen) noexcept nogil
    cdef inline uint64_t sleep_gen(self) noexcept nogil:
        """Read before a sleeper's last look (sleep()'s ``seen``)."""
        return rm_sleepers_gen(&self.sleepers)
    cdef int arm_fd(self) noexcept nogil
    cdef void disarm_fd(self) noexcept nogil
    cdef void reap_wakeups(self) noexcept nogil
    cdef object event_fd(self)
    cdef double poll_interval(self)
    cdef dict counters(self)
    cdef dict stats(self)
    cdef dict diagnostics(self)
    cdef dict waiting(self)
    cdef object error_detail(self)

    cdef int put_word(self, uint32_t region, uint32_t word, uint64_t *src) noexcept nogil
    cdef inline int put_ctrl(self, uint32_t word, uint32_t src) noexcept nogil:
        """Write words[src] into the peer's control word ``word``."""
        return self.put_word(RM_REGION_CTRL, word, &self.words[src])

    cdef inline void flip_bit(self, uint32_t src, uint32_t bit) noexcept nogil:
        """Flip one bit of words[src] (caller holds the post lock)."""
        self.words[src] ^= (<uint64_t>1) << bit

    cdef int announce_max_msg(self, uint64_t max_msg) except -1
    cdef void credit_flag(self, bint up, uint32_t ask=*) noexcept nogil
    cdef void sleep_flag(self, bint up) noexcept nogil
    cdef void sleep_flag_locked(self, bint up) noexcept nogil
    cdef void read_result(self, uint64_t *done, int *status) noexcept nogil
    cdef void mark_lost(self) noexcept nogil
    cdef bint peer_closing(self) noexcept nogil
    cdef int peer_status(self) noexcept nogil
    cdef int peer_dying(self) noexcept nogil
    cdef void reap(self) noexcept nogil
    cdef void reap_posted(self, uint64_t chain) noexcept nogil
    cdef bint poll_done(self, uint64_t batch) noexcept
    cdef int fail(self, str why) except -1
    cdef int raise_post(self, int rc) except -1
    cdef int raise_peer(self, int st, str where) except -1
    cdef int raise_if_gone(self, str where) except -1
    cdef str lost(self, str what)



cdef inline void fill_wr(rm_wr *wr, uint64_t *src, uint32_t lkey, uint32_t region,
                         uint64_t off, uint32_t length) noexcept nogil:
    """A WRITE of words into a region of the peer, stored in order (PUBLISH)."""
    wr.wr_id = 0
    wr.local_addr = <uint64_t>src
    wr.remote_off = off
    wr.length = length
    wr.lkey = lkey
    wr.rkey = region
    wr.opcode = RM_WR_WRITE
    wr.flags = RM_WR_PUBLISH | RM_WR_INLINE
    wr.imm = 0


cdef enum:
    SLICE_NS = 50000000     # a blocked call returns to the GIL this often (signals)
    PEER_CHECK_NS = 1000000 # a wait asks the provider about the peer this often


cdef inline int64_t slice_end(int64_t deadline) noexcept nogil:
    """The end of the next slice of a wait that ends at ``deadline`` (0: never)."""
    cdef int64_t t = now_ns() + SLICE_NS
    if deadline and deadline < t:
        return deadline
    return t


cdef int64_t deadline_of(object timeout) except -1
cdef rm_trace *trace_state() noexcept nogil
