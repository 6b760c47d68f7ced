# The shared primitives under the engine, the bitmaps and the providers: acquire /
# release loads and stores, a tiny spinlock, bit tricks (rdmamw/include/rm_atomics.h).
# Declared once here; each user cimports what it needs.
from libc.stdint cimport uint32_t, uint64_t

cdef extern from "rm_atomics.h" nogil:
    uint64_t rm_load_acquire64(const uint64_t *p)
    void rm_store_release64(uint64_t *p, uint64_t v)
    uint32_t rm_load_acquire32(const uint32_t *p)
    void rm_store_release32(uint32_t *p, uint32_t v)
    void rm_fence_seq_cst()
    void rm_cpu_relax()
    void rm_copy(void *dst, const void *src, size_t n)
    void rm_spin_lock(int *l)
    void rm_spin_unlock(int *l)
    int rm_spin_trylock(int *l)     # 1 when taken
    int rm_ctz64(uint64_t v)
    int rm_popcount64(uint64_t v)
    uint64_t rm_tail_mask(uint32_t nbits)
