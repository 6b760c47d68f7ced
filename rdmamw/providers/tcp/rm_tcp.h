/* The tcp provider's data path in plain C, driven by rdmamw/providers/tcp/_transport.pyx.
 *
 * A connection carries frames {type, region, length, offset} + payload. The
 * receiving side's progress thread (no GIL, no Python) reads each frame header,
 * bounds-checks it against the local regions, then recv()s the payload straight
 * into the region at that offset: no staging copy. PUBLISH payloads (bitmap and
 * control words) land in a small buffer first and are stored word by word with
 * release order, so a reader that sees the word also sees the data sent before it
 * (TCP keeps the order, this thread applies frames in order). Anything malformed
 * drops the connection: the local engine then sees PeerLost, never a stray write.
 *
 * Liveness: EOF/RST, a socket error, or no byte from the peer for `timeout_ns`
 * (the peer sends a HEARTBEAT every `hb_ns` while idle) -> state = lost; also no
 * byte from the peer and no acknowledgement from its host for `host_ns`
 * (rt_host_gone: a host gone, not a process stopped).
 *
 * Rendezvous: XREAD_REQ / XWRITE name a range this side exposed (rm_expose.h; the
 * 16-bit key in `region`, the address in `offset`) and are checked against the local
 * exposure table. An XREAD_REQ is answered by the responder thread (READ_RESP, or
 * READ_ERR when the range was not exposed), so a long answer never stops this side
 * from receiving: two sides reading from each other cannot deadlock on full sockets.
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
#ifndef RM_TCP_H
#define RM_TCP_H
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "rm_expose.h"

enum {
    RT_WRITE = 1,      /* payload -> region[offset]                           */
    RT_PUBLISH = 2,    /* 8-byte words -> region[offset], release stores      */
    RT_WAKE = 3,       /* signal the local waiter (no payload)                */
    RT_READ_REQ = 4,   /* send back region[offset, +length] as a READ_RESP    */
    RT_READ_RESP = 5,  /* payload for the oldest outstanding READ_REQ         */
    RT_HEARTBEAT = 6,  /* liveness only (no payload)                          */
    RT_WRITE_IMM = 7,  /* WRITE, then signal the local waiter                 */
    RT_XREAD_REQ = 8,  /* send back an exposed range (key, address, length)   */
    RT_XWRITE = 9,     /* payload -> an exposed range (key, address)          */
    RT_READ_ERR = 10,  /* the oldest outstanding READ failed: nothing exposed */
    RT_NTYPES = 11
};
enum { RT_NREG = 4, RT_RD_MAX = 256, RT_IOV_MAX = 1024 };
#define RT_BACKLOG_MAX ((size_t)64 << 20)       /* bytes queued for a peer that reads nothing */
#define RT_CLOSE_LOCK_NS 500000000LL            /* close() waits this long for the stream */
/* rt_turn: how a chain goes; rt_send_*: why a send stopped short */
enum { RT_DIRECT = 0, RT_QUEUE = 1, RT_QUEUE_LATE = 2, RT_BLOCKED = 4, RT_PASSED = 5 };
enum { RT_LATE = -7 };      /* RM_ERR_LATE of transport/_base.pxd */
/* state: 1 = up, else RM_ERR_PEER_LOST (-2) / RM_ERR_CLOSED (-3) of transport/_base.pxd */
enum { RT_UP = 1, RT_LOST = -2, RT_CLOSED = -3 };
/* why the connection went down (diagnostics) */
enum { RT_WHY_NONE = 0, RT_WHY_EOF, RT_WHY_IO, RT_WHY_TIMEOUT, RT_WHY_FRAME, RT_WHY_LOCAL,
       RT_WHY_HOST, RT_WHY_STALLED };

typedef struct {
    uint16_t type;
    uint16_t region;
    uint32_t length;
    uint64_t offset;
} rt_frame;                 /* 16 bytes, little-endian on the wire (x86/arm64 hosts) */

