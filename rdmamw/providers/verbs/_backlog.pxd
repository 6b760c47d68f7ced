# The send queue's overflow (docs/protocol.md "A peer that takes nothing"): the WRs a
# post could not place in a full send queue by its caller's deadline. A stopped peer
# takes nothing: each wake-up SEND or WRITE_WITH_IMM to it uses one of its receive
# WRs, none are reposted, the QP waits for it (RNR) and every WR behind waits too.
# Such a post is accepted here (RM_ERR_LATE, like tcp's queued frames), not waited
# on past the deadline; these WRs go first, in order, as the queue frees. The bytes a
# WR carries inline are copied as they are at the post, as the NIC would have; a
# control word written again while still queued is updated in place (the peer needs
# its last value, not every toggle), so what a stopped peer holds up stays bounded by
# its ring. Owned by the transport's post lock.
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from rdmamw.transport._base cimport (
    RM_REGION_CTRL,
    RM_WR_EXPOSED,
    RM_WR_SIGNALED,
    rm_wr,
)


ctypedef struct rmv_backlog:
    rm_wr *wrs              # a ring of cap entries from head (malloc'd at first use)
    uint8_t *data           # each entry's inline bytes (cap x inl)
    uint32_t head, len, cap, inl
    uint32_t off            # bytes of the head entry (a long READ) already posted
    bint wake               # a wake-up SEND is due once they have gone
    uint64_t accepted       # WRs ever queued here (counters: wrs_held)


cdef inline void bl_free(rmv_backlog *b) noexcept nogil:
    free(b.wrs)
    free(b.data)
    b.wrs, b.data, b.len = NULL, NULL, 0


cdef inline bint _inline_bytes(const rm_wr *wr, uint32_t max_inline) noexcept nogil:
    return not wr.flags & RM_WR_EXPOSED and 0 < wr.length <= max_inline


cdef inline bint bl_reserve(rmv_backlog *b, uint32_t n, uint32_t max_inline) noexcept nogil:
    """Whether ``n`` more entries fit (allocated at the first use); False: the caller
    waits for the send queue as it did before there was a backlog."""
    if b.wrs == NULL:
        b.inl = max_inline if max_inline > 8 else 8
        b.wrs = <rm_wr *>malloc(b.cap * sizeof(rm_wr))
        b.data = <uint8_t *>malloc(<size_t>b.cap * b.inl)
        if b.wrs == NULL or b.data == NULL:
            bl_free(b)
            return False
    return b.cap - b.len >= n


cdef inline void bl_push(rmv_backlog *b, const rm_wr *wr, uint32_t off,
                         uint32_t max_inline) noexcept nogil:
    """Queue ``wr`` from its byte ``off`` on (the rest of a long READ), in the room
    bl_reserve() found."""
    cdef uint32_t s = b.cap, j
    cdef rm_wr *e
    if wr.rkey == RM_REGION_CTRL and not wr.flags & (RM_WR_EXPOSED | RM_WR_SIGNALED):
        for j in range(b.len):      # the same control word, still queued: update it
            e = &b.wrs[(b.head + j) % b.cap]
            if e.rkey == RM_REGION_CTRL and e.remote_off == wr.remote_off and \
                    e.length == wr.length and not e.flags & (RM_WR_EXPOSED | RM_WR_SIGNALED):
                s = (b.head + j) % b.cap
                break
    if s == b.cap:
        s = (b.head + b.len) % b.cap
        b.len += 1
    e = &b.wrs[s]
    e[0] = wr[0]
    e.local_addr += off
    e.remote_off += off
    e.length -= off
    if _inline_bytes(e, max_inline):
        memcpy(b.data + <size_t>s * b.inl, <void *>e.local_addr, e.length)
        e.local_addr = <uint64_t>(b.data + <size_t>s * b.inl)
    b.accepted += 1


cdef inline void bl_pop(rmv_backlog *b, uint32_t n, uint32_t off) noexcept nogil:
    """``n`` entries have gone; ``off`` bytes of the next one too."""
    b.head = (b.head + n) % b.cap
    b.len -= n
    b.off = off
