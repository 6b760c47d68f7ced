# cython: freethreading_compatible = False
"""The ``shm`` provider's data path: mini-verbs between two processes on one host.

Each endpoint's block is a memfd both processes map. WRITE is a memcpy into the
peer's mapping; PUBLISH words are stored with release order; READ copies out of it.
Every work request is bounds-checked against the peer's regions before any of the
chain runs, so a bad request does nothing. Wake-ups are eventfds; the connection's
Unix socket stays open only to notice the peer dying (EOF).

Rendezvous: each side keeps an exposure table (rdmamw/include/rm_expose.h) in its
block, after the regions. A READ of the peer's exposed memory is checked against the
peer's table, then done as one copy with ``process_vm_readv`` (CMA) from the peer's
address space; a WRITE with ``process_vm_writev``. When the connection set-up found
CMA not permitted (ptrace rules) the exposing side copies the range into its staging
area (a second memfd both map) and the reader copies it from there. A large CMA READ or
WRITE is assisted (rdmamw/providers/shm/rm_assist.h): the exposing side, while idle, copies
part of it, so one message moves with two cores. A user region in shared memory is
copied through a mapping instead (_mapped.pxd)."""

from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ACCESS_TAG_SHIFT,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_OS,
    RM_ERR_PEER_LOST,
    RM_ERR_UNSUPPORTED,
    RM_WR_CMP_SWAP,
    RM_WR_EXPOSED,
    RM_WR_FETCH_ADD,
    RM_WR_PUBLISH,
    RM_WR_READ,
    RM_WR_REGION,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    rm_mem,
    rm_wr,
)
from rdmamw.transport.atomics cimport (
    rm_cpu_relax,
    rm_fence_seq_cst,
    rm_load_acquire32,
    rm_load_acquire64,
    rm_popcount64,
    rm_spin_lock,
    rm_spin_trylock,
    rm_spin_unlock,
    rm_store_release32,
    rm_store_release64,
)

from rdmamw.providers.shm._copy cimport CMA_CHUNK, cma, do_plain, plain_ok
from rdmamw.providers.shm._mapped cimport mapped_run
from rdmamw.providers.shm._endpoint cimport (
    ASSIST_ALIGN,
    RM_ASSIST_MAX_CHUNKS,
    RM_XACC_READ,
    RM_XACC_WRITE,
    RM_XNONE,
    RM_XTAG_SHIFT,
    SHM_CONNECTED,
    WAIT_ON,
    ShmEndpoint,
    POLLERR,
    POLLIN,
    POLLNVAL,
    iovec,
    poll,
    pollfd,
    process_vm_readv,
    process_vm_writev,
    rm_assist,
    rm_assist_claim,
    rm_assist_finish,
    rm_assist_offer,
    rm_assist_publish,
    rm_xent,
    rm_xtab_add,
    rm_xtab_alive,
    rm_xtab_del,
    rm_xtab_find,
    rm_xtab_fit,
    rm_xtab_mirror,
    rm_xtab_retract,
)

cdef extern from "sys/socket.h" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int shutdown(int fd, int how)
    int MSG_PEEK, MSG_DONTWAIT, SHUT_RDWR

cdef extern from "unistd.h" nogil:
    ssize_t read(int fd, void *buf, size_t n)
    ssize_t write(int fd, const void *buf, size_t n)
    int close(int fd)

cdef extern from "errno.h" nogil:
    int errno
    int EAGAIN, EINTR, EPERM, ESRCH

cdef enum:
    CMA_IOV = 256           # ranges of one vectored process_vm_* call (IOV_MAX is 1024)


