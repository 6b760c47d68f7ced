# The engine's wire formats (docs/protocol.md): slot headers, packed records,
# rendezvous descriptors and the indices of the control words. Declared once here;
# every engine unit cimports what it reads or writes.
from libc.stdint cimport uint16_t, uint32_t, uint64_t

ctypedef struct rm_slot_hdr:
    uint64_t seq        # slot sequence number in this direction: 0, 1, 2, ...
    uint32_t used       # payload bytes used
    uint16_t count      # messages in the slot
    uint16_t flags      # SLOT_SINGLE or SLOT_PACKED
    uint32_t check      # ~(uint32)seq: catches a torn or garbage header
    uint32_t reserved

cdef enum:
    SLOT_SINGLE = 1     # one message, payload at offset 0
    SLOT_PACKED = 2     # records {uint32 len, uint32 flags, bytes, pad to 8}
    HDR_BYTES = 24      # sizeof(rm_slot_hdr)
    SLOT_HEADER = 64    # header line before the payload
    REC_HDR = 8

cdef enum:
    CTRL_CREDIT_WAIT = 0    # word index (x8 bytes): see rdmamw/transport/layout.py
    CTRL_RX_SLEEP = 8
    CTRL_CLOSED = 16
    CTRL_MAX_MSG = 64       # the largest message the peer takes (0: not announced)
    CTRL_RNDV_DONE = 128    # rendezvous-done bitmap (one word: RNDV_N entries)
    CTRL_ADVERT = 256       # RNDV_N advertised destinations of 4 words (docs/protocol.md)
    # words 192..231: the verbs provider's ring grants (providers/verbs/_block.pxd GRANT_OFF)

# a record whose payload is a descriptor: the message itself is READ or was WRITTEN
ctypedef struct rm_desc:
    uint64_t addr       # READ: the sender's address of the message (inside its exposure)
    uint64_t length     # bytes of the message
    uint64_t index      # rendezvous sequence number in this direction: 0, 1, 2, ...
    uint32_t key        # READ: the sender's exposure key
    uint16_t kind       # DESC_READ or DESC_WRITTEN
    uint16_t entry      # done bit: index % RNDV_N

cdef enum:
    REC_RNDV = 1            # record flag: the record is a descriptor
    DESC_BYTES = 32         # sizeof(rm_desc)
    DESC_READ = 1           # the receiver READs from the sender's exposure
    DESC_WRITTEN = 2        # the sender has WRITTEN it into the advertised destination
    RNDV_N = 64             # rendezvous entries per direction (one done word)

# words[] of the Link: sources of the control-word writes this side makes
cdef enum:
    WORD_ZERO = 0
    WORD_ONE = 1
    WORD_DONE = 2           # the done bits of the rendezvous messages I received
    WORD_MAX_MSG = 3        # the largest message I take (announced once)
    WORD_ASK = 4            # credit_wait raised: 1, or the ring slots I need granted

# what a wait waits for (_waits.pyx): a sender's credit, or a receiver's arrivals
cdef enum:
    WAIT_SLOTS = 0
    WAIT_ENTRY = 1
    WAIT_DONE = 2
    WAIT_ARRIVAL = 3
    WAIT_READ = 4           # a receiver's rendezvous READ (target: its wr index)

cdef extern from *:
    """
    #define RM_RNDV_WRID (((unsigned long long)1) << 62)  /* wr_id bit of a rendezvous READ */
    #define RM_MAX_WR_BYTES 0xFFFFFFFFULL                 /* one work request's length */
    #define RM_NO_SLOT 0xFFFFFFFFu
    """
    const uint64_t RM_RNDV_WRID
    const uint64_t RM_MAX_WR_BYTES
    const uint32_t RM_NO_SLOT


cdef inline uint32_t pad8(uint32_t n) noexcept nogil:
    return (n + 7u) & ~7u
