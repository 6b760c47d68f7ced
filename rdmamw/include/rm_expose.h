/* Exposure table: the ranges of its own memory an endpoint lets its peer READ or
 * WRITE (rendezvous), for the providers that check remote work requests in software
 * (shm: the table sits in the exposing side's shared block and the peer checks its
 * READs against it; tcp: the exposing side's progress thread checks each request).
 * The verbs provider needs none: the NIC checks the MR.
 *
 * A key is (generation << 8) | index, 16 bits, never 0: a stale key (the range was
 * un-exposed, the entry reused) does not match the entry's current key. Only the
 * exposing side writes the table: fields first, then the key with release order; it
 * clears the key first on removal. A reader loads the key (acquire), copies the
 * fields, and re-loads the key: a range it acts on was exposed under that key.
 *
 * shm: the authoritative table is private to the exposing process; the table in its
 * shared block is only a mirror (rm_xtab_mirror / rm_xtab_retract) that the peer
 * reads to check its own READs and WRITEs. The peer maps that block read-write, so the
 * exposing side never checks anything against the mirror. */
#ifndef RM_EXPOSE_H
#define RM_EXPOSE_H
#include <stdint.h>

enum { RM_XTAB_N = 255, RM_XACC_READ = 1, RM_XACC_WRITE = 2, RM_XACC_ATOMIC = 4 };
#define RM_XNONE UINT64_MAX

typedef struct {
    uint64_t addr;      /* the exposing process's virtual address */
    uint64_t len;
    uint64_t staged;    /* shm without CMA: offset of the copy in the staging area */
    uint32_t key;       /* 0 = free */
    uint32_t access;    /* RM_XACC_* (ATOMIC: a user region's 64-bit words, tcp) */
} rm_xent;              /* 32 bytes */

typedef struct {
    uint64_t probe;     /* shm: a random word the peer reads with CMA to test it */
    uint32_t gen, live;
    uint64_t pad[2];
    rm_xent e[RM_XTAB_N];
} rm_xtab;              /* 8 KiB */

/* Add a range; the key, or 0 when the table is full. */
static inline uint32_t rm_xtab_add(rm_xtab *t, uint64_t addr, uint64_t len, uint32_t access,
                                   uint64_t staged) {
    uint32_t i, key;
    for (i = 0; i < RM_XTAB_N; i++) {
        if (__atomic_load_n(&t->e[i].key, __ATOMIC_ACQUIRE) == 0) break;
    }
    if (i == RM_XTAB_N) return 0;
    t->gen = t->gen % 255 + 1;
    key = (t->gen << 8) | i;
    t->e[i].addr = addr;
    t->e[i].len = len;
    t->e[i].staged = staged;
    t->e[i].access = access;
    __atomic_store_n(&t->e[i].key, key, __ATOMIC_RELEASE);
    t->live++;
    return key;
}

/* Remove the range of `key` (no-op for an unknown key); its entry, for the caller to
 * free what it held (staging), or 0. */
static inline int rm_xtab_del(rm_xtab *t, uint32_t key, rm_xent *out) {
    uint32_t i = key & 0xFF;
    if (key == 0 || i >= RM_XTAB_N || t->e[i].key != key) return 0;
    *out = t->e[i];
    __atomic_store_n(&t->e[i].key, 0, __ATOMIC_RELEASE);
    t->live--;
    return 1;
}

/* Is [addr, addr+len) inside the range exposed under `key` with `access`? 0 and the
 * entry in *out, else -1. `t` may be written concurrently by the exposing side. */
static inline int rm_xtab_find(const rm_xtab *t, uint32_t key, uint64_t addr, uint64_t len,
                               uint32_t access, rm_xent *out) {
    uint32_t i = key & 0xFF;
    if (key == 0 || (key >> 16) || i >= RM_XTAB_N) return -1;
    if (__atomic_load_n(&t->e[i].key, __ATOMIC_ACQUIRE) != key) return -1;
    out->addr = __atomic_load_n(&t->e[i].addr, __ATOMIC_RELAXED);
    out->len = __atomic_load_n(&t->e[i].len, __ATOMIC_RELAXED);
    out->staged = __atomic_load_n(&t->e[i].staged, __ATOMIC_RELAXED);
    out->access = __atomic_load_n(&t->e[i].access, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&t->e[i].key, __ATOMIC_RELAXED) != key) return -1;
    out->key = key;
    if (!(out->access & access) || addr < out->addr || len > out->len ||
        addr - out->addr > out->len - len)
        return -1;
    return 0;
}

