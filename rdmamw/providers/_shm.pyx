# cython: freethreading_compatible = False
"""The ``shm`` provider's data path: mini-verbs between two processes on one host.

Each endpoint's block is a memfd both processes map. WRITE is a memcpy into the
peer's mapping; PUBLISH words are stored with release order; READ copies out of it.
Every work request is bounds-checked against the peer's regions before any of the
chain runs, so a bad request does nothing. Wake-ups are eventfds; the connection's
Unix socket stays open only to notice the peer dying (EOF)."""

from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy

from rdmamw._core cimport (
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_OS,
    RM_ERR_PEER_LOST,
    RM_NREGIONS,
    RM_WR_PUBLISH,
    RM_WR_READ,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    RM_WR_WRITE_IMM,
    Transport,
    rm_wr,
)
from rdmamw.bitmap._phase cimport rm_store_release64

cdef extern from "sys/mman.h" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int PROT_READ, PROT_WRITE, MAP_SHARED
    void *MAP_FAILED

cdef extern from "poll.h" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    short POLLIN, POLLHUP, POLLERR, POLLNVAL

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
    int EAGAIN, EINTR

cdef class ShmTransport(Transport):
    cdef char *my_base
    cdef size_t my_size
    cdef char *peer_base
    cdef size_t peer_size
    cdef char *peer_addr[RM_NREGIONS]
    cdef int sock
    cdef int my_evfd
    cdef int peer_evfd
    cdef int state

    def __cinit__(self):
        self.sock = -1
        self.my_evfd = -1
        self.peer_evfd = -1
        self.state = RM_ERR_CLOSED
        self.direct_source = True
        self.synchronous = True
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
        self.state = 1

    def __dealloc__(self):
        self._close_fds()
        if self.my_base != NULL:
            munmap(self.my_base, self.my_size)
        if self.peer_base != NULL:
            munmap(self.peer_base, self.peer_size)

    cdef void _close_fds(self) noexcept:
        if self.sock >= 0:
            close(self.sock)
        if self.my_evfd >= 0:
            close(self.my_evfd)
        if self.peer_evfd >= 0:
            close(self.peer_evfd)
        self.sock = self.my_evfd = self.peer_evfd = -1

    def close(self):
        """Hang up: the peer sees EOF, and a thread of ours blocked in wait() wakes.
        The descriptors are closed only when the transport dies, so no waiting thread
        can end up polling a reused descriptor number; the mappings live until the
        last Message that points into them is gone."""
        cdef uint64_t one = 1
        if self.state == 1:
            self.state = RM_ERR_CLOSED
        if self.sock >= 0:
            shutdown(self.sock, SHUT_RDWR)
        if self.my_evfd >= 0:
            write(self.my_evfd, &one, 8)

    cdef int post(self, rm_wr *wrs, uint32_t n) noexcept nogil:
        cdef uint32_t i, w
        cdef rm_wr *wr
        cdef uint64_t *dst
        cdef uint64_t *src
        if self.state != 1:
            return self.state if self.state < 0 else RM_ERR_CLOSED
        for i in range(n):      # validate the whole chain first: all or nothing
            wr = &wrs[i]
            if wr.rkey >= RM_NREGIONS or wr.remote_off > self.peer[wr.rkey].length \
                    or wr.length > self.peer[wr.rkey].length - wr.remote_off:
                return RM_ERR_BOUNDS
            if wr.opcode != RM_WR_WRITE and wr.opcode != RM_WR_WRITE_IMM \
                    and wr.opcode != RM_WR_READ:
                return RM_ERR_BOUNDS
            if wr.flags & RM_WR_PUBLISH and ((wr.remote_off | wr.length | wr.local_addr) & 7):
                return RM_ERR_BOUNDS
        for i in range(n):
            wr = &wrs[i]
            if wr.opcode == RM_WR_READ:
                memcpy(<void *>wr.local_addr, self.peer_addr[wr.rkey] + wr.remote_off, wr.length)
            elif wr.flags & RM_WR_PUBLISH:
                dst = <uint64_t *>(self.peer_addr[wr.rkey] + wr.remote_off)
                src = <uint64_t *>wr.local_addr
                for w in range(wr.length >> 3):
                    rm_store_release64(&dst[w], src[w])
            else:
                memcpy(self.peer_addr[wr.rkey] + wr.remote_off, <void *>wr.local_addr, wr.length)
                self.bytes_written += wr.length
            if wr.flags & RM_WR_SIGNALED:
                self.n_signaled += 1
                self.complete_now(wr.wr_id, wr.opcode)
        self.n_doorbells += 1
        self.n_wrs += n
        return 0

    cdef int wake_peer(self) noexcept nogil:
        cdef uint64_t one = 1
        if self.peer_evfd < 0 or self.state != 1:
            return RM_ERR_CLOSED
        self.n_wakeups += 1
        if write(self.peer_evfd, &one, 8) != 8 and errno != EAGAIN:
            return RM_ERR_OS
        return 0

    cdef int wait(self, int timeout_ms) noexcept nogil:
        cdef pollfd fds[2]
        cdef uint64_t junk
        cdef int r
        if self.my_evfd < 0 or self.state != 1:
            return self.state if self.state < 0 else RM_ERR_CLOSED
        fds[0].fd = self.my_evfd
        fds[0].events = POLLIN
        fds[0].revents = 0
        fds[1].fd = self.sock
        fds[1].events = POLLIN
        fds[1].revents = 0
        r = poll(fds, 2, timeout_ms)
        if r < 0:
            return 0 if errno == EINTR else RM_ERR_OS
        if r == 0:
            return 0
        if fds[0].revents & POLLIN:
            read(self.my_evfd, &junk, 8)
        if fds[1].revents:
            return self.peer_state()
        return 1

    cdef int peer_state(self) noexcept nogil:
        cdef pollfd fd
        cdef char c
        cdef ssize_t r
        if self.state != 1:
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
        return 1
