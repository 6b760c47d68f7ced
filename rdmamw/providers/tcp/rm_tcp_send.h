/* The tcp provider's send path (rdmamw/providers/tcp/rm_tcp.h has the rest).
 *
 * A peer that stops reading (stopped, or hostile: it asks for a large READ and never
 * drains its socket) must not stop this process: the stream's order is decided under
 * bl_mu (never held across a wait), and a chain whose turn comes while the socket is
 * full or another thread is half-way through a frame (send_mu) goes to the send
 * backlog, a copy sent in order before anything new (the responder thread flushes
 * it), when its poster cannot wait: it holds the GIL (the engine posts small batches
 * without releasing it), or its deadline (TcpTransport.post_deadline) passed. A post
 * therefore waits only without the GIL and only until its deadline; close() waits a
 * bounded time for the stream. The backlog is bounded (RT_BACKLOG_MAX): a peer that
 * reads nothing while it grows past that is lost (RT_WHY_STALLED). */
#ifndef RM_TCP_SEND_H
#define RM_TCP_SEND_H
#include "rm_tcp_conn.h"

/* Wait (holding nothing but the caller's send_mu) for room in the socket: 0 (look
 * again), RT_PASSED (the deadline, 0: none), or the state once it is not RT_UP (with
 * until_lost, only RT_LOST ends it: close()'s last flush). */
static int rt_wait_room(rt_conn *c, int64_t deadline, int until_lost) {
    struct pollfd pfd;
    int64_t ms = 50, left;
    int st = rt_state(c);
    if (st != RT_UP && (!until_lost || st == RT_LOST)) return st;
    if (deadline) {
        left = deadline - rt_now();
        if (left <= 0) return RT_PASSED;
        if (left / 1000000 + 1 < ms) ms = left / 1000000 + 1;
    }
    pfd.fd = c->sock;
    pfd.events = POLLOUT;
    pfd.revents = 0;
    poll(&pfd, 1, (int)ms);
    return 0;
}

/* Send what the socket takes now of *piov[0..*pcnt) (caller holds send_mu), advancing
 * the vector in place: 0 (all sent), RT_BLOCKED (the rest is left), or RT_LOST /
 * RT_CLOSED. */
static int rt_send_some(rt_conn *c, struct iovec **piov, int *pcnt) {
    struct msghdr msg;
    struct iovec *iov = *piov;
    int cnt = *pcnt, st;
    ssize_t r;
    while (cnt > 0 && iov[0].iov_len == 0) { iov++; cnt--; }
    while (cnt > 0) {
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = cnt < RT_IOV_MAX ? cnt : RT_IOV_MAX;
        r = sendmsg(c->sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR) continue;
            *piov = iov;
            *pcnt = cnt;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return RT_BLOCKED;
            st = rt_state(c);
            if (st == RT_CLOSED) return st;
            rt_lose(c, RT_WHY_IO, errno);
            return RT_LOST;
        }
        __atomic_store_n(&c->last_tx, rt_now(), __ATOMIC_RELAXED);
        while (r > 0) {
            if ((size_t)r >= iov[0].iov_len) {
                r -= (ssize_t)iov[0].iov_len;
                iov++;
                cnt--;
            } else {
                iov[0].iov_base = (char *)iov[0].iov_base + r;
                iov[0].iov_len -= (size_t)r;
                r = 0;
            }
        }
        while (cnt > 0 && iov[0].iov_len == 0) { iov++; cnt--; }
    }
    *piov = iov;
    *pcnt = 0;
    return 0;
}

/* Send all of the chain, waiting for room until the deadline (0: none): 0, RT_PASSED
 * (the rest is left in *piov), or RT_LOST / RT_CLOSED (a chain cut after its first
 * byte tears the stream: c->torn). */
