# The mini-verbs interface: the one narrow waist between the batch engine (above)
# and the providers verbs / shm / tcp (below). A provider subclasses Transport in
# Cython and implements the nogil methods; everything above is provider-agnostic.
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cdef extern from "<pthread.h>" nogil:
    unsigned long pthread_self()


cdef inline int64_t now_ns() noexcept nogil:
    """Monotonic nanoseconds: the engine's and the providers' one clock."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec

# Work-request opcodes and flags.
cdef enum:
    RM_WR_WRITE = 0
    RM_WR_WRITE_IMM = 1
    RM_WR_READ = 2
    RM_WR_SEND = 3
    RM_WR_FETCH_ADD = 4     # a region's 64-bit word (verbs, tcp): local_addr holds the operand
    RM_WR_CMP_SWAP = 5      # (and, for CMP_SWAP, the new value after it); the old value
                            # lands in its first 8 bytes

cdef enum:
    RM_WR_SIGNALED = 1      # produce a completion
    RM_WR_INLINE = 2        # payload copied at post time; source reusable on return
    RM_WR_PUBLISH = 4       # 8-byte words stored with release order (bitmap/control words)
    RM_WR_EXPOSED = 8       # rkey is a key from the peer's expose(), remote_off an address
                            # inside that exposure (rendezvous READ / WRITE)
    RM_WR_REGION = 16       # with EXPOSED: an access to a user region (rdmamw/channel/
                            # _remote.pyx); imm = the region's tag, which the exposure
                            # must carry (a provider without regions refuses it)
    RM_WR_FENCE = 32        # verbs, set by its region chains: begin only once the
                            # chain's earlier READs and atomics completed (IBV_SEND_FENCE)

# What expose() grants: LOCAL only makes the range usable as a WR source/READ target.
cdef enum:
    RM_ACCESS_LOCAL = 0
    RM_ACCESS_REMOTE_READ = 1
    RM_ACCESS_REMOTE_WRITE = 2
    RM_ACCESS_REMOTE_ATOMIC = 4 # a user region's 64-bit words (verbs, tcp)
    RM_ACCESS_TAG_SHIFT = 8     # expose(): bits above it are a user region's tag (its
                                # generation, not 0); below, the RM_ACCESS_* bits

# Regions every endpoint exposes to its peer; rkey in a WR names one of them.
cdef enum:
    RM_REGION_CTRL = 0      # control words written by the peer
    RM_REGION_ARRIVAL = 1   # arrival bitmap of the ring I receive on (peer writes)
    RM_REGION_RECLAIM = 2   # reclaim bitmap of the ring I send into (peer writes)
    RM_REGION_RING = 3      # the ring I receive on (peer writes slots)
    RM_NREGIONS = 4

cdef enum:
    RM_SOFT_CQ = 256            # completions kept by transports that finish work in post()

cdef enum:
    RM_ALL_SLOTS = 0xFFFFFFFF   # local_granted / peer_granted: the whole ring

# Return codes of Transport methods.
cdef enum:
    RM_OK = 0
    RM_ERR_BOUNDS = -1      # a WR outside the peer's registered region: nothing was done
    RM_ERR_PEER_LOST = -2
    RM_ERR_CLOSED = -3
    RM_ERR_OS = -4
    RM_ERR_UNSUPPORTED = -5 # the provider cannot do this (e.g. expose without CMA)
    RM_ERR_AGAIN = -6       # no room right now (exposure table, staging area): retry later
    RM_ERR_LATE = -7        # post(): the chain is accepted (queued in the transport, it
                            # goes when the peer reads again) but the post's deadline
                            # (deadline_posts) passed: the send posts no more (Timeout)

ctypedef struct rm_wr:
    uint64_t wr_id
    uint64_t local_addr     # source (WRITE) or destination (READ)
    uint64_t remote_off     # offset inside the peer region named by rkey
    uint32_t length
    uint32_t lkey
    uint32_t rkey           # RM_REGION_* of the peer
    uint16_t opcode
    uint16_t flags
    uint32_t imm

ctypedef struct rm_wc:
    uint64_t wr_id
    int32_t status
    uint32_t opcode

ctypedef struct rm_mem:      # a range made visible by expose()
    uint32_t handle         # for unexpose(); 0 = nothing to undo
    uint32_t lkey           # local key for WRs that use the range
    uint32_t rkey           # the key the peer names in RM_WR_EXPOSED work requests

ctypedef struct rm_region:
    char *addr
    uint64_t length

cdef class Transport:
    cdef rm_region local[RM_NREGIONS]     # my regions (the peer writes into them)
    cdef rm_region peer[RM_NREGIONS]      # the peer's regions, as sizes for bounds checks
    cdef readonly bint direct_source      # WRITE may source from any process memory (no MR)
    cdef readonly bint synchronous        # post() has executed the chain when it returns
    cdef readonly bint async_read         # a SIGNALED READ completes later, in poll(), even
                                          # on a synchronous transport (tcp: the peer answers)
    cdef readonly uint32_t max_inline
    cdef readonly bint can_expose         # expose() works: rendezvous is possible
    cdef readonly bint registers_memory   # user buffers need mr_register() before use
                                          # (verbs); the engine then takes its keys from
                                          # the channel's registration caches
    cdef readonly uint64_t max_expose     # largest range expose() takes (0: no limit)
    cdef readonly int owner_pid           # the process that made it (rdmamw/_fork.py)
    # counters: everything that hits the "NIC"
    cdef public uint64_t n_doorbells      # post calls (ibv_post_send equivalents)
    cdef public uint64_t n_wrs
    cdef public uint64_t n_signaled
    cdef public uint64_t n_completions
    cdef public uint64_t n_wakeups        # peer wake-ups sent (eventfd / WRITE_WITH_IMM)
    cdef public uint64_t bytes_written

    # completion queue of transports that finish the work inside post() (shm, tcp);
    # a transport with a real CQ (verbs) overrides poll() and ignores it
    cdef rm_wc soft_cq[RM_SOFT_CQ]
    cdef uint32_t soft_head
    cdef uint32_t soft_len

    cdef void complete_now(self, uint64_t wr_id, uint32_t opcode) noexcept nogil

    # ---- REQUIRED: every provider implements these (the base refuses them) ----------
    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil
    cdef int wake_peer(self) noexcept nogil
    cdef int wait(self, int timeout_ms) noexcept nogil
    cdef int peer_state(self) noexcept nogil
    # also required, as Python methods: close(); and the regions: fill local[] and
    # peer[] from layout.Layout.regions() when the connection is made.
    # poll() is required of a provider with a real completion queue (verbs); one that
    # finishes the work inside post() calls complete_now() and keeps the base's poll()
    cdef int poll(self, rm_wc *wcs, uint32_t maxn) noexcept nogil

    # ---- OPTIONAL: the base's default is what a provider without the feature does;
    # the engine and rdmamw.aio rely on the defaults and never ask which is which ------
    # an event loop's wait instead of wait(): event_fd() (Python) names a descriptor
    # that turns readable on what would end wait(); arm_fd() drains it and arms the
    # provider's notification (then the caller checks again); disarm_fd() undoes it.
    # Default (no _event_fds()): a descriptor that never turns readable, arm_fd() OK,
    # and poll_interval() NO_EVENT_POLL_S, so a loop's waits re-check by polling
    cdef int arm_fd(self) noexcept nogil
    cdef void disarm_fd(self) noexcept nogil
    cdef void reap_wakeups(self) noexcept nogil  # take wake-ups already delivered (verbs: the RQ)
    cdef object _epoll                    # event_fd() of a provider with several fds, or none
    cdef readonly bint polled_events      # event_fd() is the never-readable default
    # the peer's process is gone (its end of the connection closed), as opposed to a
    # failed request: a refused READ is then its death, not a lie (verbs: the QP fails
    # on either, so only the side channel tells). Default: peer_state() < 0
    cdef bint peer_exited(self) noexcept nogil
    # idle: help the peer with its work (shm: copies); default 0
    cdef int assist(self) noexcept nogil
    # close_wakes: the provider promises that close() wakes a thread of this endpoint
    # asleep in wait() (shm, tcp, verbs: their eventfd or socket). Then the engine's
    # waits off the main thread sleep until their deadline instead of waking every
    # 50 ms slice to look (idle threads cost nothing). Default False: they keep slices
    cdef readonly bint close_wakes
    # wake_self(): wake a thread of this endpoint asleep in wait() without closing
    # anything (a local close() first ends the calls in progress, then the transport).
    # Required of a provider with close_wakes; default RM_ERR_UNSUPPORTED (its sleepers
    # wake every 50 ms slice anyway)
    cdef int wake_self(self) noexcept nogil
    # rendezvous: make [addr, addr+length) readable/writable by the peer (or only usable
    # locally); the provider bounds-checks the peer's EXPOSED work requests against it.
    # The engine's send thread and receive thread call expose/unexpose at the same time:
    # a provider's exposure table must be safe for that (verbs: xlock; tcp: xp_mu).
    # Default: RM_ERR_UNSUPPORTED with can_expose False (the channel sends eagerly only)
    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil
    cdef int expose_cached(self, uint64_t addr, uint64_t length, uint32_t access,
                           uint32_t lkey, uint32_t rkey, rm_mem *out) noexcept nogil
    cdef int unexpose(self, uint32_t handle) noexcept nogil
    # True in a fork child: the connection is the parent's, so close() and dealloc
    # must touch nothing shared (no shutdown, no close word, no thread join, no verbs).
    # Default: owner_pid is not this process's pid
    cdef bint inherited(self) noexcept nogil
    # a ring that grows (verbs: docs/protocol.md "Rings that grow"): the slots of my
    # ring the peer may write now (local_granted) and of the peer's ring I may write
    # (peer_granted, raised by take_grant()). RM_ALL_SLOTS: the whole ring, always
    # (the default: shm and tcp rings never grow). set_rings() tells the transport
    # the geometry of both rings, once, before the first post
    cdef readonly uint32_t local_granted
    cdef readonly uint32_t peer_granted
    cdef int set_rings(self, uint32_t nslots, uint64_t stride, uint32_t peer_nslots,
                       uint64_t peer_stride) except -1
    cdef bint take_grant(self) noexcept nogil    # True: peer_granted grew
    # put_wake(): a control word's WRITE (one wr) and then the wake-up, as post() and
    # wake_peer() make them (the default); verbs posts both as one chain, one doorbell
    cdef int put_wake(self, rm_wr *wr) noexcept nogil
    # a post's deadline (now_ns(); 0: none) for the posts of the thread that set it: a
    # provider whose post() can wait for its peer (tcp: a full socket) returns
    # RM_ERR_LATE by then instead of waiting on. Others ignore it
    cdef int64_t post_deadline
    cdef unsigned long post_owner

    cdef inline void deadline_posts(self, int64_t deadline) noexcept nogil:
        self.post_owner = pthread_self()
        self.post_deadline = deadline
    # optional Python methods: register_local() (default: no registration, lkey 0),
    # error_detail() (default None), counters() (the n_* fields above)


# this process's pid, kept current in a fork child: a unit that checks ownership on
# every call keeps the address and compares with an inline load (no call per message)
cdef const int *current_pid() noexcept nogil
