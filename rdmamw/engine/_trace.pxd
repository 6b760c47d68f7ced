# The timeline's records of the compiled path (rdmamw/include/rm_trace.h): what each
# kind's fields hold is rdmamw/trace/records.py's to say (it reads the numbers from
# rdmamw.engine._engine.TRACE_KINDS).
from libc.stdint cimport int64_t, uint32_t, uint64_t


cdef extern from "rm_trace.h" nogil:
    ctypedef struct rm_trace_rec:
        int64_t t0
        int64_t t1
        uint64_t a
        uint64_t b
        uint64_t c
        uint32_t chan
        uint32_t kind
        uint32_t tid
        uint32_t d
        uint32_t e
        uint32_t ready
    ctypedef struct rm_trace:
        rm_trace_rec *recs
        uint64_t cap
        uint64_t next
        uint32_t on
        uint32_t gen
        uint64_t mask
        uint32_t shift
    bint rm_trace_on(const rm_trace *t)
    void rm_trace_put(rm_trace *t, uint32_t kind, uint64_t chan, int64_t t0, int64_t t1,
                      uint64_t a, uint64_t b, uint64_t c, uint32_t d)
    void rm_trace_put_chan(rm_trace *t, uint32_t kind, uint64_t chan, int64_t t0, int64_t t1,
                           uint64_t a, uint64_t b, uint64_t c, uint32_t d, uint32_t e)
    void rm_trace_switch(rm_trace *t, uint32_t on)
    uint64_t rm_trace_claimed(const rm_trace *t)
    bint rm_trace_ready(const rm_trace *t, uint64_t i)
    bint rm_trace_copy(const rm_trace *t, uint64_t i, rm_trace_rec *dst)


cdef enum:
    TR_BATCH = 1        # a send call's posting: a messages, b bytes, c its last chain, d chains,
                        # e 1 if that chain had completed by t1 (no TR_COMPLETED says it then)
    TR_DOORBELL = 2     # one chain posted: a messages, b slots, c its chain, d rc
    TR_COMPLETED = 3    # chains completed up to c (the Link's reap; not the reap of a post
                        # that completed just its own chain: its batch record says it)
    TR_CREDIT_WAIT = 4  # a sender's wait (Waiter.wait): a what (WAIT_*), b close()'s,
                        # c its target, d its result (1 ready, 0 timed out, <0 peer)
    TR_ARRIVAL_WAIT = 5 # a receiver's wait for arrivals: the same fields
    TR_SLEEP = 6        # a sleep in the transport: a its timeout (ms), d its result
    TR_RNDV_EXPOSE = 7  # a rendezvous source exposed: a its index, b bytes, d written
    TR_RNDV_DONE = 8    # rendezvous messages done up to c (their done bits came back)
    TR_RNDV_RECV = 9    # a rendezvous message received: a its index, b bytes, d written
    TR_READ_WAIT = 10   # a receiver's wait for its rendezvous READ: the same fields
    TR_BATCH_ONE = 11   # a send call posted in one chain that completed within its post
                        # (shm, tcp: one record, not batch + doorbell + completed): t1 its
                        # doorbell (and completion), a messages, b bytes, c its chain, d slots
