# The shm provider's endpoint (ShmEndpoint: its set-up; _transport.pxd: its data path),
# declared here so that the data path and the test-only hooks (rdmamw/testing/_hooks.pyx)
# reach its records, the latter the way a peer process can.
from libc.stdint cimport int64_t, uint32_t, uint64_t

from rdmamw.transport._base cimport RM_NREGIONS, Transport, rm_mem, rm_wr

cdef enum:
    SHM_CONNECTED = 1       # ShmEndpoint.state, attached; else the RM_ERR_* that ended it
    ASSIST_ALIGN = 1 << 16  # assisted-READ chunks are multiples of this

cdef enum:                  # ShmEndpoint._wait_step(): go on, the peer is gone, stalled
    WAIT_ON = 0
    WAIT_GONE = 1
    WAIT_STALLED = 2

cdef extern from "sys/uio.h" nogil:     # CMA: copies from and to the peer's memory
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t process_vm_readv(int pid, const iovec *local, unsigned long liovcnt,
                             const iovec *remote, unsigned long riovcnt, unsigned long flags)
    ssize_t process_vm_writev(int pid, const iovec *local, unsigned long liovcnt,
                              const iovec *remote, unsigned long riovcnt, unsigned long flags)

cdef extern from "poll.h" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    short POLLIN, POLLHUP, POLLERR, POLLNVAL

cdef extern from "rm_expose.h" nogil:
    enum:
        RM_XTAB_N, RM_XACC_READ, RM_XACC_WRITE, RM_XACC_ATOMIC
    uint64_t RM_XNONE
    ctypedef struct rm_xent:
        uint64_t addr, len, staged
        uint32_t key, access
    ctypedef struct rm_xtab:
        uint64_t probe
        uint32_t gen, live
    uint32_t rm_xtab_add(rm_xtab *t, uint64_t addr, uint64_t len, uint32_t access,
                         uint64_t staged)
    int rm_xtab_del(rm_xtab *t, uint32_t key, rm_xent *out)
    int rm_xtab_find(const rm_xtab *t, uint32_t key, uint64_t addr, uint64_t len,
                     uint32_t access, rm_xent *out)
    int rm_xtab_alive(const rm_xtab *t, uint32_t key)
    void rm_xtab_mirror(rm_xtab *t, const rm_xtab *src, uint32_t key)
    void rm_xtab_retract(rm_xtab *t, uint32_t key)
    uint64_t rm_xtab_fit(const rm_xtab *t, uint64_t size, uint64_t len)

cdef extern from "rm_assist.h" nogil:
    enum:
        RM_ASSIST_MAX_CHUNKS
    ctypedef struct rm_assist:
        uint64_t claim, fin, bad, remote, local, len, chunk
        uint32_t key, write
    void rm_assist_publish(rm_assist *a, uint32_t seq, uint32_t write, uint64_t remote,
                           uint64_t local, uint64_t len, uint64_t chunk, uint32_t key,
                           uint32_t n)
    int rm_assist_claim(rm_assist *a, uint32_t seq, uint32_t n, uint64_t *taken)
    uint32_t rm_assist_offer(const rm_assist *a, rm_assist *out)
    void rm_assist_finish(rm_assist *a, int i, int ok)

cdef extern from "rm_region.h" nogil:
    enum:
        RM_XTAG_SHIFT, RM_RWHY_OK, RM_RWHY_GONE, RM_RWHY_RANGE, RM_RWHY_ACCESS
    ctypedef struct rm_region_rec:
        uint64_t id, busy
    int rm_region_why(const rm_xtab *t, uint32_t key, uint32_t tag, uint64_t addr,
                      uint64_t len, uint32_t access)

cdef extern from "rm_shared.h" nogil:   # atomics on shared-memory regions
    ctypedef struct rm_xfile:
        uint64_t file[1]
    ctypedef struct rm_smap:
        uint32_t key, tag
        uint64_t file, addr, len
        char *map
        uint64_t delta
        uint32_t users
    uint64_t rm_xfile_word(int fd, uint64_t off)
    void rm_smap_drop(rm_smap *m)
    int rm_smap_make(rm_smap *m, int pidfd, uint32_t key, uint32_t tag, uint64_t file,
                     uint64_t addr, uint64_t len)
    void rm_smap_atomic(const rm_smap *m, uint64_t at, int cas, uint64_t *ops)


