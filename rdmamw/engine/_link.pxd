from libc.stdint cimport int64_t, uint32_t, uint64_t

from rdmamw.engine._counters cimport rm_counters
from rdmamw.transport._base cimport RM_WR_INLINE, RM_WR_PUBLISH, RM_WR_WRITE, Transport, now_ns, rm_wc, rm_wr


cdef class Link:
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
    cdef readonly bint closed
    cdef readonly bint peer_gone
    cdef bint lost_logged           # PeerLost is logged once, with its cause
    cdef object broken              # why a peer broke the protocol (None: it did not)
    cdef public object peer         # the peer's address, for log lines
    cdef bint credit_flag_set       # CTRL_CREDIT_WAIT raised at the peer
    cdef bint sleep_flag_set        # CTRL_RX_SLEEP raised at the peer
    cdef int64_t spin_ns            # how long a wait spins before it sleeps
    cdef rm_counters cnt
    cdef const int *pid_now         # this process's pid, current across fork (transport)
    cdef int owner_pid              # the process that made the transport

    cdef int attach(self, Transport tp, double spin_us) except -1
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

    cdef int put_word(self, uint32_t region, uint32_t word, uint64_t *src) noexcept nogil
    cdef void set_flag(self, uint32_t word, bint *flag, bint up) noexcept nogil
    cdef bint peer_closing(self) noexcept nogil
    cdef int peer_status(self) noexcept nogil
    cdef int peer_dying(self) noexcept nogil
    cdef void reap(self) noexcept nogil
    cdef bint poll_done(self, uint64_t batch) noexcept
    cdef int fail(self, str why) except -1
    cdef int raise_post(self, int rc) except -1
    cdef int raise_peer(self, int st, str where) except -1
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
