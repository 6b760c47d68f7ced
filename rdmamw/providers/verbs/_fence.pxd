# The order of a region chain on verbs (docs/remote-memory.md, "Atomics in a batch";
# _regions.pyx): the device executes a QP's requests in order, but may begin a WRITE
# (or an atomic) before an earlier READ has taken its data from the owner's memory,
# and a WRITE before an earlier atomic was answered (InfiniBand's fence rule). So a
# WRITE after a READ or an atomic of its chain, and an atomic after a READ, carry
# RM_WR_FENCE (IBV_SEND_FENCE: it begins once the earlier READs and atomics
# completed); only the first such one after them: those behind it wait for it. An
# atomic after atomics is not fenced: the QP has one READ or atomic outstanding at
# most (max_rd_atomic 1), and fencing each would cost a round trip apiece if it had
# more. Inline, cimported by _regions.pyx and the test hooks.
from libc.stdint cimport uint32_t

from rdmamw.transport._base cimport (
    RM_WR_CMP_SWAP,
    RM_WR_FENCE,
    RM_WR_FETCH_ADD,
    RM_WR_READ,
    RM_WR_WRITE,
    rm_wr,
)


cdef inline void chain_fences(rm_wr *wrs, uint32_t n) noexcept nogil:
    """Set RM_WR_FENCE on the WRs of the chain ``wrs`` that need it (see above)."""
    cdef uint32_t i
    cdef bint after_read = False, after_atomic = False, atomic
    for i in range(n):
        atomic = wrs[i].opcode == RM_WR_FETCH_ADD or wrs[i].opcode == RM_WR_CMP_SWAP
        if wrs[i].opcode == RM_WR_READ:
            after_read = True
        elif after_read or (after_atomic and wrs[i].opcode == RM_WR_WRITE):
            wrs[i].flags |= RM_WR_FENCE
            after_read = after_atomic = False
        after_atomic = after_atomic or atomic