typedef struct {
    int sock, evfd;
    int state, stop, waiting, why, err_no;
    int closing, exited;    /* local close in progress; progress thread returned */
    uint64_t pub_gen, seen_gen;
    char *addr[RT_NREG];
    uint64_t len[RT_NREG];
    char *pubbuf;
    uint32_t pubcap;
    pthread_mutex_t send_mu;
    int64_t last_rx, last_tx, hb_ns, timeout_ns, host_ns;
    uint64_t rd_addr[RT_RD_MAX];
    uint32_t rd_len[RT_RD_MAX];
    uint8_t rd_err[RT_RD_MAX];
    uint64_t rd_posted, rd_done;
    /* rendezvous: what this side exposed, and the XREAD_REQs the responder answers */
    rm_xtab *xtab;
    pthread_mutex_t xp_mu;      /* held by the responder while it sends from a range */
    pthread_mutex_t xw_mu;      /* held by the progress thread while it writes a range */
    pthread_mutex_t rq_mu;      /* the request queue; never held across I/O */
    pthread_cond_t rq_cv;
    rt_frame rq[RT_RD_MAX];
    uint64_t rq_head, rq_tail;
    uint64_t frames_rx, bytes_rx, wakes_rx, heartbeats_tx;
    rt_frame bad;           /* the frame that broke the connection, if any */
    /* the send backlog (see the top): bl[bl_head, +bl_len); bl_mu decides the order */
    pthread_mutex_t bl_mu;
    char *bl;
    size_t bl_head, bl_len, bl_cap;
    uint64_t bl_bytes;      /* counter: bytes that went through the backlog */
    int torn;               /* a send stopped half-way through a frame (send_mu held) */
} rt_conn;

static inline int64_t rt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int rt_state(rt_conn *c) { return __atomic_load_n(&c->state, __ATOMIC_ACQUIRE); }

static inline void rt_signal(rt_conn *c) {
    uint64_t one = 1;
    ssize_t r = write(c->evfd, &one, 8);
    (void)r;                /* EAGAIN: the counter is already non-zero, fine */
}

/* READ k is answered: count it, and wake an engine waiting for it (as a PUBLISH does:
 * rt_wait re-checks pub_gen after announcing that it waits, so no wake-up is lost). */
static inline void rt_read_done(rt_conn *c, uint64_t k) {
    __atomic_store_n(&c->rd_done, k + 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&c->pub_gen, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->waiting, __ATOMIC_SEQ_CST)) rt_signal(c);
}

/* Mark the connection down (first reason wins), wake the local waiter, and make
 * the peer see EOF. */
static void rt_lose(rt_conn *c, int why, int err) {
    int up = RT_UP;
    if (__atomic_compare_exchange_n(&c->state, &up, RT_LOST, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST)) {
        c->why = why;
        c->err_no = err;
    }
    shutdown(c->sock, SHUT_RDWR);
    rt_signal(c);
}

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

static void rt_wake_responder(rt_conn *c);

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

/* The peer has sent nothing for host_ns: has its host gone too? The peer's kernel
 * acknowledges our bytes (the heartbeats) even while its process is stopped or
 * starved, and answers every retransmission while its buffers are full (a closed
 * window leaves nothing unacknowledged at all). A host that has acknowledged none of
 * the bytes in flight for host_ns, and for longer than the current (backed-off)
 * retransmission timeout, is gone: link down, power off. The kernel's own
 * TCP_USER_TIMEOUT cannot tell these apart (it also ends a connection to a stopped
 * peer whose buffers are full), so it is set to the generous peer timeout. */