static int rt_send_until(rt_conn *c, struct iovec **piov, int *pcnt, int64_t deadline) {
    int rc, began = 0, n0 = *pcnt;
    size_t first = n0 > 0 ? (*piov)[0].iov_len : 0;
    for (;;) {
        rc = rt_send_some(c, piov, pcnt);
        if (*pcnt != n0 || (n0 > 0 && (*piov)[0].iov_len != first)) began = 1;
        if (rc != RT_BLOCKED) break;
        rc = rt_wait_room(c, deadline, 0);
        if (rc) break;
    }
    if (rc < 0 && began && *pcnt > 0) c->torn = 1;
    return rc;
}

/* Send all of iov[0..cnt) (caller holds send_mu), waiting for room until it drains
 * or the connection goes down. Returns 0 or RT_LOST / RT_CLOSED. */
static int rt_send_locked(rt_conn *c, struct iovec *iov, int cnt) {
    return rt_send_until(c, &iov, &cnt, 0);
}

static int rt_bl_add(rt_conn *c, const struct iovec *iov, int cnt, int prepend);

/* The responder's answer to a READ (send_mu and xp_mu held): sent as the peer reads;
 * but when another thread wants xp_mu (a range is being exposed or unexposed: the
 * engine, maybe holding the GIL) while the socket is full, the rest of the answer is
 * copied into the backlog (first) and the range let go; past RT_BACKLOG_MAX the peer
 * is lost. 0 or the state. */
static int rt_answer(rt_conn *c, struct iovec *iov, int cnt) {
    int rc, bad, n0 = cnt;
    size_t first = cnt > 0 ? iov[0].iov_len : 0;
    for (;;) {
        rc = rt_send_some(c, &iov, &cnt);
        if (rc != RT_BLOCKED) break;
        if (__atomic_load_n(&c->xp_wanted, __ATOMIC_ACQUIRE)) {
            pthread_mutex_lock(&c->bl_mu);
            bad = rt_bl_add(c, iov, cnt, 1);
            pthread_mutex_unlock(&c->bl_mu);
            if (!bad) return 0;
            rt_lose(c, RT_WHY_STALLED, 0);
            rc = RT_LOST;
            break;
        }
        rc = rt_wait_room(c, 0, 0);
        if (rc) break;
    }
    if (rc < 0 && cnt > 0 && (cnt != n0 || iov[0].iov_len != first)) c->torn = 1;
    return rc;
}

/* Take xp_mu for expose / unexpose, telling a responder stuck on it to let go. */
static void rt_xp_lock(rt_conn *c) {
    __atomic_add_fetch(&c->xp_wanted, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&c->xp_mu);
    __atomic_sub_fetch(&c->xp_wanted, 1, __ATOMIC_SEQ_CST);
}

/* Copy the unsent rest of iov[0..cnt) into the backlog (bl_mu held): at its end, or
 * at its start (prepend) for the rest of a chain already begun on the stream, which
 * goes before anything queued while it was being sent. 0, or -1 when the backlog
 * would pass RT_BACKLOG_MAX (or no memory). */
static int rt_bl_add(rt_conn *c, const struct iovec *iov, int cnt, int prepend) {
    size_t n = 0, cap;
    char *p, *dst;
    int i;
    for (i = 0; i < cnt; i++) n += iov[i].iov_len;
    if (n == 0) return 0;
    if (c->bl_len + n > RT_BACKLOG_MAX) return -1;
    if (prepend && c->bl_head >= n) {
        c->bl_head -= n;
        dst = c->bl + c->bl_head;
    } else if (!prepend && c->bl_head + c->bl_len + n <= c->bl_cap) {
        dst = c->bl + c->bl_head + c->bl_len;
    } else {
        if (c->bl_len + n > c->bl_cap) {
            cap = 2 * c->bl_cap > c->bl_len + n ? 2 * c->bl_cap : c->bl_len + n;
            if (cap < 65536) cap = 65536;
            p = (char *)malloc(cap);
            if (p == NULL) return -1;
            if (c->bl_len) memcpy(p + (prepend ? n : 0), c->bl + c->bl_head, c->bl_len);
            free(c->bl);
            c->bl = p;
            c->bl_cap = cap;
        } else if (c->bl_len) {
            memmove(c->bl + (prepend ? n : 0), c->bl + c->bl_head, c->bl_len);
        }
        c->bl_head = 0;
        dst = c->bl + (prepend ? 0 : c->bl_len);
    }
    for (i = 0; i < cnt; i++) {
        memcpy(dst, iov[i].iov_base, iov[i].iov_len);
        dst += iov[i].iov_len;
    }
    c->bl_bytes += n;
    __atomic_store_n(&c->bl_len, c->bl_len + n, __ATOMIC_RELEASE);
    return 0;
}

