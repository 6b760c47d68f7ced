# The shm data path's copies through a mapping of the peer's shared memory (ShmTransport,
# _transport.pyx; docs/remote-memory.md, "shm: regions in shared memory"): a region the
# peer exposed in memory from rdmamw.memory.shared() has a file word (rm_shared.h) beside
# its mirrored entry; I map its pages once (pidfd_getfd, as for atomics), and its READs
# and WRITEs are plain copies through my mapping instead of a process_vm_* call per
# range. The same rules as CMA: the entry and the file word are read once into locals
# (between two looks at the key) and only those are checked; it runs inside
# _post_exposed, my busy word odd, so the peer's revoke waits until the copies ended;
# the key is looked at again after them (withdrawn meanwhile: RM_ERR_BOUNDS).
from libc.stdint cimport uint32_t, uint64_t

from rdmamw.transport._base cimport (
    RM_ERR_BOUNDS,
    RM_WR_EXPOSED,
    RM_WR_READ,
    RM_WR_REGION,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    rm_wr,
)
from rdmamw.transport.atomics cimport (
    rm_copy,
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_unlock,
)
from rdmamw.providers.shm._endpoint cimport (
    RM_XACC_READ,
    RM_XACC_WRITE,
    RM_XNONE,
    RM_XTAG_SHIFT,
    ShmEndpoint,
    rm_smap,
    rm_smap_make,
    rm_xent,
    rm_xtab_alive,
    rm_xtab_find,
)


cdef inline uint32_t wanted(rm_wr *wr) noexcept nogil:
    """The exposure access an unsignaled region READ/WRITE needs (RM_XACC_*), or 0
    for any other request (not copied through a mapping)."""
    if (wr.flags & (RM_WR_EXPOSED | RM_WR_REGION | RM_WR_SIGNALED)) \
            != (RM_WR_EXPOSED | RM_WR_REGION):
        return 0
    return RM_XACC_READ if wr.opcode == RM_WR_READ else \
        RM_XACC_WRITE if wr.opcode == RM_WR_WRITE else 0


cdef inline rm_smap *cmap_take(ShmEndpoint t, rm_wr *wr, rm_xent *xe) noexcept nogil:
    """My mapping of the exposure ``wr`` names, held (``users``) until cmap_put: its
    entry read once into ``xe`` and checked with the tag, its file word read between
    two looks at the key. NULL: not in shared memory, not mappable, the slot's mapping
    in use for an earlier exposure, or not exposed (the caller's CMA path decides)."""
    cdef uint32_t i = wr.rkey & 0xFF
    cdef uint64_t file
    cdef rm_smap *m
    cdef int rc = 0
    if t.cmaps == NULL or t.peer_xfile == NULL or t.pidfd < 0 or not t.cma:
        return NULL
    if rm_xtab_find(t.peer_xtab, wr.rkey, wr.remote_off, wr.length, wanted(wr), xe) != 0 \
            or xe.access >> RM_XTAG_SHIFT != wr.imm or xe.staged != RM_XNONE:
        return NULL
    file = rm_load_acquire64(&t.peer_xfile.file[i])
    if file == 0 or not rm_xtab_alive(t.peer_xtab, wr.rkey):
        return NULL
    m = &t.cmaps[i]
    rm_spin_lock(&t.cmap_lock)
    if m.map == NULL or m.key != wr.rkey or m.tag != wr.imm or m.file != file \
            or m.addr != xe.addr or m.len != xe.len:
        rc = -1 if m.users else rm_smap_make(m, t.pidfd, wr.rkey, wr.imm, file, xe.addr,
                                             xe.len)
    if rc == 0:
        m.users += 1
    rm_spin_unlock(&t.cmap_lock)
    return m if rc == 0 else NULL


cdef inline void cmap_put(ShmEndpoint t, rm_smap *m) noexcept nogil:
    rm_spin_lock(&t.cmap_lock)
    m.users -= 1
    rm_spin_unlock(&t.cmap_lock)


cdef inline int mapped_run(ShmEndpoint t, rm_wr *wrs, uint32_t *at, uint32_t n) noexcept nogil:
    """The region READs/WRITEs from ``wrs[*at]`` on that name one exposure in the peer's
    shared memory, copied through my mapping in the chain's order; ``*at`` moves past
    them. 1: done; 0: not mapped, nothing done (the caller copies by CMA);
    RM_ERR_BOUNDS: the exposure was withdrawn during the copies (what moved is not
    sure, as after a CMA copy). The caller (_post) checked the chain before."""
    cdef rm_xent xe
    cdef rm_wr *wr = &wrs[at[0]]
    cdef uint32_t i = at[0], key = wr.rkey, tag = wr.imm, acc
    cdef uint64_t written = 0, rel
    cdef rm_smap *m
    cdef char *base
    if wanted(wr) == 0:
        return 0
    m = cmap_take(t, wr, &xe)
    if m == NULL:
        return 0
    base = m.map + m.delta
    while i < n:
        wr = &wrs[i]
        acc = wanted(wr)
        rel = wr.remote_off - xe.addr
        if acc == 0 or not xe.access & acc or wr.rkey != key or wr.imm != tag \
                or wr.remote_off < xe.addr or rel > xe.len or wr.length > xe.len - rel:
            break       # another exposure (or a request the CMA path refuses)
        if acc == RM_XACC_READ:
            rm_copy(<void *>wr.local_addr, base + rel, wr.length)
        else:
            rm_copy(base + rel, <void *>wr.local_addr, wr.length)
            written += wr.length
        i += 1
    cmap_put(t, m)
    t.bytes_written += written
    t.n_mapped_ops += i - at[0]
    at[0] = i
    if not rm_xtab_alive(t.peer_xtab, key):
        return RM_ERR_BOUNDS    # un-exposed during the copies: the data is not sure
    return 1