static int rt_host_gone(rt_conn *c) {
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    int64_t since_ack;
    if (getsockopt(c->sock, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0)
        return 0;
    since_ack = (int64_t)ti.tcpi_last_ack_recv * 1000000;
    if (since_ack <= c->host_ns)
        return 0;
    if (ti.tcpi_unacked > 0)        /* retransmitting: tcpi_rto is backed off already */
        return since_ack > (int64_t)ti.tcpi_rto * 1000;
    if (ti.tcpi_probes > 0)         /* probing (a closed window, or our link down): an
                                       answered probe resets the count; the interval
                                       is rto << backoff */
        return since_ack > ((int64_t)ti.tcpi_rto * 1000) << (ti.tcpi_backoff & 31);
    return 0;
}

/* Progress thread, nothing to read: send a heartbeat when this side has been quiet
 * for hb_ns, give up after timeout_ns without a byte from the peer (or after host_ns
 * if its host acknowledges nothing either), else poll. */
static int rt_rx_wait(rt_conn *c) {
    int64_t t, quiet, wait_ms = 1000;
    struct pollfd pfd;
    if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) return -RT_WHY_LOCAL;
    t = rt_now();
    if (c->timeout_ns > 0 && t - c->last_rx > c->timeout_ns) return -RT_WHY_TIMEOUT;
    if (c->host_ns > 0 && t - c->last_rx > c->host_ns && rt_host_gone(c)) return -RT_WHY_HOST;
    if (c->hb_ns > 0 && !__atomic_load_n(&c->closing, __ATOMIC_ACQUIRE)) {
        quiet = t - __atomic_load_n(&c->last_tx, __ATOMIC_RELAXED);
        if (quiet >= c->hb_ns && pthread_mutex_trylock(&c->send_mu) == 0) {
            /* never waits: a heartbeat that does not fit goes first in the backlog */
            if (pthread_mutex_trylock(&c->bl_mu) == 0) {
                if (c->bl_len == 0) {
                    rt_frame hb;
                    struct iovec iov, *p = &iov;
                    int n = 1;
                    memset(&hb, 0, sizeof hb);
                    hb.type = RT_HEARTBEAT;
                    iov.iov_base = &hb;
                    iov.iov_len = sizeof hb;
                    if (rt_send_some(c, &p, &n) == RT_BLOCKED && n > 0) {
                        if (rt_bl_add(c, p, n, 1)) rt_lose(c, RT_WHY_STALLED, 0);
                        else rt_wake_responder(c);
                    }
                    c->heartbeats_tx++;
                }
                pthread_mutex_unlock(&c->bl_mu);
            }
            pthread_mutex_unlock(&c->send_mu);
        }
        wait_ms = c->hb_ns / 2000000 + 1;
    }
    if (c->timeout_ns > 0 && c->timeout_ns / 1000000 < wait_ms)
        wait_ms = c->timeout_ns / 1000000 + 1;
    if (c->host_ns > 0 && c->host_ns / 4000000 < wait_ms)
        wait_ms = c->host_ns / 4000000 + 1;
    pfd.fd = c->sock;
    pfd.events = POLLIN;
    pfd.revents = 0;
    poll(&pfd, 1, (int)wait_ms);
    return 0;
}

/* Progress thread: receive exactly n bytes into buf. With nh, the same recvmsg
 * calls also take up to a frame header's worth of what follows into nh (*nh_got
 * counts it) without ever waiting for it: one system call per frame, and the
 * payload still lands straight in buf. 0 or -RT_WHY_*. */
static int rt_rx(rt_conn *c, char *buf, uint64_t n, char *nh, uint32_t *nh_got) {
    uint64_t got = 0;
    size_t chunk;
    ssize_t r;
    struct iovec iov[2];
    struct msghdr msg;
    int rc, tried = 0;
    while (got < n || (nh && !tried)) {
        chunk = n - got > (1u << 30) ? (1u << 30) : (size_t)(n - got);
        iov[0].iov_base = buf + got;
        iov[0].iov_len = chunk;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        if (nh && chunk == n - got) {
            iov[1].iov_base = nh + *nh_got;
            iov[1].iov_len = sizeof(rt_frame) - *nh_got;
            msg.msg_iovlen = 2;
        }
        r = recvmsg(c->sock, &msg, MSG_DONTWAIT);
        if (r > 0) {
            c->bytes_rx += (uint64_t)r;
            c->last_rx = rt_now();
            if ((size_t)r <= chunk) {
                got += (uint64_t)r;
            } else {
                got += chunk;
                *nh_got += (uint32_t)((size_t)r - chunk);
            }
            if (got == n) tried = 1;
            continue;
        }
        if (got == n) return 0;     /* EOF or error: the next header read reports it */
        if (r == 0) return -RT_WHY_EOF;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            c->err_no = errno;
            return -RT_WHY_IO;
        }
        rc = rt_rx_wait(c);
        if (rc) return rc;
    }
    return 0;
}

/* Is [off, off+length) inside local region `region`? */
static inline int rt_in_region(rt_conn *c, uint16_t region, uint64_t off, uint64_t length) {
    return region < RT_NREG && c->len[region] && off <= c->len[region] &&
           length <= c->len[region] - off;
}

/* Apply one frame whose header is in f; payload reads also fetch what they can of
 * the next header into nh (rt_rx). 0, or -RT_WHY_*. */