/* Send the backlog (caller holds send_mu) until it is empty (0; with keep, bl_mu is
 * then held), the deadline passes (RT_PASSED), or the connection goes (its state).
 * bl_mu is held only around non-blocking sends, so posters can queue meanwhile. */
static int rt_bl_flush(rt_conn *c, int64_t deadline, int keep, int until_lost) {
    ssize_t r;
    int rc, err;
    for (;;) {
        err = 0;
        pthread_mutex_lock(&c->bl_mu);
        while (c->bl_len) {
            r = send(c->sock, c->bl + c->bl_head, c->bl_len, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (r > 0) {
                c->bl_head += (size_t)r;
                __atomic_store_n(&c->bl_len, c->bl_len - (size_t)r, __ATOMIC_RELEASE);
                __atomic_store_n(&c->last_tx, rt_now(), __ATOMIC_RELAXED);
                continue;
            }
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) err = errno;
            break;
        }
        if (c->bl_len == 0) {
            c->bl_head = 0;
            if (!keep) pthread_mutex_unlock(&c->bl_mu);
            return 0;
        }
        pthread_mutex_unlock(&c->bl_mu);
        if (err) {
            rc = rt_state(c);
            if (rc == RT_CLOSED) return rc;
            rt_lose(c, RT_WHY_IO, err);
            return RT_LOST;
        }
        rc = rt_wait_room(c, deadline, until_lost);
        if (rc) return rc;
    }
}

/* Lock m by the deadline (CLOCK_MONOTONIC ns; 0: none) while the connection is up
 * (with any_state, whatever its state): 0, RT_PASSED, or the state. */
static int rt_lock_until(rt_conn *c, pthread_mutex_t *m, int64_t deadline, int any_state) {
    struct timespec until;
    int64_t slice;
    int st;
    for (;;) {
        if (pthread_mutex_trylock(m) == 0) return 0;
        st = rt_state(c);
        if (st != RT_UP && !any_state) return st;
        slice = 50000000;
        if (deadline) {
            if (deadline - rt_now() <= 0) return RT_PASSED;
            if (deadline - rt_now() < slice) slice = deadline - rt_now();
        }
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += (long)slice;
        while (until.tv_nsec >= 1000000000) { until.tv_sec++; until.tv_nsec -= 1000000000; }
        if (pthread_mutex_timedlock(m, &until) == 0) return 0;
    }
}

/* Wake the responder thread to look at the state now (it also looks every 100 ms):
 * a close joins it, and would otherwise wait out that sleep. */
static void rt_wake_responder(rt_conn *c) {
    pthread_mutex_lock(&c->rq_mu);
    pthread_cond_broadcast(&c->rq_cv);
    pthread_mutex_unlock(&c->rq_mu);
}


/* A chain's turn on the stream. Returns with bl_mu held (the caller does what must
 * follow the stream's order under it, then calls rt_commit) and:
 *  RT_DIRECT: send_mu held too, the backlog empty: the chain goes straight out;
 *  RT_QUEUE: the stream is busy and the poster cannot wait (may_wait 0: it holds
 *    the GIL): the chain goes to the backlog;
 *  RT_QUEUE_LATE: the deadline passed while waiting: to the backlog too, RT_LATE;
 * or the state (<0) with no lock held. *held: send_mu is held. */
