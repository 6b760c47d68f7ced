/* The timeline's record of the channels' compiled path (rdmamw/trace, docs/trace.md):
 * one process-wide ring of fixed-size records, allocated when recording starts and
 * filled by the engine's units with one atomic add and a few stores each, without a
 * Python object; rdmamw.trace turns it into trace events when the file is written.
 *
 * Off, a hook costs the load of `on` and one predictable branch (rm_trace_on). A
 * record is claimed by its index (an atomic add on `next`) and written into slot
 * index & mask of a ring of cap (a power of two) slots: a long recording overwrites
 * its oldest records, so the file keeps the latest (a job that hangs or fails is
 * seen up to its end). Each slot is a seqlock: its `ready` word is 0 while a writer
 * fills it, then (stored last, release) its index's tag, the session's generation
 * and the lap of the ring; a reader takes a slot only if its tag is the one of the
 * index it wants both before and after the copy. The array of a stopped session is
 * never freed (a late writer may still hold it); a larger one for a later session
 * replaces it, the old one leaks. */
#ifndef RM_TRACE_H
#define RM_TRACE_H

#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef struct {
    int64_t t0, t1;         /* now_ns() (CLOCK_MONOTONIC); t1 == t0 for an instant */
    uint64_t a, b, c;       /* by kind: see rdmamw/engine/_trace.pxd */
    uint32_t chan;          /* the Link's serial (Engine.trace_id) */
    uint32_t kind, tid;     /* tid: the writer's gettid() (0 on a channel's track) */
    uint32_t d, e;
    uint32_t ready;         /* the index's tag once written (rm_trace_tag) */
} rm_trace_rec;             /* 64 bytes: one cache line (the ring is page-aligned) */

typedef struct {
    rm_trace_rec *recs;
    uint64_t cap;           /* slots: a power of two */
    uint64_t next;
    uint32_t on;
    uint32_t gen;           /* the session's generation (1, 2, ...) */
    uint64_t mask;          /* cap - 1 */
    uint32_t shift;         /* log2(cap): index >> shift is its lap of the ring */
} rm_trace;

static inline int rm_trace_on(const rm_trace *t) {
    return __builtin_expect(__atomic_load_n(&t->on, __ATOMIC_ACQUIRE) != 0, 0);
}

static inline uint32_t rm_trace_tid(void) {
    static __thread uint32_t tid;
    if (!tid)
        tid = (uint32_t)syscall(SYS_gettid);
    return tid;
}

/* the `ready` word of index i once written: never 0 (8 bits of the generation, 24 of
 * the lap + 1: exact for 256 sessions and 16 M laps of the ring) */
static inline uint32_t rm_trace_tag(const rm_trace *t, uint64_t i) {
    return (t->gen << 24) | (uint32_t)(((i >> t->shift) + 1) & 0xffffff);
}

static inline void rm_trace_write(rm_trace *t, uint32_t kind, uint64_t chan, int64_t t0,
                                  int64_t t1, uint64_t a, uint64_t b, uint64_t c,
                                  uint32_t d, uint32_t e, uint32_t tid) {
    uint64_t i = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
    rm_trace_rec *r = &t->recs[i & t->mask];
    __atomic_store_n(&r->ready, 0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);        /* busy before the fields change */
    r->t0 = t0; r->t1 = t1; r->chan = (uint32_t)chan;
    r->a = a; r->b = b; r->c = c;
    r->kind = kind; r->tid = tid; r->d = d; r->e = e;
    __atomic_store_n(&r->ready, rm_trace_tag(t, i), __ATOMIC_RELEASE);
}

/* a record of the writing thread (a wait, a rendezvous receipt: on its track) */
static inline void rm_trace_put(rm_trace *t, uint32_t kind, uint64_t chan, int64_t t0,
                                int64_t t1, uint64_t a, uint64_t b, uint64_t c,
                                uint32_t d) {
    rm_trace_write(t, kind, chan, t0, t1, a, b, c, d, 0, rm_trace_tid());
}

/* a record of a channel's track (a batch, a completion), whichever thread wrote it:
 * no thread id (its look-up is a TLS access from a shared object: not free) */
static inline void rm_trace_put_chan(rm_trace *t, uint32_t kind, uint64_t chan, int64_t t0,
                                     int64_t t1, uint64_t a, uint64_t b, uint64_t c,
                                     uint32_t d, uint32_t e) {
    rm_trace_write(t, kind, chan, t0, t1, a, b, c, d, e, 0);
}

/* rdmamw.engine._engine's trace_start / trace_stop (the GIL held: one at a time) */
static inline void rm_trace_switch(rm_trace *t, uint32_t on) {
    __atomic_store_n(&t->on, on, __ATOMIC_RELEASE);
}

static inline uint64_t rm_trace_claimed(const rm_trace *t) {
    return __atomic_load_n(&t->next, __ATOMIC_ACQUIRE);
}

static inline int rm_trace_ready(const rm_trace *t, uint64_t i) {
    return __atomic_load_n(&t->recs[i & t->mask].ready, __ATOMIC_ACQUIRE) ==
        rm_trace_tag(t, i);
}

/* copy index i's record into *dst if its writer finished and none overwrote it since
 * (the seqlock's read: its tag before and after the copy); 1 if copied */
static inline int rm_trace_copy(const rm_trace *t, uint64_t i, rm_trace_rec *dst) {
    const rm_trace_rec *r = &t->recs[i & t->mask];
    uint32_t tag = rm_trace_tag(t, i);
    if (__atomic_load_n(&r->ready, __ATOMIC_ACQUIRE) != tag)
        return 0;
    __builtin_memcpy(dst, (const void *)r, sizeof *dst);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(&r->ready, __ATOMIC_RELAXED) == tag;
}

#endif
