/* Assisted READ and WRITE (shm): the exposing side helps copy a large rendezvous
 * READ or WRITE of its memory.
 *
 * On shm a READ or WRITE is a CPU copy (process_vm_readv/writev). One core copies
 * about 10 GB/s out of DRAM; two copy nearly twice that. When the initiator (the
 * reader of a READ, the writer of a WRITE) starts a large one, it publishes a job in
 * its own block and wakes the exposing side; the job is cut into at most 64 chunks
 * that both sides claim from one counter. The exposing side joins only while it is
 * idle in the engine (spinning or asleep), copies each chunk it claimed (READ: pushes
 * it with process_vm_writev; WRITE: pulls it with process_vm_readv) and marks it
 * finished. The initiator copies every chunk nobody else claimed, then waits only for
 * the chunks the helper did claim, and copies again any the helper could not. So a
 * helper that never comes costs nothing, and no helper copy can still be running
 * after the initiator has reported the operation done.
 *
 * The claim word packs (seq, n, next). The record lives in the initiator's block, which
 * the helper maps read-write, so neither side trusts what the other may have written:
 * each side reads the job's fields once into its own memory (the initiator never reads
 * them back: it knows its job), checks that copy, and claims with its own copy of n,
 * so a rewritten word (same seq, other n or next) yields no chunk outside the job; a
 * claim returns each index at most once per caller (the caller's mask of indices it
 * already took), so a word reset to next = 0 gets no chunk copied twice. The helper
 * checks the exposed range against its private copy of its exposure table (the one in
 * its block is a mirror the peer could forge); addresses the initiator wrote are never
 * used on the initiator's side, and the helper's copies into or out of the initiator
 * go through the kernel's checks. */
#ifndef RM_ASSIST_H
#define RM_ASSIST_H
#include <stdint.h>

enum { RM_ASSIST_MAX_CHUNKS = 64 };

typedef struct {
    uint64_t claim;     /* seq << 32 | n << 8 | next; seq 0: no job yet */
    uint64_t fin;       /* bit i: the helper is done with chunk i */
    uint64_t bad;       /* bit i: ... and its copy failed (the initiator redoes it) */
    uint64_t remote;    /* the exposed range, in the helper's (exposing) process */
    uint64_t local;     /* the other end of the copy, in the initiator's process */
    uint64_t len;
    uint64_t chunk;
    uint32_t key;       /* the exposure key of the range */
    uint32_t write;     /* 0: READ (remote -> local), 1: WRITE (local -> remote) */
} rm_assist;            /* 64 bytes */

static inline uint64_t rm_assist_word(uint32_t seq, uint32_t n, uint32_t next) {
    return ((uint64_t)seq << 32) | ((uint64_t)(n & 0xFF) << 8) | (next & 0xFF);
}

/* Initiator: publish job `seq` (never 0, never repeated) of n <= 64 chunks. */
static inline void rm_assist_publish(rm_assist *a, uint32_t seq, uint32_t write, uint64_t remote,
                                     uint64_t local, uint64_t len, uint64_t chunk, uint32_t key,
                                     uint32_t n) {
    __atomic_store_n(&a->fin, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&a->bad, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&a->remote, remote, __ATOMIC_RELAXED);
    __atomic_store_n(&a->local, local, __ATOMIC_RELAXED);
    __atomic_store_n(&a->len, len, __ATOMIC_RELAXED);
    __atomic_store_n(&a->chunk, chunk, __ATOMIC_RELAXED);
    __atomic_store_n(&a->key, key, __ATOMIC_RELAXED);
    __atomic_store_n(&a->write, write, __ATOMIC_RELAXED);
    __atomic_store_n(&a->claim, rm_assist_word(seq, n, 0), __ATOMIC_RELEASE);
}

/* Either side: claim the next chunk of job `seq`, which has `n` chunks by the caller's
 * own account (never the n in the shared word); `*taken` is the caller's mask of the
 * indices it claimed already. The index (now also in *taken), or -1 when all are taken,
 * the job is no longer `seq`, or the word was rewritten (another n, an index out of
 * range or handed out twice). */
static inline int rm_assist_claim(rm_assist *a, uint32_t seq, uint32_t n, uint64_t *taken) {
    uint64_t w = __atomic_load_n(&a->claim, __ATOMIC_ACQUIRE);
    if (n == 0 || n > RM_ASSIST_MAX_CHUNKS) return -1;
    for (;;) {
        uint32_t next = w & 0xFF;
        if ((uint32_t)(w >> 32) != seq || ((w >> 8) & 0xFF) != n || next >= n
                || (*taken >> next) & 1)
            return -1;
        if (__atomic_compare_exchange_n(&a->claim, &w, w + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            *taken |= 1ull << next;
            return (int)next;
        }
    }
}

/* Helper: the job on offer, if one has chunks left: its seq (fields copied to *out),
 * else 0. The fields are only trustworthy once a claim of that seq succeeds. */
static inline uint32_t rm_assist_offer(const rm_assist *a, rm_assist *out) {
    uint64_t w = __atomic_load_n(&a->claim, __ATOMIC_ACQUIRE);
    if ((w >> 32) == 0 || (w & 0xFF) >= ((w >> 8) & 0xFF)) return 0;
    out->remote = __atomic_load_n(&a->remote, __ATOMIC_RELAXED);
    out->local = __atomic_load_n(&a->local, __ATOMIC_RELAXED);
    out->len = __atomic_load_n(&a->len, __ATOMIC_RELAXED);
    out->chunk = __atomic_load_n(&a->chunk, __ATOMIC_RELAXED);
    out->key = __atomic_load_n(&a->key, __ATOMIC_RELAXED);
    out->write = __atomic_load_n(&a->write, __ATOMIC_RELAXED);
    out->claim = w;
    return (uint32_t)(w >> 32);
}

/* Helper: chunk i (< 64, from its own claim) is finished (ok = 0: its copy failed). */
static inline void rm_assist_finish(rm_assist *a, int i, int ok) {
    if (!ok) __atomic_fetch_or(&a->bad, 1ull << i, __ATOMIC_RELAXED);
    __atomic_fetch_or(&a->fin, 1ull << i, __ATOMIC_RELEASE);
}
#endif