static int rt_apply(rt_conn *c, const rt_frame *f, char *nh, uint32_t *nh_got) {
    int rc;
    uint64_t w, *dst, *src;
    uint64_t k;
    rm_xent xe;
    switch (f->type) {
    case RT_WRITE:
    case RT_WRITE_IMM:
        if (!rt_in_region(c, f->region, f->offset, f->length)) return -RT_WHY_FRAME;
        rc = rt_rx(c, c->addr[f->region] + f->offset, f->length, nh, nh_got);
        if (rc) return rc;
        if (f->type == RT_WRITE_IMM) rt_signal(c);
        return 0;
    case RT_PUBLISH:
        if (!rt_in_region(c, f->region, f->offset, f->length) || f->length > c->pubcap ||
            ((f->offset | f->length) & 7))
            return -RT_WHY_FRAME;
        rc = rt_rx(c, c->pubbuf, f->length, nh, nh_got);
        if (rc) return rc;
        dst = (uint64_t *)(c->addr[f->region] + f->offset);
        src = (uint64_t *)c->pubbuf;
        for (w = 0; w < f->length / 8; w++) __atomic_store_n(&dst[w], src[w], __ATOMIC_RELEASE);
        __atomic_add_fetch(&c->pub_gen, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&c->waiting, __ATOMIC_SEQ_CST)) rt_signal(c);
        return 0;
    case RT_WAKE:
        if (f->length || f->offset || f->region) return -RT_WHY_FRAME;
        c->wakes_rx++;
        rt_signal(c);
        return 0;
    case RT_HEARTBEAT:
        if (f->length || f->offset || f->region) return -RT_WHY_FRAME;
        return 0;
    case RT_READ_REQ:
        if (!rt_in_region(c, f->region, f->offset, f->length)) return -RT_WHY_FRAME;
        pthread_mutex_lock(&c->send_mu);
        rc = rt_bl_flush(c, 0, 0, 0);       /* what was queued goes first */
        if (!rc)
            rc = rt_send_frame_locked(c, RT_READ_RESP, 0, 0, c->addr[f->region] + f->offset,
                                      f->length);
        pthread_mutex_unlock(&c->send_mu);
        return rc ? -RT_WHY_IO : 0;
    case RT_XREAD_REQ:          /* queued for the responder thread */
        if (!c->xtab) return -RT_WHY_FRAME;
        pthread_mutex_lock(&c->rq_mu);
        if (c->rq_tail - c->rq_head >= RT_RD_MAX) {
            pthread_mutex_unlock(&c->rq_mu);
            return -RT_WHY_FRAME;   /* more READs outstanding than a peer may have */
        }
        c->rq[c->rq_tail % RT_RD_MAX] = *f;
        c->rq_tail++;
        pthread_cond_signal(&c->rq_cv);
        pthread_mutex_unlock(&c->rq_mu);
        return 0;
    case RT_XWRITE:
        if (!c->xtab) return -RT_WHY_FRAME;
        pthread_mutex_lock(&c->xw_mu);
        if (rm_xtab_find(c->xtab, f->region, f->offset, f->length, RM_XACC_WRITE, &xe)) {
            pthread_mutex_unlock(&c->xw_mu);
            return -RT_WHY_FRAME;
        }
        rc = rt_rx(c, (char *)(uintptr_t)f->offset, f->length, nh, nh_got);
        pthread_mutex_unlock(&c->xw_mu);
        return rc;
    case RT_READ_ERR:
        k = __atomic_load_n(&c->rd_done, __ATOMIC_ACQUIRE);
        if (k >= __atomic_load_n(&c->rd_posted, __ATOMIC_ACQUIRE) || f->region || f->offset ||
            f->length)
            return -RT_WHY_FRAME;
        c->rd_err[k % RT_RD_MAX] = 1;
        rt_read_done(c, k);
        return 0;
    case RT_READ_RESP:
        k = __atomic_load_n(&c->rd_done, __ATOMIC_ACQUIRE);
        if (k >= __atomic_load_n(&c->rd_posted, __ATOMIC_ACQUIRE) || f->region || f->offset ||
            f->length != c->rd_len[k % RT_RD_MAX])
            return -RT_WHY_FRAME;
        rc = rt_rx(c, (char *)(uintptr_t)c->rd_addr[k % RT_RD_MAX], f->length, nh, nh_got);
        if (rc) return rc;
        rt_read_done(c, k);
        return 0;
    default:
        return -RT_WHY_FRAME;
    }
}

