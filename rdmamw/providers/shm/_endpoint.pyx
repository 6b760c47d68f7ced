# cython: freethreading_compatible = False
"""The ``shm`` provider's endpoint set-up (declared in _endpoint.pxd): both blocks
mapped, the exposure tables and assist records wired, the staging areas a connection
without CMA needs, the descriptors and their teardown (ShmEndpoint). Its data path is
the subclass's, _transport.ShmTransport."""

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset

from rdmamw.transport._base cimport (
    RM_ACCESS_REMOTE_ATOMIC,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ACCESS_TAG_SHIFT,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_PEER_LOST,
    RM_ERR_UNSUPPORTED,
    RM_NREGIONS,
    RM_WR_CMP_SWAP,
    RM_WR_REGION,
    Transport,
    now_ns,
    rm_mem,
)
from rdmamw.transport.atomics cimport (
    rm_cpu_relax,
    rm_fence_seq_cst,
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_unlock,
    rm_store_release64,
)

cdef extern from "sys/mman.h" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int PROT_READ, PROT_WRITE, MAP_SHARED
    void *MAP_FAILED

cdef extern from "sys/socket.h" nogil:
    int shutdown(int fd, int how)
    int SHUT_RDWR

cdef extern from "unistd.h" nogil:
    ssize_t write(int fd, const void *buf, size_t n)
    int close(int fd)

cdef extern from "errno.h" nogil:
    int errno

cdef extern from "sched.h" nogil:
    int sched_yield()

#: the exposure table and, after it, the assist job record, the region record and the
#: file words of atomic regions (in each block; page-rounded by the provider, so the
#: last two took no new page)
XTAB_BYTES = sizeof(rm_xtab) + sizeof(rm_assist) + sizeof(rm_region_rec) \
    + RM_XTAB_N * sizeof(uint64_t)


def cma_probe(int pid, size_t addr) -> int:
    """Read 8 bytes at ``addr`` in process ``pid`` with process_vm_readv: the word, or
    -errno (EPERM: CMA is not permitted here)."""
    cdef uint64_t word = 0
    cdef iovec l, r
    l.iov_base = &word
    l.iov_len = 8
    r.iov_base = <void *>addr
    r.iov_len = 8
    if process_vm_readv(pid, &l, 1, &r, 1, 0) != 8:
        return -errno
    return <long long>(word >> 1)      # non-negative: the caller compares the same shift


cdef void _drop_maps(rm_smap *maps) noexcept:
    """Unmap and free a cache of mappings of the peer's exposures (one per slot)."""
    cdef int i
    if maps != NULL:
        for i in range(RM_XTAB_N):
            rm_smap_drop(&maps[i])
        free(maps)


