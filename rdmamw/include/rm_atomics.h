/* Memory-ordering and bit helpers shared by the bitmap and the engine.
 *
 * Bitmap words are written by one side and read by the other: the writer
 * publishes with release order, the reader loads with acquire order, so a
 * slot's data is visible before its arrival bit (and a slot's reuse happens
 * after its reclaim bit). */
#ifndef RM_ATOMICS_H
#define RM_ATOMICS_H
#include <stddef.h>
#include <stdint.h>

static inline uint64_t rm_load_acquire64(const volatile uint64_t *p) {
    return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
}
static inline void rm_store_release64(volatile uint64_t *p, uint64_t v) {
    __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE);
}
static inline uint32_t rm_load_acquire32(const volatile uint32_t *p) {
    return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE);
}
static inline void rm_store_release32(volatile uint32_t *p, uint32_t v) {
    __atomic_store_n((uint32_t *)p, v, __ATOMIC_RELEASE);
}
static inline void rm_fence_seq_cst(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void rm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
static inline int rm_ctz64(uint64_t v) { return __builtin_ctzll(v); }
static inline int rm_popcount64(uint64_t v) { return __builtin_popcountll(v); }
/* Mask of the valid bits in the last word of an n-bit bitmap. */
static inline uint64_t rm_tail_mask(uint32_t nbits) {
    uint32_t r = nbits & 63u;
    return r ? ((1ull << r) - 1ull) : ~0ull;
}

/* Copy of a small record without a libc call and without reading past either end:
 * overlapping head/tail moves for 4..16 bytes, memcpy above. */
static inline void rm_copy(void *dst, const void *src, size_t n) {
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    if (n >= 8 && n <= 16) {
        uint64_t a, b;
        __builtin_memcpy(&a, s, 8);
        __builtin_memcpy(&b, s + n - 8, 8);
        __builtin_memcpy(d, &a, 8);
        __builtin_memcpy(d + n - 8, &b, 8);
    } else if (n >= 4 && n < 8) {
        uint32_t a, b;
        __builtin_memcpy(&a, s, 4);
        __builtin_memcpy(&b, s + n - 4, 4);
        __builtin_memcpy(d, &a, 4);
        __builtin_memcpy(d + n - 4, &b, 4);
    } else if (n < 4) {
        while (n--) *d++ = *s++;
    } else {
        __builtin_memcpy(d, s, n);
    }
}

/* A tiny spinlock for the sections that touch the transport and the reclaim
 * shadow; they are short and never hold the GIL. */
static inline void rm_spin_lock(volatile int *l) {
    while (__atomic_exchange_n((int *)l, 1, __ATOMIC_ACQUIRE)) {
        while (__atomic_load_n((int *)l, __ATOMIC_RELAXED)) rm_cpu_relax();
    }
}
static inline void rm_spin_unlock(volatile int *l) { __atomic_store_n((int *)l, 0, __ATOMIC_RELEASE); }
/* 1 if the lock was free and is now ours, else 0 (for work that may be skipped). */
static inline int rm_spin_trylock(volatile int *l) {
    return !__atomic_load_n((int *)l, __ATOMIC_RELAXED)
        && !__atomic_exchange_n((int *)l, 1, __ATOMIC_ACQUIRE);
}
#endif