/* Wake the responder thread to look at the state now (it also looks every 100 ms):
 * a close joins it, and would otherwise wait out that sleep. */
static void rt_wake_responder(rt_conn *c) {
    pthread_mutex_lock(&c->rq_mu);
    pthread_cond_broadcast(&c->rq_cv);
    pthread_mutex_unlock(&c->rq_mu);
}

/* The progress thread: apply frames until the connection goes down or stop. */
static void *rt_progress(void *arg) {
    rt_conn *c = (rt_conn *)arg;
    rt_frame f, next;
    uint32_t have = 0;          /* bytes of `next` already received */
    int rc;
    c->last_rx = rt_now();
    for (;;) {
        rc = have < sizeof next ? rt_rx(c, (char *)&next + have, sizeof next - have, NULL, NULL)
                                : 0;
        if (rc == 0) {
            f = next;
            have = 0;
            c->frames_rx++;
            rc = rt_apply(c, &f, (char *)&next, &have);
            if (rc == -RT_WHY_FRAME) c->bad = f;
        }
        if (rc) {
            if (rc != -RT_WHY_LOCAL) rt_lose(c, -rc, c->err_no);
            rt_signal(c);
            rt_wake_responder(c);
            __atomic_store_n(&c->exited, 1, __ATOMIC_RELEASE);
            return NULL;
        }
    }
}

/* The responder thread: answer queued XREAD_REQs from the exposed ranges. It holds
 * xp_mu while sending, so a range cannot be un-exposed (and freed) under it. */
static void *rt_responder(void *arg) {
    rt_conn *c = (rt_conn *)arg;
    rt_frame f;
    rm_xent xe;
    int ok, rc = 0;
    struct timespec until;
    while (!rc) {
        pthread_mutex_lock(&c->rq_mu);
        while (c->rq_head == c->rq_tail && !__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) &&
               rt_state(c) == RT_UP && !__atomic_load_n(&c->bl_len, __ATOMIC_ACQUIRE)) {
            clock_gettime(CLOCK_REALTIME, &until);      /* look at the state now and then */
            until.tv_nsec += 100000000;
            if (until.tv_nsec >= 1000000000) { until.tv_sec++; until.tv_nsec -= 1000000000; }
            pthread_cond_timedwait(&c->rq_cv, &c->rq_mu, &until);
        }
        if (c->rq_head == c->rq_tail) {
            pthread_mutex_unlock(&c->rq_mu);
            if (rt_state(c) != RT_UP || !__atomic_load_n(&c->bl_len, __ATOMIC_ACQUIRE))
                break;
            pthread_mutex_lock(&c->send_mu);        /* queued chains: send them */
            rc = rt_bl_flush(c, 0, 0, 0);
            pthread_mutex_unlock(&c->send_mu);
            continue;
        }
        f = c->rq[c->rq_head % RT_RD_MAX];
        c->rq_head++;
        pthread_mutex_unlock(&c->rq_mu);
        pthread_mutex_lock(&c->xp_mu);
        ok = rm_xtab_find(c->xtab, f.region, f.offset, f.length, RM_XACC_READ, &xe) == 0;
        pthread_mutex_lock(&c->send_mu);
        rc = rt_bl_flush(c, 0, 0, 0);           /* what was queued goes first */
        if (!rc)
            rc = ok ? rt_send_frame_locked(c, RT_READ_RESP, 0, 0,
                                           (const void *)(uintptr_t)f.offset, f.length)
                    : rt_send_frame_locked(c, RT_READ_ERR, 0, 0, NULL, 0);
        pthread_mutex_unlock(&c->send_mu);
        pthread_mutex_unlock(&c->xp_mu);
    }
    return NULL;
}

/* Expose / un-expose for the engine's thread. Un-exposing waits for a transfer from
 * or into the range to end (xp_mu, then xw_mu: the order the threads never invert). */
static uint32_t rt_expose(rt_conn *c, uint64_t addr, uint64_t len, uint32_t access) {
    uint32_t key;
    pthread_mutex_lock(&c->xp_mu);
    pthread_mutex_lock(&c->xw_mu);
    key = rm_xtab_add(c->xtab, addr, len, access, RM_XNONE);
    pthread_mutex_unlock(&c->xw_mu);
    pthread_mutex_unlock(&c->xp_mu);
    return key;
}

