# One endpoint's block (control words, bitmaps, the ring the peer writes) and the ring
# that grows both ways: the parts of mine registered and granted, the peer's granted me.
from libc.stdint cimport uint32_t, uint64_t

from rdmamw.providers.verbs._ibverbs cimport ibv_mr, ibv_mw
from rdmamw.providers.verbs._memory cimport VerbsMemory

cdef enum:
    MAX_PARTS = 40             # parts of a ring that grows (doubling from one slot)
    GRANT_OFF = 1536           # the grant words: control-page words 192..231 (bytes)


cdef inline uint32_t next_grant(uint32_t have, uint32_t slots, uint64_t ask) noexcept nogil:
    """The slots to have granted after one more grant, of a ring of ``slots`` with
    ``have`` granted: what the peer's credit flag asks for (``ask``, read once from
    memory it writes: any value) in one grant, bounded by the ring; a flag of 1 (or
    no more than granted) asks as before, for as many slots again."""
    if ask > have:
        return <uint32_t>min(<uint64_t>slots, ask)
    return min(slots, max(2 * have, have + 1))


cdef class VerbsBlock:
    # the block (mmap: zero pages on demand) and its first part, registered at connect:
    # the header (control words, bitmaps) and the first slots of my ring, or all of it
    cdef VerbsMemory mem
    cdef char *base
    cdef uint64_t length
    cdef ibv_mr *head_mr
    cdef ibv_mw *head_mw                # with windows: the one the peer writes through
    cdef readonly uint32_t head_rkey    # the key the peer gets for the header
    # my ring: the slots the peer may write are registered in parts; offer() registers
    # the next part
    cdef readonly bint on               # my ring started short of its size
    cdef readonly uint32_t slots        # my ring's size, in slots
    cdef uint64_t stride, off           # its slots' stride, where it starts in the block
    cdef readonly uint32_t granted      # slots the peer may write
    cdef uint32_t pending               # slots of a part registered, its word not sent
    cdef ibv_mr *mrs[MAX_PARTS]         # the parts registered after the first
    cdef ibv_mw *mws[MAX_PARTS]         # with windows: theirs (bound with the grant)
    cdef uint32_t n_mrs
    cdef uint64_t charged               # their bytes, charged to the pinned budget
    cdef int lock                       # offer(): one at a time
    cdef bint stopped                   # the budget or a registration said no
    cdef uint64_t *words                # the grant words, as posted (registered)
    cdef ibv_mr *words_mr
    cdef readonly uint64_t given, taken
    # the peer's ring: the parts granted so far (part p: ring bytes below part_end[p],
    # key part_rkey[p]); every WRITE into it stays below ``limit``
    cdef readonly uint32_t peer_slots, peer_granted     # peer_granted 0: all
    cdef uint64_t peer_stride
    cdef readonly uint64_t limit
    cdef uint64_t part_end[MAX_PARTS]
    cdef uint32_t part_rkey[MAX_PARTS]
    cdef uint32_t n_parts
    cdef bint peer_bad                  # a grant word failed its checks: take no more

    cdef int offer(self, uint64_t ask) noexcept nogil
    cdef void done(self, bint posted) noexcept nogil
    cdef bint take(self, const char *ctrl) noexcept nogil
    cdef void drop_windows(self) noexcept
    cdef inline uint32_t rkey_of(self, uint64_t off) noexcept nogil:
        """The key of the peer's ring part that holds ring offset ``off`` (most slots
        are in the last part: one compare)."""
        cdef uint32_t p = self.n_parts - 1
        while p and off < self.part_end[p - 1]:
            p -= 1
        return self.part_rkey[p]
    cdef void release(self) noexcept
