# The shm data path's copies (ShmTransport, _transport.pyx): a plain request into the
# peer's mapped regions (every eager message's), and a CMA copy to or from the peer's
# address space (rendezvous, remote memory). Inline: each is one call of the hot path.
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from rdmamw.transport._base cimport (
    RM_ERR_BOUNDS,
    RM_ERR_OS,
    RM_ERR_PEER_LOST,
    RM_NREGIONS,
    RM_WR_PUBLISH,
    RM_WR_READ,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    RM_WR_WRITE_IMM,
    rm_wr,
)
from rdmamw.transport.atomics cimport rm_store_release64
from rdmamw.providers.shm._endpoint cimport (
    ShmEndpoint,
    iovec,
    process_vm_readv,
    process_vm_writev,
)

cdef extern from "errno.h" nogil:
    int errno
    int EINTR, EPERM, ESRCH

cdef enum:
    CMA_CHUNK = 1 << 30     # process_vm_* move at most this much per call here


cdef inline int cma(int pid, bint write, char *local, uint64_t remote, uint64_t n) noexcept nogil:
    """Copy n bytes between our `local` and the peer's `remote` address: 0, or
    RM_ERR_PEER_LOST (gone), RM_ERR_BOUNDS (no such memory there), RM_ERR_OS."""
    cdef iovec l, r
    cdef ssize_t got
    cdef uint64_t done = 0
    while done < n:
        l.iov_base = local + done
        l.iov_len = min(n - done, <uint64_t>CMA_CHUNK)
        r.iov_base = <void *>(remote + done)
        r.iov_len = l.iov_len
        if write:
            got = process_vm_writev(pid, &l, 1, &r, 1, 0)
        else:
            got = process_vm_readv(pid, &l, 1, &r, 1, 0)
        if got <= 0:
            if got < 0 and errno == EINTR:
                continue
            if got < 0 and errno == ESRCH:
                return RM_ERR_PEER_LOST
            return RM_ERR_BOUNDS if got == 0 or errno != EPERM else RM_ERR_OS
        done += <uint64_t>got
    return 0


cdef inline bint plain_ok(ShmEndpoint t, rm_wr *wr) noexcept nogil:
    """A WRITE (IMM) or READ inside one of the peer's regions; PUBLISH words aligned."""
    if wr.rkey >= RM_NREGIONS or wr.remote_off > t.peer[wr.rkey].length \
            or wr.length > t.peer[wr.rkey].length - wr.remote_off:
        return False
    if wr.opcode != RM_WR_WRITE and wr.opcode != RM_WR_WRITE_IMM and wr.opcode != RM_WR_READ:
        return False
    return not (wr.flags & RM_WR_PUBLISH and ((wr.remote_off | wr.length | wr.local_addr) & 7))


cdef inline void do_plain(ShmEndpoint t, rm_wr *wr) noexcept nogil:
    """Run a request plain_ok accepted: a copy, or words stored with release order."""
    cdef uint64_t *dst
    cdef uint64_t *src
    cdef uint64_t w
    if wr.opcode == RM_WR_READ:
        memcpy(<void *>wr.local_addr, t.peer_addr[wr.rkey] + wr.remote_off, wr.length)
    elif wr.flags & RM_WR_PUBLISH:
        dst = <uint64_t *>(t.peer_addr[wr.rkey] + wr.remote_off)
        src = <uint64_t *>wr.local_addr
        for w in range(wr.length >> 3):
            rm_store_release64(&dst[w], src[w])
    else:
        memcpy(t.peer_addr[wr.rkey] + wr.remote_off, <void *>wr.local_addr, wr.length)
        t.bytes_written += wr.length
    if wr.flags & RM_WR_SIGNALED:
        t.n_signaled += 1
        t.complete_now(wr.wr_id, wr.opcode)