static void rt_unexpose(rt_conn *c, uint32_t key) {
    rm_xent xe;
    pthread_mutex_lock(&c->xp_mu);
    pthread_mutex_lock(&c->xw_mu);
    rm_xtab_del(c->xtab, key, &xe);
    pthread_mutex_unlock(&c->xw_mu);
    pthread_mutex_unlock(&c->xp_mu);
}

/* Local close without losing data in flight: send FIN after everything queued,
 * keep receiving until the peer's FIN (its progress thread answers EOF with one), so
 * the socket is closed with an empty receive queue and no RST can destroy what the
 * peer has not read yet. After linger_ns the connection is cut anyway. */
static void rt_close_graceful(rt_conn *c, int64_t linger_ns) {
    int up = RT_UP, cut = 1;
    int64_t end = rt_now() + linger_ns;
    struct timespec ms = {0, 1000000};
    __atomic_store_n(&c->closing, 1, __ATOMIC_SEQ_CST);
    __atomic_compare_exchange_n(&c->state, &up, RT_CLOSED, 0, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    rt_wake_responder(c);
    /* no post() or READ answer is half-way through a chain: each gives up on a full
     * socket once the state is not RT_UP, so this wait is short; it is bounded anyway.
     * Then what was queued goes, within the linger time; a stream cut half-way
     * through a frame (c->torn), or a backlog the peer does not take, is cut at once */
    if (rt_lock_until(c, &c->send_mu, rt_now() + RT_CLOSE_LOCK_NS, 1) == 0) {
        if (!c->torn && rt_bl_flush(c, end, 0, 1) == 0) {
            shutdown(c->sock, SHUT_WR);
            cut = 0;
        }
        pthread_mutex_unlock(&c->send_mu);
    }
    while (!cut && !__atomic_load_n(&c->exited, __ATOMIC_ACQUIRE) && rt_now() < end)
        nanosleep(&ms, NULL);
    __atomic_store_n(&c->stop, 1, __ATOMIC_SEQ_CST);
    rt_wake_responder(c);
    shutdown(c->sock, SHUT_RDWR);
}

/* The engine's wait(): block until woken (1), timeout (0) or the peer goes (<0).
 * Anything published since the last wait() returned counts as a wake-up, so a
 * PUBLISH that lands between the engine's last check and this call is not lost. */
static int rt_wait(rt_conn *c, int timeout_ms) {
    struct pollfd pfd;
    uint64_t junk, g;
    int st, r;
    __atomic_store_n(&c->waiting, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    g = __atomic_load_n(&c->pub_gen, __ATOMIC_SEQ_CST);
    st = rt_state(c);
    if (g != c->seen_gen || st != RT_UP) {
        __atomic_store_n(&c->waiting, 0, __ATOMIC_SEQ_CST);
        c->seen_gen = g;
        return st != RT_UP ? st : 1;
    }
    pfd.fd = c->evfd;
    pfd.events = POLLIN;
    pfd.revents = 0;
    r = poll(&pfd, 1, timeout_ms);
    __atomic_store_n(&c->waiting, 0, __ATOMIC_SEQ_CST);
    if (r > 0) {
        ssize_t k = read(c->evfd, &junk, 8);
        (void)k;
    }
    c->seen_gen = __atomic_load_n(&c->pub_gen, __ATOMIC_SEQ_CST);
    st = rt_state(c);
    if (st != RT_UP) return st;
    return r > 0 ? 1 : 0;
}

/* An event loop's wait: announce a waiter (every PUBLISH from now on signals evfd),
 * then drain evfd; the caller checks the words after this, so a PUBLISH is either
 * seen by that check or signals evfd again. Stays announced until rt_disarm. */
static int rt_arm(rt_conn *c) {
    uint64_t junk;
    ssize_t k;
    int st;
    __atomic_store_n(&c->waiting, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    k = read(c->evfd, &junk, 8);            /* non-blocking: empty is fine */
    (void)k;
    c->seen_gen = __atomic_load_n(&c->pub_gen, __ATOMIC_SEQ_CST);
    st = rt_state(c);
    return st != RT_UP ? st : 0;
}

static void rt_disarm(rt_conn *c) { __atomic_store_n(&c->waiting, 0, __ATOMIC_SEQ_CST); }
#endif
