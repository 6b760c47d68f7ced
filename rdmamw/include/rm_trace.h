/* The timeline's record of the channels' compiled path (rdmamw/trace, docs/trace.md):
 * one process-wide array of fixed-size records, allocated when recording starts and
 * filled by the engine's units with one atomic add and a few stores each, without a
 * Python object; rdmamw.trace turns it into trace events when the file is written.
 *
 * Off, a hook costs the load of `on` and one predictable branch (rm_trace_on). A
 * record is claimed by its index (an atomic add on `next`); past `cap` it is only
 * counted (next - cap). Its `ready` word, stored last (release), is the session's
 * generation: a reader takes only the records of its own session whose writer has
 * finished. The array of a stopped session is never freed (a late writer may still
 * hold it); a larger one for a later session replaces it, the old one leaks. */
#ifndef RM_TRACE_H
#define RM_TRACE_H

#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef struct {
    int64_t t0, t1;         /* now_ns() (CLOCK_MONOTONIC); t1 == t0 for an instant */
    uint64_t chan;          /* the Link's serial (Engine.trace_id) */
    uint64_t a, b, c;       /* by kind: see rdmamw/trace/records.py */
    uint32_t kind, tid;     /* tid: the writer's gettid() */
    uint32_t d, ready;      /* ready: the session's generation once written */
} rm_trace_rec;             /* 64 bytes */

typedef struct {
    rm_trace_rec *recs;
    uint64_t cap;
    uint64_t next;
    uint32_t on;
    uint32_t gen;
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

static inline void rm_trace_put(rm_trace *t, uint32_t kind, uint64_t chan, int64_t t0,
                                int64_t t1, uint64_t a, uint64_t b, uint64_t c,
                                uint32_t d) {
    uint64_t i = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
    rm_trace_rec *r;
    if (i >= t->cap)
        return;
    r = &t->recs[i];
    r->t0 = t0; r->t1 = t1; r->chan = chan;
    r->a = a; r->b = b; r->c = c;
    r->kind = kind; r->tid = rm_trace_tid(); r->d = d;
    __atomic_store_n(&r->ready, t->gen, __ATOMIC_RELEASE);
}

/* rdmamw.engine._engine's trace_start / trace_stop (the GIL held: one at a time) */
static inline void rm_trace_switch(rm_trace *t, uint32_t on) {
    __atomic_store_n(&t->on, on, __ATOMIC_RELEASE);
}

static inline uint64_t rm_trace_claimed(const rm_trace *t) {
    return __atomic_load_n(&t->next, __ATOMIC_ACQUIRE);
}

static inline int rm_trace_ready(const rm_trace *t, uint64_t i) {
    return __atomic_load_n(&t->recs[i].ready, __ATOMIC_ACQUIRE) == t->gen;
}

#endif
