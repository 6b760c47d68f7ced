# Everything one endpoint counts, in one struct owned by its Link; each unit adds to
# its own fields (tests/unit/test_engine_owners.py: one writer each). Link.stats()
# (rdmamw/engine/_link.pyx) names them; the names are API.
from libc.stdint cimport uint64_t

ctypedef struct rm_counters:
    # eager send / receive
    uint64_t msgs_sent
    uint64_t bytes_sent
    uint64_t batches
    uint64_t slots_sent
    uint64_t msgs_recv
    uint64_t bytes_recv
    uint64_t slots_recv
    uint64_t reclaim_wb
    uint64_t credit_waits
    uint64_t credit_wait_ns     # the Waiter's: time senders spent in those waits
    uint64_t arrival_waits
    uint64_t sleeps             # the Link's: times this side blocked in the transport's wait()
    uint64_t word_writes        # the Link's: control words written to the peer (flags, ...)
    # rendezvous send
    uint64_t rndv_sends
    uint64_t rndv_writes
    uint64_t rndv_bytes
    # rendezvous receive
    uint64_t rndv_recv
    uint64_t rndv_reads
    uint64_t rndv_bytes_recv
    uint64_t done_wb
    uint64_t rndv_refused
