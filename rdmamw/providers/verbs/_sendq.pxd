# The send queue of a verbs endpoint (VerbsTransport, _transport.pxd), as the data
# path fills it: chains of at most max_chain WRs (a long READ as pieces), the backlog
# of what a full queue could not take by its poster's deadline (_backlog.pxd), the
# wake-up SEND, and the drain of a close. Inline: each is one call of the hot path.
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memset

from rdmamw.transport._base cimport (
    RM_ERR_LATE,
    RM_REGION_CTRL,
    RM_WR_READ,
    now_ns,
    rm_wr,
)
from rdmamw.transport.atomics cimport rm_cpu_relax, rm_spin_lock, rm_spin_unlock
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._qp cimport INTERNAL, QP_CONNECTED
from rdmamw.providers.verbs._backlog cimport bl_pop, bl_push, bl_reserve, rmv_backlog
from rdmamw.providers.verbs._transport cimport VerbsTransport

cdef enum:
    # every this many pieces of a long READ one is signaled (internally), so a READ
    # longer than the send queue holds frees its slots as it goes, not only at the
    # end of each part
    PIECES_PER_SIGNAL = 16


cdef inline uint32_t _fill_piece(VerbsTransport tp, uint32_t j, rm_wr *wr,
                                 uint32_t *off) noexcept nogil:
    """Fill send WR j from ``wr``, or from its next piece of at most tp.read_chunk bytes
    at ``*off`` if it is a longer READ (the last piece keeps its signal, every
    PIECES_PER_SIGNAL-th gets an internal one); 1 when ``wr`` is done, 0 while pieces
    of it remain."""
    cdef rm_wr piece
    if wr.opcode != RM_WR_READ or tp.read_chunk == 0 or wr.length <= tp.read_chunk:
        tp._fill(j, wr)
        return 1
    piece = wr[0]
    piece.local_addr += off[0]
    piece.remote_off += off[0]
    piece.length = min(tp.read_chunk, wr.length - off[0])
    off[0] += piece.length
    tp._fill(j, &piece)
    if off[0] < wr.length:
        if (off[0] // tp.read_chunk) % PIECES_PER_SIGNAL:
            tp.swr[j].send_flags &= ~IBV_SEND_SIGNALED
        else:
            tp.swr[j].send_flags |= IBV_SEND_SIGNALED
            tp.swr[j].wr_id |= INTERNAL
        return 0
    off[0] = 0
    return 1


cdef inline int _post_all(VerbsTransport tp, rm_wr *wrs, uint32_t n) noexcept nogil:
    """Post wrs[0..n) after what the backlog holds, as chains of at most max_chain WRs
    (caller holds the lock). What the send queue has no room for by room_deadline is
    queued in the backlog: RM_ERR_LATE, accepted. A full backlog: wait as before."""
    cdef uint32_t i = 0, i0 = 0, o0 = 0, part, off = 0
    cdef int rc = 0
    while True:
        while tp.bl.len and rc == 0:        # what was accepted before goes first
            rc = _flush(tp)
            if rc == 0 and tp.bl.len:
                rc = tp._room(1)
        while i < n and rc == 0:
            i0, o0, part = i, off, 0
            while part < tp.max_chain and i < n:
                i += _fill_piece(tp, part, &wrs[i], &off)
                part += 1
            rc = tp._post_chain(part, i == n)
        if rc != RM_ERR_LATE:
            return rc
        if bl_reserve(&tp.bl, n - i0, tp.max_inline):
            for i in range(i0, n):
                bl_push(&tp.bl, &wrs[i], o0 if i == i0 else 0, tp.max_inline)
            return RM_ERR_LATE
        tp.room_deadline = 0
        i, off, rc = i0, o0, 0


cdef inline int _flush(VerbsTransport tp) noexcept nogil:
    """Post the backlog's WRs, oldest first, as far as the send queue has room now
    (caller holds the lock); the wake-up due after them once they all have gone."""
    cdef rmv_backlog *b = &tp.bl
    cdef uint32_t room, part, j, off
    cdef int rc
    while b.len:
        room = tp.sq_depth - <uint32_t>(tp.sq_posted - tp.sq_done)
        if room == 0 and tp._poll_send_locked() >= 0:
            room = tp.sq_depth - <uint32_t>(tp.sq_posted - tp.sq_done)
        if room == 0:
            return 0
        part, j, off = 0, 0, b.off
        while part < room and part < tp.max_chain and j < b.len:
            j += _fill_piece(tp, part, &b.wrs[(b.head + j) % b.cap], &off)
            part += 1
        rc = tp._post_chain(part, j == b.len)
        if rc != 0:
            return rc
        bl_pop(b, j, off)
    if b.wake and tp.sq_posted - tp.sq_done < tp.sq_depth:
        b.wake = False
        return _wake(tp)
    return 0


cdef inline int _wake(VerbsTransport tp) noexcept nogil:
    """Post a wake-up SEND (caller holds the lock, and the queue has room)."""
    cdef ibv_send_wr *w = &tp.swr[0]
    cdef int rc
    memset(w, 0, sizeof(ibv_send_wr))
    w.wr_id = INTERNAL
    w.opcode = IBV_WR_SEND          # zero bytes: only the receive completion matters
    w.send_flags = IBV_SEND_SOLICITED   # an event even where nobody sleeps (grants)
    rc = tp._post_chain(1, True)
    if rc == 0:     # under the lock: counters() reads it with n_doorbells
        tp.n_wakeups += 1
    return rc


cdef inline void _drain_sq(VerbsTransport tp, int64_t budget_ns) noexcept nogil:
    """Let the queued and posted WRs finish (close), at most ``budget_ns``."""
    cdef int64_t end = now_ns() + budget_ns
    cdef ibv_send_wr *w
    rm_spin_lock(&tp.lock)
    tp.room_deadline = end
    while tp.bl.len and tp.state == QP_CONNECTED and now_ns() < end:
        if _flush(tp) != 0:
            break
        if tp.bl.len and tp._poll_send_locked() == 0:
            rm_cpu_relax()
    if tp.unsig and tp.state == QP_CONNECTED:
        w = &tp.swr[0]     # a signaled zero-byte WRITE flushes the unsignaled tail
        memset(w, 0, sizeof(ibv_send_wr))
        w.wr_id = INTERNAL
        w.opcode = IBV_WR_RDMA_WRITE
        w.send_flags = IBV_SEND_SIGNALED
        w.wr.rdma.remote_addr = tp.peer_addr[RM_REGION_CTRL]
        w.wr.rdma.rkey = tp.peer_rkey
        tp._post_chain(1, True)
    while tp.state == QP_CONNECTED and tp.sq_done < tp.sq_posted and now_ns() < end:
        if tp._poll_send_locked() == 0:
            rm_cpu_relax()
    tp.room_deadline = 0
    rm_spin_unlock(&tp.lock)
