/* One poller per endpoint: the threads of one endpoint that sleep at once (a sender
 * waiting for slots or done bits, a receiver waiting for arrivals) must not both sleep
 * in the transport. A transport's wake-up is consumed by the thread that takes it (an
 * eventfd read, a waiting flag cleared), so a wake-up meant for one thread could be
 * taken by the other while the first was between its last look and its sleep, and the
 * first would sleep its whole timeout (issue 28's CI: a sender and a receiver thread
 * on one shm channel, 30 s).
 *
 * So one thread at a time sleeps in the transport (the poller); the others wait on a
 * condition variable for the poller's next return, which counts a generation. A
 * sleeper passes the generation it read before its last look: if it moved since, a
 * wake-up was taken in between and it looks again instead of sleeping. */
#ifndef RM_SLEEPERS_H
#define RM_SLEEPERS_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int polling;            /* a thread sleeps in the transport */
    uint64_t gen;           /* returns from the transport's sleep so far */
} rm_sleepers;

enum { RM_SLEEP_POLL = 1, RM_SLEEP_LOOK = 2, RM_SLEEP_TIMEOUT = 3 };

static inline int rm_sleepers_init(rm_sleepers *s) {
    pthread_condattr_t a;
    if (pthread_condattr_init(&a) != 0) return -1;
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    if (pthread_cond_init(&s->cv, &a) != 0) { pthread_condattr_destroy(&a); return -1; }
    pthread_condattr_destroy(&a);
    if (pthread_mutex_init(&s->mu, NULL) != 0) { pthread_cond_destroy(&s->cv); return -1; }
    s->polling = 0;
    s->gen = 0;
    return 0;
}

static inline void rm_sleepers_destroy(rm_sleepers *s) {
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
}

/* Read before the last look at what the caller waits for. */
static inline uint64_t rm_sleepers_gen(rm_sleepers *s) {
    return __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE);
}

/* RM_SLEEP_POLL: the caller is now the poller: it sleeps in the transport, then calls
 * rm_sleepers_polled. RM_SLEEP_LOOK: the generation moved since `seen` (at once, or
 * while waiting for the poller): look again. RM_SLEEP_TIMEOUT: `ms` passed. */
static inline int rm_sleepers_enter(rm_sleepers *s, uint64_t seen, int ms) {
    struct timespec until;
    int r = RM_SLEEP_TIMEOUT;
    pthread_mutex_lock(&s->mu);
    if (s->gen != seen) {
        r = RM_SLEEP_LOOK;
    } else if (!s->polling) {
        s->polling = 1;
        r = RM_SLEEP_POLL;
    } else {
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += ms / 1000;
        until.tv_nsec += (long)(ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
        while (s->gen == seen) {
            if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT) break;
        }
        if (s->gen != seen) r = RM_SLEEP_LOOK;
    }
    pthread_mutex_unlock(&s->mu);
    return r;
}

/* The poller is back from the transport (woken or not): the others look again, and
 * one of them polls next if it still has to wait. */
static inline void rm_sleepers_polled(rm_sleepers *s) {
    pthread_mutex_lock(&s->mu);
    s->polling = 0;
    __atomic_add_fetch(&s->gen, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

#endif