/* Lowest offset in a staging area of `size` bytes where `len` bytes (rounded to 64)
 * fit between the ranges staged by live entries; RM_XNONE if none. First fit from
 * the bottom keeps the touched (resident) part of the area as small as the staged
 * bytes in flight. Only the exposing side calls it, on its own table. */
static inline uint64_t rm_xtab_fit(const rm_xtab *t, uint64_t size, uint64_t len) {
    uint64_t cand = 0, best = RM_XNONE, end;
    uint32_t i, j;
    int ok;
    len = (len + 63) & ~(uint64_t)63;
    for (i = 0; i <= RM_XTAB_N; i++) {
        if (i < RM_XTAB_N) {            /* candidates: 0 and the end of each staged range */
            if (!t->e[i].key || t->e[i].staged == RM_XNONE) continue;
            cand = t->e[i].staged + ((t->e[i].len + 63) & ~(uint64_t)63);
        } else {
            cand = 0;
        }
        if (cand > size || len > size - cand || cand >= best) continue;
        ok = 1;
        for (j = 0; j < RM_XTAB_N && ok; j++) {
            if (!t->e[j].key || t->e[j].staged == RM_XNONE) continue;
            end = t->e[j].staged + ((t->e[j].len + 63) & ~(uint64_t)63);
            if (cand < end && t->e[j].staged < cand + len) ok = 0;
        }
        if (ok) best = cand;
    }
    return best;
}

/* Publish the entry of `key` in the private table `src` into the mirror `t`. */
static inline void rm_xtab_mirror(rm_xtab *t, const rm_xtab *src, uint32_t key) {
    uint32_t i = key & 0xFF;
    if (key == 0 || i >= RM_XTAB_N) return;
    __atomic_store_n(&t->e[i].key, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&t->e[i].addr, src->e[i].addr, __ATOMIC_RELAXED);
    __atomic_store_n(&t->e[i].len, src->e[i].len, __ATOMIC_RELAXED);
    __atomic_store_n(&t->e[i].staged, src->e[i].staged, __ATOMIC_RELAXED);
    __atomic_store_n(&t->e[i].access, src->e[i].access, __ATOMIC_RELAXED);
    __atomic_store_n(&t->e[i].key, key, __ATOMIC_RELEASE);
}

/* Withdraw entry `key` from the mirror `t`. */
static inline void rm_xtab_retract(rm_xtab *t, uint32_t key) {
    uint32_t i = key & 0xFF;
    if (key != 0 && i < RM_XTAB_N) __atomic_store_n(&t->e[i].key, 0, __ATOMIC_RELEASE);
}

/* Still exposed under `key`? (after a copy, to know the source did not go away) */
static inline int rm_xtab_alive(const rm_xtab *t, uint32_t key) {
    uint32_t i = key & 0xFF;
    return key && i < RM_XTAB_N && __atomic_load_n(&t->e[i].key, __ATOMIC_ACQUIRE) == key;
}

/* User regions (docs/remote-memory.md): a region's entry carries its tag (its
 * generation, never 0) in the bits of `access` above RM_XTAG_SHIFT; rendezvous
 * entries have none, so a region request never matches a rendezvous exposure nor the
 * reverse. */
enum { RM_XTAG_SHIFT = 8 };
enum { RM_RWHY_OK = 0, RM_RWHY_GONE = 1, RM_RWHY_RANGE = 2, RM_RWHY_ACCESS = 3 };

/* Why a region request {key, tag, [addr, addr+len), access} fails against the table
 * `t` (shm: the peer's mirror; tcp: the owner's own table): RM_RWHY_*, the entry read
 * once like rm_xtab_find. */
static inline int rm_region_why(const rm_xtab *t, uint32_t key, uint32_t tag, uint64_t addr,
                                uint64_t len, uint32_t access) {
    rm_xent e;
    uint32_t i = key & 0xFF;
    if (key == 0 || (key >> 16) || i >= RM_XTAB_N || tag == 0) return RM_RWHY_GONE;
    if (__atomic_load_n(&t->e[i].key, __ATOMIC_ACQUIRE) != key) return RM_RWHY_GONE;
    e.addr = __atomic_load_n(&t->e[i].addr, __ATOMIC_RELAXED);
    e.len = __atomic_load_n(&t->e[i].len, __ATOMIC_RELAXED);
    e.access = __atomic_load_n(&t->e[i].access, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&t->e[i].key, __ATOMIC_RELAXED) != key) return RM_RWHY_GONE;
    if ((e.access >> RM_XTAG_SHIFT) != tag) return RM_RWHY_GONE;
    if (addr < e.addr || len > e.len || addr - e.addr > e.len - len) return RM_RWHY_RANGE;
    if ((e.access & access) != access) return RM_RWHY_ACCESS;
    return RM_RWHY_OK;
}
#endif