cdef class ShmTransport(ShmEndpoint):
    """The shm endpoint's data path (its set-up: ShmEndpoint)."""

    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        """A chain of plain requests (every eager message's) runs here; the first
        EXPOSED one sends the whole chain to _post_exposed, before anything ran."""
        cdef uint32_t i
        if self.state != SHM_CONNECTED:
            return self.state if self.state < 0 else RM_ERR_CLOSED
        for i in range(n):      # validate the whole chain first: all or nothing
            if wrs[i].flags & RM_WR_EXPOSED:
                return self._post_exposed(wrs, n)
            if not plain_ok(self, &wrs[i]):
                return RM_ERR_BOUNDS
        for i in range(n):
            do_plain(self, &wrs[i])
        self.n_doorbells += 1
        self.n_wrs += n
        return 0

    cdef int _post_exposed(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        """A chain with region accesses runs with my ``busy`` word odd (rm_region.h):
        raised and fenced before any exposure is checked, so the peer's revoke either
        makes the check fail or waits for the chain to end. Threads may post region
        chains at the same time: the word is odd while any of them runs."""
        cdef uint32_t i
        cdef int rc
        for i in range(n):
            if wrs[i].flags & RM_WR_REGION:
                break
        else:
            return self._post(wrs, n)
        if self.rrec == NULL:
            return RM_ERR_UNSUPPORTED
        rm_spin_lock(&self.busy_lock)       # chains of several threads may overlap:
        if self.busy_chains == 0:           # busy stays odd until the last one ends
            self.busy_seq += 1
            rm_store_release64(&self.rrec.busy, (self.busy_seq << 1) | 1)
        self.busy_chains += 1
        rm_spin_unlock(&self.busy_lock)
        rm_fence_seq_cst()
        rc = self._post(wrs, n)
        rm_spin_lock(&self.busy_lock)
        self.busy_chains -= 1
        if self.busy_chains == 0:
            rm_store_release64(&self.rrec.busy, self.busy_seq << 1)
        rm_spin_unlock(&self.busy_lock)
        return rc

    cdef int _post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        """A chain with EXPOSED requests (rendezvous READ/WRITE, region accesses and
        atomics), run in its order."""
        cdef uint32_t i
        cdef rm_wr *wr
        cdef rm_xent xe
        cdef int rc
        if self.state != SHM_CONNECTED:
            return self.state if self.state < 0 else RM_ERR_CLOSED
        for i in range(n):      # validate the whole chain first: all or nothing
            wr = &wrs[i]
            if wr.opcode == RM_WR_FETCH_ADD or wr.opcode == RM_WR_CMP_SWAP:
                rc = self._atomic(wr, False)    # checked, its word mapped
                if rc != 0:
                    return rc
            elif wr.flags & RM_WR_EXPOSED:
                if self._check_exposed(wr, &xe) != 0:
                    return RM_ERR_BOUNDS
            elif not plain_ok(self, wr):
                return RM_ERR_BOUNDS
        i = 0
        while i < n:
            wr = &wrs[i]
            if not wr.flags & RM_WR_EXPOSED:
                do_plain(self, wr)
            elif (rc := mapped_run(self, wrs, &i, n)) != 0:
                if rc < 0:
                    return rc           # the peer's shared memory: copied (_mapped.pxd)
                continue
            elif self._in_run(wr, wr.opcode):
                rc = self._region_run(wrs, &i, n)
                if rc != 0:
                    return rc
                continue
            else:
                rc = self._exposed(wr)
                if rc != 0:
                    return rc
                if wr.flags & RM_WR_SIGNALED:
                    self.n_signaled += 1
                    self.complete_now(wr.wr_id, wr.opcode)
            i += 1
        self.n_doorbells += 1
        self.n_wrs += n
        return 0

    # ---- rendezvous ------------------------------------------------------------------

    cdef bint _in_run(self, rm_wr *wr, uint16_t opcode) noexcept nogil:
        """``wr`` goes in a vectored run of region accesses (_region_run): an unsignaled
        region READ/WRITE of ``opcode`` too small to ask the peer's help, by CMA."""
        return (wr.flags & (RM_WR_EXPOSED | RM_WR_REGION | RM_WR_SIGNALED)) \
            == (RM_WR_EXPOSED | RM_WR_REGION) and wr.opcode == opcode \
            and (wr.opcode == RM_WR_READ or wr.opcode == RM_WR_WRITE) and self.cma \
            and not (self.assist_min and wr.length >= self.assist_min and self.peer_cma
                     and self.job != NULL)

    cdef int _region_run(self, rm_wr *wrs, uint32_t *at, uint32_t n) noexcept nogil:
        """The region accesses from ``wrs[*at]`` on that go together (_in_run; _post
        checked them), up to CMA_IOV, as one vectored process_vm_readv/writev; ``*at``
        moves past them. Their exposures are re-checked after it, as in _exposed."""
        cdef iovec l[CMA_IOV], r[CMA_IOV]
        cdef uint32_t i = at[0], j = at[0], k = 0
        cdef uint16_t opcode = wrs[i].opcode
        cdef uint64_t total = 0
        cdef ssize_t got
        cdef bint write = opcode == RM_WR_WRITE
        while j < n and k < CMA_IOV and self._in_run(&wrs[j], opcode) \
                and total + wrs[j].length <= CMA_CHUNK:
            l[k].iov_base = <void *>wrs[j].local_addr
            l[k].iov_len = wrs[j].length
            r[k].iov_base = <void *>wrs[j].remote_off
            r[k].iov_len = wrs[j].length
            total += wrs[j].length
            k += 1
            j += 1
        while True:
            if write:
                got = process_vm_writev(self.peer_pid, l, k, r, k, 0)
            else:
                got = process_vm_readv(self.peer_pid, l, k, r, k, 0)
            if got >= 0 or errno != EINTR:
                break
        if got != <ssize_t>total:
            if (got < 0 and errno == ESRCH) or self._peer_exited() or self.peer_state() < 0:
                return RM_ERR_PEER_LOST
            return RM_ERR_OS if got < 0 and errno == EPERM else RM_ERR_BOUNDS
        if self._peer_exited():         # the pid may have been reused: not our data
            return RM_ERR_PEER_LOST
        while i < j:
            if not rm_xtab_alive(self.peer_xtab, wrs[i].rkey):
                return RM_ERR_BOUNDS    # un-exposed during the copy: the data is not sure
            i += 1
        if write:
            self.bytes_written += total
        at[0] = j
        return 0

    cdef int _check_exposed(self, rm_wr *wr, rm_xent *xe) noexcept nogil:
        """An EXPOSED READ/WRITE must lie inside what the peer exposed, with the access."""
        cdef uint32_t acc
        if wr.opcode == RM_WR_READ:
            acc = RM_XACC_READ
        elif wr.opcode == RM_WR_WRITE:
            acc = RM_XACC_WRITE
        else:
            return -1
        if self.peer_xtab == NULL or wr.flags & RM_WR_PUBLISH:
            return -1
        if rm_xtab_find(self.peer_xtab, wr.rkey, wr.remote_off, wr.length, acc, xe) != 0:
            return -1
        # a region request needs its region's tag; a rendezvous one an untagged entry
        if xe.access >> RM_XTAG_SHIFT != (wr.imm if wr.flags & RM_WR_REGION else 0):
            return -1
        return 0

    cdef int _exposed(self, rm_wr *wr) noexcept nogil:
        """Do one EXPOSED READ/WRITE: CMA, or a copy out of the peer's staging area;
        or an atomic (checked again: _atomic)."""
        cdef rm_xent xe
        cdef uint64_t off
        cdef int rc
        if wr.opcode == RM_WR_FETCH_ADD or wr.opcode == RM_WR_CMP_SWAP:
            return self._atomic(wr, True)
        if self._check_exposed(wr, &xe) != 0:
            return RM_ERR_BOUNDS
        if xe.staged != RM_XNONE:
            if wr.opcode != RM_WR_READ:
                return RM_ERR_BOUNDS
            off = xe.staged + (wr.remote_off - xe.addr)
            if off > self.peer_arena_size or wr.length > self.peer_arena_size - off:
                return RM_ERR_BOUNDS
            memcpy(<void *>wr.local_addr, self.peer_arena + off, wr.length)
        else:
            if not self.cma:
                return RM_ERR_BOUNDS
            if self.assist_min and wr.length >= self.assist_min and self.peer_cma \
                    and self.job != NULL:
                rc = self._assisted(wr)
            else:
                rc = cma(self.peer_pid, wr.opcode == RM_WR_WRITE, <char *>wr.local_addr,
                          wr.remote_off, wr.length)
            if rc != 0:
                if self._peer_exited() or self.peer_state() < 0:
                    return RM_ERR_PEER_LOST
                return rc
            if self._peer_exited():     # the pid may have been reused: not our data
                return RM_ERR_PEER_LOST
        if not rm_xtab_alive(self.peer_xtab, wr.rkey):
            return RM_ERR_BOUNDS        # un-exposed during the copy: the data is not sure
        if wr.opcode == RM_WR_WRITE:
            self.bytes_written += wr.length
        return 0

    cdef int _assisted(self, rm_wr *wr) noexcept nogil:
        """_assisted_one, if no other thread of mine has the job record now (a region
        read beside a rendezvous READ); else one plain CMA copy."""
        cdef int rc
        if not rm_spin_trylock(&self.job_lock):
            return cma(self.peer_pid, wr.opcode == RM_WR_WRITE, <char *>wr.local_addr,
                        wr.remote_off, wr.length)
        rc = self._assisted_one(wr)
        rm_spin_unlock(&self.job_lock)
        return rc

    cdef int _assisted_one(self, rm_wr *wr) noexcept nogil:
        """A CMA READ or WRITE the peer may help with (rm_assist.h): publish the job,
        wake the peer, copy every chunk it has not claimed, wait for the ones it has,
        redo any it could not do. Returns as _cma does; no helper copy is still running
        when it returns."""
        # the record sits in my block, which the peer can write: n, chunk and len are
        # this function's own, claims are checked against them, fin/bad are masked
        cdef uint64_t len = wr.length, chunk, off, mine = 0, theirs, full, fin, bad
        cdef uint32_t n, seq, spins = 0
        cdef int64_t until = 0
        cdef bint write = wr.opcode == RM_WR_WRITE
        cdef int i, rc = 0
        n = <uint32_t>((len + self.assist_chunk - 1) // self.assist_chunk)
        if n > RM_ASSIST_MAX_CHUNKS:
            n = RM_ASSIST_MAX_CHUNKS
        chunk = (len + n - 1) // n
        chunk = (chunk + ASSIST_ALIGN - 1) // ASSIST_ALIGN * ASSIST_ALIGN
        n = <uint32_t>((len + chunk - 1) // chunk)
        if n < 2:
            return cma(self.peer_pid, write, <char *>wr.local_addr, wr.remote_off, len)
        self.job_seq += 1
        if self.job_seq == 0:
            self.job_seq = 1
        seq = self.job_seq
        rm_assist_publish(self.job, seq, write, wr.remote_off, wr.local_addr, len, chunk,
                          wr.rkey, n)
        self.n_assist_jobs += 1
        self.wake_peer()
        while True:
            i = rm_assist_claim(self.job, seq, n, &mine)
            if i < 0:
                break
            if rc == 0:             # after a failure: only claim, so nobody starts more
                off = <uint64_t>i * chunk
                rc = cma(self.peer_pid, write, <char *>wr.local_addr + off,
                          wr.remote_off + off, min(chunk, len - off))
        full = ~(<uint64_t>0) if n == 64 else ((<uint64_t>1) << n) - 1
        theirs = full & ~mine
        while True:                 # the peer's chunks: being copied now, they end soon
            fin = rm_load_acquire64(&self.job.fin)
            if (fin & theirs) == theirs:
                break
            if self._wait_step(&spins, &until, True) != WAIT_ON:
                return RM_ERR_PEER_LOST     # gone, or stopped mid-chunk: see docs/api.md
        bad = rm_load_acquire64(&self.job.bad) & theirs
        self.n_assist_chunks_got += rm_popcount64(theirs & ~bad)
        i = 0
        while rc == 0 and bad:      # the peer could not: do them here
            if bad & 1:
                off = <uint64_t>i * chunk
                rc = cma(self.peer_pid, write, <char *>wr.local_addr + off,
                          wr.remote_off + off, min(chunk, len - off))
            bad >>= 1
            i += 1
        return rc

    cdef int assist(self) noexcept nogil:
        """Help with the peer's assisted READ or WRITE on offer, if any: claim chunks
        of it and copy them (READ: push with process_vm_writev; WRITE: pull with
        process_vm_readv); the number of chunks done.

        The job record is in the peer's block: its fields are read once into ``j`` and
        only that copy is checked and used; chunks are claimed against this copy's
        ``n``. The range must lie in an entry of my *private* exposure table with the
        job's access (not staged), and stay exposed for each chunk (``unexpose`` waits
        for the chunk in progress). Only when the peer could copy by itself (it reads
        me by CMA): help never needs more privilege than the peer has."""
        cdef rm_assist j
        cdef rm_xent xe
        cdef uint32_t seq, n
        cdef uint64_t off, piece, taken = 0
        cdef int i, rc, did = 0
        cdef bint ok
        if self.peer_job == NULL or self.xpriv == NULL or not self.cma \
                or not self.peer_cma or self.state != SHM_CONNECTED or self.inherited():
            return 0
        seq = rm_assist_offer(self.peer_job, &j)
        if seq == 0:
            return 0
        n = (j.claim >> 8) & 0xFF
        if n < 2 or n > RM_ASSIST_MAX_CHUNKS or j.chunk == 0 or j.chunk > j.len \
                or (n - 1) * j.chunk >= j.len or n * j.chunk < j.len or j.write > 1:
            return 0
        if not rm_spin_trylock(&self.assist_busy):
            return 0                # my other engine thread is helping already
        rm_spin_lock(&self.xlock)
        ok = rm_xtab_find(self.xpriv, j.key, j.remote, j.len,
                          RM_XACC_WRITE if j.write else RM_XACC_READ, &xe) == 0 \
            and xe.staged == RM_XNONE
        if ok:
            rm_store_release32(&self.assist_key, j.key)
        rm_spin_unlock(&self.xlock)
        while ok:
            i = rm_assist_claim(self.peer_job, seq, n, &taken)
            if i < 0:
                break
            off = <uint64_t>i * j.chunk
            piece = min(j.chunk, j.len - off)
            if not rm_xtab_alive(self.xpriv, j.key) or self._peer_exited():
                rc = RM_ERR_BOUNDS  # un-exposed meanwhile, or the pid is not the peer's
            else:
                # my exposed range is the local side; READ: I write the peer, WRITE: I read it
                rc = cma(self.peer_pid, not j.write, <char *>(j.remote + off), j.local + off,
                          piece)
            rm_assist_finish(self.peer_job, i, rc == 0)
            if rc == 0:
                self.bytes_assist_given += piece
            did += 1
        rm_store_release32(&self.assist_key, 0)
        rm_spin_unlock(&self.assist_busy)
        return did

    cdef int expose(self, uint64_t addr, uint64_t length, uint32_t access,
                    rm_mem *out) noexcept nogil:
        """The engine's send thread (sources) and receive thread (posted destinations)
        may both call this: the table is changed under ``xlock``. A staged copy is
        made after its range was reserved, outside the lock; the peer cannot name the
        key before the descriptor that carries it."""
        cdef uint64_t staged = RM_XNONE
        cdef uint32_t key, tag = access >> RM_ACCESS_TAG_SHIFT
        out.handle = out.lkey = out.rkey = 0
        if tag:
            return self._expose_region(addr, length, access & 0xFF, tag, 0, out)
        if access == RM_ACCESS_LOCAL:
            return 0
        if self.xpriv == NULL or self.state != SHM_CONNECTED or self.inherited():
            return RM_ERR_CLOSED        # (a fork child: the table is the parent's)
        if access == RM_ACCESS_REMOTE_WRITE:
            if not self.peer_cma:
                return RM_ERR_UNSUPPORTED
            rm_spin_lock(&self.xlock)
            key = rm_xtab_add(self.xpriv, addr, length, RM_XACC_WRITE, RM_XNONE)
            rm_xtab_mirror(self.xtab, self.xpriv, key)
            rm_spin_unlock(&self.xlock)
        elif access == RM_ACCESS_REMOTE_READ:
            if not self.peer_cma and length > self.arena_size:
                return RM_ERR_UNSUPPORTED
            rm_spin_lock(&self.xlock)
            if not self.peer_cma:       # stage a copy where the peer can map it
                staged = rm_xtab_fit(self.xpriv, self.arena_size, length)
                if staged == RM_XNONE:
                    rm_spin_unlock(&self.xlock)
                    return RM_ERR_AGAIN     # wait for done bits to free some
            key = rm_xtab_add(self.xpriv, addr, length, RM_XACC_READ, staged)
            rm_spin_unlock(&self.xlock)
            if key != 0 and staged != RM_XNONE:
                memcpy(self.arena + staged, <void *>addr, length)
            rm_spin_lock(&self.xlock)   # the peer may look only once the copy is there
            rm_xtab_mirror(self.xtab, self.xpriv, key)
            rm_spin_unlock(&self.xlock)
        else:
            return RM_ERR_UNSUPPORTED
        if key == 0:
            return RM_ERR_AGAIN
        out.handle = out.rkey = key
        return 0

    cdef int unexpose(self, uint32_t handle) noexcept nogil:
        """Withdraw a range; returns once no helper copy of mine touches it any more,
        and for a region once the peer's region access in progress (if any) ended:
        RM_ERR_AGAIN if it did not within the assist stall bound (a stopped peer)."""
        cdef rm_xent xe
        cdef bint region = False
        if self.xpriv != NULL and not self.inherited():
            rm_spin_lock(&self.xlock)
            if rm_xtab_del(self.xpriv, handle, &xe):
                rm_xtab_retract(self.xtab, handle)
                region = xe.access >> RM_XTAG_SHIFT != 0
            rm_spin_unlock(&self.xlock)
            while handle != 0 and rm_load_acquire32(&self.assist_key) == handle:
                rm_cpu_relax()      # one chunk of assist() (my other thread) in progress
        if not region:
            return 0
        return self._await_peer_region()

    cdef int wake_self(self) noexcept nogil:
        cdef uint64_t one = 1
        if self.my_evfd >= 0:
            write(self.my_evfd, &one, 8)
        return 0

    cdef int wake_peer(self) noexcept nogil:
        cdef uint64_t one = 1
        if self.peer_evfd < 0 or self.state != SHM_CONNECTED:
            return RM_ERR_CLOSED
        self.n_wakeups += 1
        if write(self.peer_evfd, &one, 8) != 8 and errno != EAGAIN:
            return RM_ERR_OS
        return 0

    cdef int wait(self, int timeout_ms) noexcept nogil:
        cdef pollfd fds[3]
        cdef uint64_t junk
        cdef int r, nfds = 2
        if self.my_evfd < 0 or self.state != SHM_CONNECTED:
            return self.state if self.state < 0 else RM_ERR_CLOSED
        if self.assist() > 0:
            return 1                # time passed: let the caller look again
        fds[0].fd = self.my_evfd
        fds[0].events = POLLIN
        fds[0].revents = 0
        fds[1].fd = self.sock
        fds[1].events = POLLIN
        fds[1].revents = 0
        if self.pidfd >= 0:     # the peer process exiting: readable (a child of it that
            fds[2].fd = self.pidfd  # kept the socket keeps the socket's EOF away)
            fds[2].events = POLLIN
            fds[2].revents = 0
            nfds = 3
        r = poll(fds, nfds, timeout_ms)
        if r < 0:
            return 0 if errno == EINTR else RM_ERR_OS
        if r == 0:
            return 0
        if fds[0].revents & POLLIN:
            read(self.my_evfd, &junk, 8)
            self.assist()
        if fds[1].revents or (nfds == 3 and fds[2].revents):
            return self.peer_state()
        return 1

    def _event_fds(self):
        # the peer's wake-ups; its hang-up; its process's exit (the pidfd)
        if self.pidfd >= 0:
            return (self.my_evfd, self.sock, self.pidfd)
        return (self.my_evfd, self.sock)

    cdef int arm_fd(self) noexcept nogil:
        cdef uint64_t junk
        if self.my_evfd < 0 or self.state != SHM_CONNECTED:
            return self.state if self.state < 0 else RM_ERR_CLOSED
        read(self.my_evfd, &junk, 8)        # non-blocking: empty is fine
        return 0

    cdef int peer_state(self) noexcept nogil:
        cdef pollfd fd
        cdef char c
        cdef ssize_t r
        if self.state != SHM_CONNECTED:
            return self.state
        if self._peer_exited():
            # the peer process is gone, whoever still holds a copy of the socket (a
            # child it forked): liveness is the process's, not only the socket's
            self.state = RM_ERR_PEER_LOST
            shutdown(self.sock, SHUT_RDWR)
            return self.state
        fd.fd = self.sock
        fd.events = POLLIN
        fd.revents = 0
        if poll(&fd, 1, 0) <= 0:
            return 1
        if fd.revents & (POLLERR | POLLNVAL):
            self.state = RM_ERR_PEER_LOST
            return self.state
        r = recv(self.sock, &c, 1, MSG_PEEK | MSG_DONTWAIT)
        if r == 0 or (r < 0 and errno != EAGAIN and errno != EINTR):
            self.state = RM_ERR_PEER_LOST      # the engine tells a clean close by CTRL
            return self.state
        if r > 0:
            # nothing is sent on the kept socket after the handshake: a byte there is a
            # breach of the protocol, and left unread it would wake every later wait
            # at once (a wait spinning a core); the peer is lost
            self.state = RM_ERR_PEER_LOST
            shutdown(self.sock, SHUT_RDWR)
            return self.state
        return 1