cdef class ShmEndpoint(Transport):
    """The shm endpoint up to its data path; its fields are declared in _endpoint.pxd."""

    def __cinit__(self):
        self.sock = -1
        self.my_evfd = -1
        self.peer_evfd = -1
        self.pidfd = -1
        self.state = RM_ERR_CLOSED
        self.direct_source = True
        self.synchronous = True
        self.close_wakes = True         # close() writes my_evfd, shuts the socket
        self.max_inline = 1 << 30

    def _attach(self, int sock, int my_memfd, size_t my_size, int peer_memfd, size_t peer_size,
                int my_evfd, int peer_evfd, tuple my_regions, tuple peer_regions):
        """Map both blocks; regions are ((offset, length) x RM_NREGIONS). Takes
        ownership of sock and the eventfds; the memfds stay the caller's."""
        cdef int i
        cdef void *p
        for regions, size in ((my_regions, my_size), (peer_regions, peer_size)):
            if len(regions) != RM_NREGIONS:
                raise ValueError("need one (offset, length) per region")
            for off, length in regions:
                if off < 0 or length <= 0 or off + length > size:
                    raise ValueError(f"region ({off}, {length}) outside a block of {size}")
        p = mmap(NULL, my_size, PROT_READ | PROT_WRITE, MAP_SHARED, my_memfd, 0)
        if p == MAP_FAILED:
            raise OSError("mmap of own shm block failed")
        self.my_base, self.my_size = <char *>p, my_size
        p = mmap(NULL, peer_size, PROT_READ | PROT_WRITE, MAP_SHARED, peer_memfd, 0)
        if p == MAP_FAILED:
            raise OSError("mmap of the peer's shm block failed")
        self.peer_base, self.peer_size = <char *>p, peer_size
        for i in range(RM_NREGIONS):
            self.local[i].addr = self.my_base + <size_t>my_regions[i][0]
            self.local[i].length = my_regions[i][1]
            self.peer_addr[i] = self.peer_base + <size_t>peer_regions[i][0]
            self.peer[i].addr = NULL     # never dereferenced outside post()
            self.peer[i].length = peer_regions[i][1]
        self.sock, self.my_evfd, self.peer_evfd = sock, my_evfd, peer_evfd
        self.state = SHM_CONNECTED

    def _attach_rendezvous(self, size_t my_xtab_off, size_t peer_xtab_off, int peer_pid,
                           int pidfd):
        """Wire the exposure tables (at the given offsets of each block); ``pidfd``
        becomes ours."""
        if my_xtab_off + XTAB_BYTES > self.my_size \
                or peer_xtab_off + XTAB_BYTES > self.peer_size:
            raise ValueError("exposure table (and assist job record) outside the block")
        if self.xpriv == NULL:
            self.xpriv = <rm_xtab *>calloc(1, sizeof(rm_xtab))
            if self.xpriv == NULL:
                raise MemoryError("exposure table")
        self.xtab = <rm_xtab *>(self.my_base + my_xtab_off)
        self.peer_xtab = <rm_xtab *>(self.peer_base + peer_xtab_off)
        memset(self.xtab, 0, XTAB_BYTES)
        self.job = <rm_assist *>(self.my_base + my_xtab_off + sizeof(rm_xtab))
        self.peer_job = <rm_assist *>(self.peer_base + peer_xtab_off + sizeof(rm_xtab))
        self.rrec = <rm_region_rec *>(<char *>self.job + sizeof(rm_assist))
        self.peer_rrec = <rm_region_rec *>(<char *>self.peer_job + sizeof(rm_assist))
        self.xfile = <rm_xfile *>(<char *>self.rrec + sizeof(rm_region_rec))
        self.peer_xfile = <rm_xfile *>(<char *>self.peer_rrec + sizeof(rm_region_rec))
        if self.smaps == NULL:
            self.smaps = <rm_smap *>calloc(RM_XTAB_N, sizeof(rm_smap))
            self.cmaps = <rm_smap *>calloc(RM_XTAB_N, sizeof(rm_smap))
            if self.smaps == NULL or self.cmaps == NULL:
                raise MemoryError("shared-region mappings")
        self.peer_pid, self.pidfd = peer_pid, pidfd

    def _attach_staging(self, int my_arena_fd, size_t my_arena_size, int peer_arena_fd,
                        size_t peer_arena_size):
        """Map the staging areas a connection without CMA needs: mine (fd >= 0) when the
        peer cannot CMA me, the peer's when I cannot CMA it; the memfds stay the
        caller's. Channels with CMA both ways map neither (issue 14: a staging area is
        1 GiB of virtual size per side)."""
        cdef void *p
        if my_arena_fd >= 0 and self.arena == NULL:
            p = mmap(NULL, my_arena_size, PROT_READ | PROT_WRITE, MAP_SHARED, my_arena_fd, 0)
            if p == MAP_FAILED:
                raise OSError("mmap of own staging area failed")
            self.arena, self.arena_size = <char *>p, my_arena_size
        if peer_arena_fd >= 0 and self.peer_arena == NULL:
            p = mmap(NULL, peer_arena_size, PROT_READ, MAP_SHARED, peer_arena_fd, 0)
            if p == MAP_FAILED:
                raise OSError("mmap of the peer's staging area failed")
            self.peer_arena, self.peer_arena_size = <char *>p, peer_arena_size

    def _set_region_id(self, uint64_t ident):
        """This endpoint's identity, which region references carry (rm_region.h)."""
        if self.rrec == NULL:
            raise ValueError("the exposure tables are not attached yet")
        rm_store_release64(&self.rrec.id, ident)

    def region_ids(self):
        """(this endpoint's identity, the peer's): 0 for a peer without regions."""
        if self.rrec == NULL:
            return 0, 0
        return self.rrec.id, rm_load_acquire64(&self.peer_rrec.id)

    def _set_probe(self, uint64_t word):
        self.xtab.probe = word

    def _probe_address(self):
        """Address of my probe word, for the peer's CMA test."""
        return <size_t>&self.xtab.probe

    def _peer_probe_word(self):
        return <long long>(self.peer_xtab.probe >> 1)

    def _set_cma(self, bint mine, bint peers):
        """mine: I may CMA the peer; peers: the peer may CMA me (else I stage)."""
        self.cma, self.peer_cma = mine, peers
        self.can_expose = True
        self.max_expose = 0 if peers else self.arena_size

    def _set_assist(self, uint64_t min_bytes, uint64_t chunk, double stall_s=10.0):
        """Ask the peer to help with CMA READs/WRITEs of at least ``min_bytes`` (0: never),
        cut into chunks of at least ``chunk`` bytes (at most 64 of them); a chunk the
        peer claimed and has not finished after ``stall_s`` seconds (it was stopped)
        fails the channel instead of waiting for ever."""
        self.assist_min = min_bytes
        self.assist_chunk = max(chunk, <uint64_t>ASSIST_ALIGN)
        self.assist_stall_ns = <int64_t>(stall_s * 1e9)

    def counters(self):
        d = Transport.counters(self)
        d.update(assist_jobs=self.n_assist_jobs, assist_chunks_got=self.n_assist_chunks_got,
                 assist_bytes_given=self.bytes_assist_given, mapped_ops=self.n_mapped_ops)
        return d

    def fileno(self):
        return self.sock

    @property
    def cma_modes(self):
        """(I read the peer by CMA, the peer reads me by CMA)."""
        return bool(self.cma), bool(self.peer_cma)

    def __dealloc__(self):
        self._close_fds()
        if self.arena != NULL:
            munmap(self.arena, self.arena_size)
        if self.peer_arena != NULL:
            munmap(self.peer_arena, self.peer_arena_size)
        if self.my_base != NULL:
            munmap(self.my_base, self.my_size)
        if self.peer_base != NULL:
            munmap(self.peer_base, self.peer_size)
        free(self.xpriv)
        _drop_maps(self.smaps)
        _drop_maps(self.cmaps)
        self.smaps = self.cmaps = NULL

    cdef void _close_fds(self) noexcept:
        if self.sock >= 0:
            close(self.sock)
        if self.my_evfd >= 0:
            close(self.my_evfd)
        if self.peer_evfd >= 0:
            close(self.peer_evfd)
        if self.pidfd >= 0:
            close(self.pidfd)
        self.sock = self.my_evfd = self.peer_evfd = self.pidfd = -1

    def close(self):
        """Hang up: the peer sees EOF, and a thread of ours blocked in wait() wakes.
        The descriptors are closed only when the transport dies, so no waiting thread
        can end up polling a reused descriptor number; the mappings live until the
        last Message that points into them is gone."""
        cdef uint64_t one = 1
        if self.state == SHM_CONNECTED:
            self.state = RM_ERR_CLOSED
        if self.inherited():
            return      # a fork child: shutdown would hang up the parent's connection
        if self.sock >= 0:
            shutdown(self.sock, SHUT_RDWR)
        if self.my_evfd >= 0:
            write(self.my_evfd, &one, 8)

    # ---- user regions (rm_region.h; the data path checks them in _transport.pyx) ----

    cdef int _expose_region(self, uint64_t addr, uint64_t length, uint32_t access,
                            uint32_t tag, uint64_t file, rm_mem *out) noexcept nogil:
        """A user region: live memory the peer reads or writes by CMA (never a staged
        copy), its entry tagged (rm_region.h). ``file``: its memfd word (rm_shared.h),
        which the peer reads beside the mirrored entry, to map it (an atomic region
        needs one; reads and writes of any other copy through the mapping too)."""
        cdef uint32_t key, acc = 0
        cdef uint32_t known = RM_ACCESS_REMOTE_READ | RM_ACCESS_REMOTE_WRITE
        if self.xpriv == NULL or self.state != SHM_CONNECTED or self.inherited():
            return RM_ERR_CLOSED
        if not self.peer_cma or tag >> (32 - RM_XTAG_SHIFT):
            return RM_ERR_UNSUPPORTED
        if access & RM_ACCESS_REMOTE_READ:
            acc |= RM_XACC_READ
        if access & RM_ACCESS_REMOTE_WRITE:
            acc |= RM_XACC_WRITE
        if access & RM_ACCESS_REMOTE_ATOMIC:
            if file == 0 or self.xfile == NULL:
                return RM_ERR_UNSUPPORTED
            acc |= RM_XACC_ATOMIC
            known |= RM_ACCESS_REMOTE_ATOMIC
        if self.xfile == NULL:
            file = 0
        if acc == 0 or access & ~known:
            return RM_ERR_UNSUPPORTED
        rm_spin_lock(&self.xlock)
        key = rm_xtab_add(self.xpriv, addr, length, acc | (tag << RM_XTAG_SHIFT), RM_XNONE)
        if key != 0:        # the file word first: the mirrored key releases both
            self.xfile.file[key & 0xFF] = file
        rm_xtab_mirror(self.xtab, self.xpriv, key)
        rm_spin_unlock(&self.xlock)
        if key == 0:
            return RM_ERR_AGAIN
        out.handle = out.rkey = key
        return 0

    cdef int _atomic(self, rm_wr *wr, bint run) noexcept nogil:
        """fetch_add / compare_swap on a word of the peer's atomic region (rm_shared.h),
        run with my ``busy`` word odd (_post_exposed): the peer's revoke either makes
        the check below fail or waits until the instruction is done. The entry and its
        file word are read once from the peer's block and checked as read; the word is
        changed on my mapping of the peer's pages, made once per exposure. Without
        ``run`` only checked and mapped (a chain's check, before any of it runs)."""
        cdef rm_xent xe
        cdef rm_smap *m
        cdef uint32_t i = wr.rkey & 0xFF
        cdef uint64_t file, at = wr.remote_off
        cdef int rc = 0
        if self.state != SHM_CONNECTED:
            return self.state if self.state < 0 else RM_ERR_CLOSED
        if self.peer_xfile == NULL or self.smaps == NULL or not self.cma:
            return RM_ERR_UNSUPPORTED
        if not wr.flags & RM_WR_REGION or wr.length != 8 or at & 7 \
                or rm_xtab_find(self.peer_xtab, wr.rkey, at, 8, RM_XACC_ATOMIC, &xe) != 0 \
                or xe.access >> RM_XTAG_SHIFT != wr.imm:
            return RM_ERR_BOUNDS
        file = rm_load_acquire64(&self.peer_xfile.file[i])     # then the key again:
        if not rm_xtab_alive(self.peer_xtab, wr.rkey):
            return RM_ERR_BOUNDS        # withdrawn (or the slot reused) meanwhile
        m = &self.smaps[i]
        rm_spin_lock(&self.smap_lock)
        if m.map == NULL or m.key != wr.rkey or m.tag != wr.imm or m.file != file \
                or m.addr != xe.addr or m.len != xe.len:
            rc = rm_smap_make(m, self.pidfd, wr.rkey, wr.imm, file, xe.addr, xe.len)
        if rc == 0 and run:
            rm_smap_atomic(m, at, wr.opcode == RM_WR_CMP_SWAP, <uint64_t *>wr.local_addr)
        rm_spin_unlock(&self.smap_lock)
        if rc != 0:
            return RM_ERR_PEER_LOST if self._peer_exited() else RM_ERR_BOUNDS
        return 0

    cdef int _await_peer_region(self) noexcept nogil:
        """After a region's entry was withdrawn: wait while the peer's region access in
        progress, if any, goes on (rm_region.h); RM_ERR_AGAIN if it has not ended within
        the assist stall bound (a stopped peer)."""
        cdef uint64_t b0
        cdef int r
        cdef int64_t until = 0
        cdef uint32_t spins = 0
        if self.peer_rrec == NULL:
            return 0
        rm_fence_seq_cst()          # the retraction before the look (rm_region.h)
        b0 = rm_load_acquire64(&self.peer_rrec.busy)
        if not b0 & 1:
            return 0
        while rm_load_acquire64(&self.peer_rrec.busy) == b0:
            r = self._wait_step(&spins, &until, False)
            if r == WAIT_GONE:
                return 0            # it copies no more (its process is gone)
            if r == WAIT_STALLED:
                return RM_ERR_AGAIN
        return 0

    cdef int _wait_step(self, uint32_t *spins, int64_t *until, bint hangup) noexcept nogil:
        """One step of waiting for something the peer does (a copy it runs): spin, then
        yield; every 256th yield, WAIT_GONE if its process exited (or, with ``hangup``,
        its connection is down), WAIT_STALLED once the assist stall bound passed since
        the first look (``*until`` 0 before it), else WAIT_ON."""
        spins[0] += 1
        if spins[0] < 4096:
            rm_cpu_relax()
            return WAIT_ON
        sched_yield()
        if spins[0] % 256 != 0:
            return WAIT_ON
        if self._peer_exited() or (hangup and self.peer_state() < 0):
            return WAIT_GONE
        if until[0] == 0:
            until[0] = now_ns() + self.assist_stall_ns
        elif now_ns() > until[0]:
            return WAIT_STALLED
        return WAIT_ON

    cdef bint _peer_exited(self) noexcept nogil:
        cdef pollfd fd
        if self.pidfd < 0:
            return False
        fd.fd = self.pidfd
        fd.events = POLLIN
        fd.revents = 0
        return poll(&fd, 1, 0) > 0

    def region_refusal(self, uint32_t key, uint32_t tag, uint64_t addr, uint64_t length,
                       bint write, bint atomic=False) -> int:
        """Why the peer's mirror refuses a region request (rm_region.h RM_RWHY_*: 0 it
        does not, 1 not exposed under that key and tag, 2 outside it, 3 access; an
        ``atomic``'s word unaligned: 3)."""
        cdef int why
        if self.peer_xtab == NULL:
            return 1
        why = rm_region_why(self.peer_xtab, key, tag, addr, length,
                            RM_XACC_ATOMIC if atomic else
                            RM_XACC_WRITE if write else RM_XACC_READ)
        if why == RM_RWHY_OK and atomic and addr & 7:
            return RM_RWHY_ACCESS
        return why

    def expose_shared(self, uint64_t addr, uint64_t length, uint32_t access, int fd,
                      uint64_t offset) -> tuple:
        """Expose a region (``access`` with its tag, as expose()) that lies at
        ``offset`` of the memfd ``fd`` of this process, so the peer can map it (for
        atomics, and to copy through): (0, key) or (the transport's error code, 0)."""
        cdef rm_mem mem
        cdef uint64_t file = rm_xfile_word(fd, offset)
        cdef int rc
        if file == 0 and access & RM_ACCESS_REMOTE_ATOMIC:
            return RM_ERR_UNSUPPORTED, 0    # (any other access: copied by CMA then)
        with nogil:
            rc = self._expose_region(addr, length, access & 0xFF,
                                     access >> RM_ACCESS_TAG_SHIFT, file, &mem)
        return rc, (mem.rkey if rc == 0 else 0)

    @property
    def region_atomics(self) -> bool:
        """fetch_add / compare_swap on regions exposed "atomic" in shared memory: the
        peer's memfds are reachable (pidfd_getfd: a pidfd and cross-memory attach)."""
        return self.pidfd >= 0 and bool(self.cma) and bool(self.peer_cma)