cdef class ShmEndpoint(Transport):
    cdef char *my_base
    cdef size_t my_size
    cdef char *peer_base
    cdef size_t peer_size
    cdef char *peer_addr[RM_NREGIONS]
    cdef int sock
    cdef int my_evfd
    cdef int peer_evfd
    cdef int state
    # rendezvous
    cdef rm_xtab *xpriv             # my exposures, private: what I check the peer against
    cdef rm_xtab *xtab              # their mirror in my block: the peer checks its READs
                                    # against it (and could forge it: I never read it)
    cdef rm_xtab *peer_xtab         # the peer's mirror, in its block
    cdef int xlock                  # guards changes to my table (two engine threads)
    cdef int peer_pid
    cdef int pidfd                  # the peer process (-1: not available); pid reuse guard
    cdef bint cma                   # I may process_vm_* the peer
    cdef bint peer_cma              # the peer may process_vm_* me (else I stage for it)
    cdef char *arena                # my staging area (the peer maps it too)
    cdef uint64_t arena_size
    cdef char *peer_arena
    cdef uint64_t peer_arena_size
    # assisted READ/WRITE (rm_assist.h)
    cdef rm_assist *job             # my job record, in my block: the peer helps with it
    cdef rm_assist *peer_job        # the peer's, in its block: I help with it
    cdef uint32_t job_seq
    cdef uint64_t assist_min        # READs/WRITEs of at least this many bytes ask (0: never)
    cdef uint64_t assist_chunk      # smallest chunk
    cdef int64_t assist_stall_ns    # a helper's chunk unfinished this long: PeerLost
    cdef int assist_busy            # one engine thread at a time helps with the peer's job
    cdef uint32_t assist_key        # the exposure it copies from/into now (unexpose waits)
    # user regions (rm_region.h): my record (identity, my accesses in progress) and the
    # peer's, each in its block after the assist records
    cdef rm_region_rec *rrec
    cdef rm_region_rec *peer_rrec
    cdef uint64_t busy_seq
    cdef uint32_t busy_chains       # my region chains in progress (threads): busy is odd
    cdef int busy_lock              # guards busy_seq / busy_chains and the busy word
    cdef int job_lock               # one assisted copy of mine at a time (the job record)
    # atomics on shared-memory regions (rm_shared.h): my exposures' file words (in my
    # block), the peer's, and my mappings of the peer's atomic exposures (per slot)
    cdef rm_xfile *xfile
    cdef rm_xfile *peer_xfile
    cdef rm_smap *smaps
    cdef int smap_lock              # guards smaps (threads of mine run atomics at once)
    cdef rm_smap *cmaps             # my mappings of the peer's exposures in shared
    cdef int cmap_lock              # memory that reads/writes copy through (_mapped.pxd)
    cdef public uint64_t n_assist_jobs          # my READs/WRITEs that asked for help
    cdef public uint64_t n_assist_chunks_got    # chunks of them the peer copied
    cdef public uint64_t bytes_assist_given     # bytes I copied for the peer's jobs
    cdef public uint64_t n_mapped_ops           # region READs/WRITEs copied through my
                                                # mapping of the peer's shared memory

    cdef void _close_fds(self) noexcept
    cdef bint _peer_exited(self) noexcept nogil
    cdef int _expose_region(self, uint64_t addr, uint64_t length, uint32_t access,
                            uint32_t tag, uint64_t file, rm_mem *out) noexcept nogil
    cdef int _await_peer_region(self) noexcept nogil
    cdef int _atomic(self, rm_wr *wr, bint run) noexcept nogil
    cdef int _wait_step(self, uint32_t *spins, int64_t *until, bint hangup) noexcept nogil