static int rt_turn(rt_conn *c, int64_t deadline, int may_wait, int *held) {
    int rc;
    *held = 0;
    pthread_mutex_lock(&c->bl_mu);
    if (__atomic_load_n(&c->bl_len, __ATOMIC_ACQUIRE) == 0 &&
        pthread_mutex_trylock(&c->send_mu) == 0) {
        *held = 1;
        return RT_DIRECT;
    }
    if (!may_wait) return RT_QUEUE;
    pthread_mutex_unlock(&c->bl_mu);
    rc = rt_lock_until(c, &c->send_mu, deadline, 0);
    if (rc == RT_PASSED) {
        pthread_mutex_lock(&c->bl_mu);
        return RT_QUEUE_LATE;
    }
    if (rc) return rc;
    *held = 1;
    rc = rt_bl_flush(c, deadline, 1, 0);        /* what was queued goes first */
    if (rc == 0) return RT_DIRECT;
    if (rc == RT_PASSED) {
        pthread_mutex_lock(&c->bl_mu);
        return RT_QUEUE_LATE;
    }
    pthread_mutex_unlock(&c->send_mu);
    *held = 0;
    return rc;
}

/* Put the chain iov[0..cnt) on the stream after rt_turn (mode, held). Straight out
 * waits for room (until the deadline) only if may_wait; what is left then goes
 * first in the backlog. 0, RT_LATE (accepted, past the deadline) or the state. */
static int rt_commit(rt_conn *c, struct iovec *iov, int cnt, int mode, int held,
                     int64_t deadline, int may_wait) {
    int rc = RT_QUEUE, bad;
    if (mode == RT_DIRECT) {
        pthread_mutex_unlock(&c->bl_mu);
        rc = may_wait ? rt_send_until(c, &iov, &cnt, deadline) : rt_send_some(c, &iov, &cnt);
        if (rc != RT_BLOCKED && rc != RT_PASSED) {
            pthread_mutex_unlock(&c->send_mu);
            return rc;
        }
        pthread_mutex_lock(&c->bl_mu);          /* the rest goes first in the backlog */
    }
    bad = rt_bl_add(c, iov, cnt, mode == RT_DIRECT);
    pthread_mutex_unlock(&c->bl_mu);
    if (held) pthread_mutex_unlock(&c->send_mu);
    if (bad) {
        rt_lose(c, RT_WHY_STALLED, 0);
        return RT_LOST;
    }
    rt_wake_responder(c);
    return mode == RT_QUEUE_LATE || rc == RT_PASSED ? RT_LATE : 0;
}

static int rt_send_frame_locked(rt_conn *c, uint16_t type, uint16_t region, uint64_t off,
                                const void *payload, uint32_t length) {
    rt_frame f;
    struct iovec iov[2];
    f.type = type;
    f.region = region;
    f.length = length;
    f.offset = off;
    iov[0].iov_base = &f;
    iov[0].iov_len = sizeof f;
    iov[1].iov_base = (void *)payload;
    iov[1].iov_len = payload ? length : 0;
    return rt_send_locked(c, iov, 2);
}

/* An empty frame (WAKE) from any thread, in the stream's order (rt_turn). */
static int rt_send_empty(rt_conn *c, uint16_t type, int64_t deadline, int may_wait) {
    rt_frame f;
    struct iovec iov;
    int mode, held;
    if (rt_state(c) != RT_UP) return rt_state(c);
    memset(&f, 0, sizeof f);
    f.type = type;
    iov.iov_base = &f;
    iov.iov_len = sizeof f;
    mode = rt_turn(c, deadline, may_wait, &held);
    if (mode < 0) return mode;
    return rt_commit(c, &iov, 1, mode, held, deadline, may_wait);
}
#endif
