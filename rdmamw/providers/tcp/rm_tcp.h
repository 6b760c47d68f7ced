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
 * What this side sends, in order and without ever stopping a thread on a peer that
 * does not read, is rm_tcp_send.h's (the send backlog); rt_conn is in rm_tcp_conn.h.
 * User regions (RCHAIN / RDONE) are rm_tcp_region.h's. */
#ifndef RM_TCP_H
#define RM_TCP_H
#include "rm_tcp_region.h"

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
 * if its host acknowledges nothing either), else poll (at most cap_ms, 0: no cap). */
static int rt_rx_wait(rt_conn *c, int64_t cap_ms) {
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
    /* the backlog's sender is the responder thread; should it not run, this one tries */
    if (__atomic_load_n(&c->bl_len, __ATOMIC_ACQUIRE) &&
        pthread_mutex_trylock(&c->send_mu) == 0) {
        rt_bl_flush(c, 1, 0, 0);            /* one try that never waits (deadline past) */
        pthread_mutex_unlock(&c->send_mu);
    }
    if (c->timeout_ns > 0 && c->timeout_ns / 1000000 < wait_ms)
        wait_ms = c->timeout_ns / 1000000 + 1;
    if (c->host_ns > 0 && c->host_ns / 4000000 < wait_ms)
        wait_ms = c->host_ns / 4000000 + 1;
    if (cap_ms > 0 && cap_ms < wait_ms) wait_ms = cap_ms;
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
        rc = rt_rx_wait(c, 0);
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
    int why;
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
        return rt_rq_push(c, f, 0, 0);
    case RT_XWRITE:             /* a rendezvous range only (untagged) */
        if (!c->xtab) return -RT_WHY_FRAME;
        if (rt_xwhy(c, f->region, 0, f->offset, f->length, RM_XACC_WRITE)) return -RT_WHY_FRAME;
        return rt_rx_exposed(c, f->region, 0, f->offset, f->length, &why);
    case RT_RCHAIN:
        return rt_rchain(c, f);
    case RT_RDONE:
        return rt_rdone(c, f);
    case RT_READ_ERR:
        k = __atomic_load_n(&c->rd_done, __ATOMIC_ACQUIRE);
        if (k >= __atomic_load_n(&c->rd_posted, __ATOMIC_ACQUIRE) || f->region || f->offset ||
            f->length || c->rd_kind[k % RT_RD_MAX] == RT_RK_DONE)
            return -RT_WHY_FRAME;
        c->rd_err[k % RT_RD_MAX] = 1;
        if (c->rd_kind[k % RT_RD_MAX] == RT_RK_READ) {
            rt_read_done(c, k);
            return 0;
        }
        pthread_mutex_lock(&c->rf_mu);      /* the cell may be abandoned meanwhile */
        c->rd_cell[k % RT_RD_MAX]->read_err = 1;
        rt_read_done(c, k);
        pthread_mutex_unlock(&c->rf_mu);
        return 0;
    case RT_READ_RESP:
        k = __atomic_load_n(&c->rd_done, __ATOMIC_ACQUIRE);
        if (k >= __atomic_load_n(&c->rd_posted, __ATOMIC_ACQUIRE) || f->region || f->offset ||
            f->length != c->rd_len[k % RT_RD_MAX] || c->rd_kind[k % RT_RD_MAX] == RT_RK_DONE)
            return -RT_WHY_FRAME;
        if (c->rd_kind[k % RT_RD_MAX] != RT_RK_READ)  /* a region READ: its poster may */
            return rt_rx_rread(c, k, f->length);      /* give up meanwhile */
        rc = rt_rx(c, (char *)(uintptr_t)c->rd_addr[k % RT_RD_MAX], f->length, nh, nh_got);
        if (rc) return rc;
        rt_read_done(c, k);
        return 0;
    default:
        return -RT_WHY_FRAME;
    }
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
            rt_rcell_wake(c);       /* posters waiting for a chain's end: it will not come */
            return NULL;
        }
    }
}

/* The stream for the responder's next answer of n bytes: 0 with send_mu held and what
 * was queued sent; RT_QUEUE when the progress thread waits for this answer (rq_wait: a
 * WRITE follows it in its chain) while a post of ours holds the stream: a small answer
 * is then copied into the backlog after that post instead (rt_turn, rt_commit), so two
 * sides posting chains to each other never wait on each other in a ring; or the state.
 * It holds no range meanwhile: a revoke never waits for our own long post. */
static int rt_answer_turn(rt_conn *c, size_t n) {
    int rc;
    while ((rc = rt_lock_until(c, &c->send_mu, rt_now() + 1000000, 0)) == RT_PASSED)
        if (n <= RT_ANSWER_COPY && __atomic_load_n(&c->rq_wait, __ATOMIC_ACQUIRE))
            return RT_QUEUE;
    if (rc) return rc;
    rc = rt_bl_flush(c, 0, 0, 0);
    if (rc) pthread_mutex_unlock(&c->send_mu);
    return rc;
}

/* The responder thread: answer queued requests in order. An XREAD_REQ (a rendezvous
 * range) or a region READ is checked again and answered from the range holding xp_mu
 * (taken after the stream), so the range cannot be un-exposed (and freed) under it; a
 * chain's end (RDONE) says why the chain failed, if it did: the first refusal, the
 * progress thread's or a READ's; an atomic's answer (queued as READ_RESP) carries the
 * old value the progress thread got (little-endian, as the frames are). */
static void *rt_responder(void *arg) {
    rt_conn *c = (rt_conn *)arg;
    rt_req q;
    rt_frame f;
    struct iovec iov[2];
    uint32_t cwhy = 0, cidx = 0;      /* the chain's first READ refused here, and which */
    int why, rc = 0, ranged, turn, mode, held;
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
        q = c->rq[c->rq_head % RT_RD_MAX];
        c->rq_head++;
        pthread_mutex_unlock(&c->rq_mu);
        ranged = q.f.type == RT_XREAD_REQ || q.f.type == RT_RCHAIN;
        turn = rt_answer_turn(c, sizeof f + (ranged ? q.f.length : 0));
        if (turn < 0) break;
        memset(&f, 0, sizeof f);
        iov[0].iov_base = &f;
        iov[0].iov_len = sizeof f;
        iov[1].iov_base = NULL;
        iov[1].iov_len = 0;
        if (ranged) {
            pthread_mutex_lock(&c->xp_mu);
            why = rt_xwhy(c, q.f.region, q.f.type == RT_RCHAIN ? q.tag : 0, q.f.offset,
                          q.f.length, RM_XACC_READ);
            if (why && q.f.type == RT_RCHAIN && !cwhy) {
                cwhy = (uint32_t)why;
                cidx = q.index;
            }
            f.type = why ? RT_READ_ERR : RT_READ_RESP;
            if (!why) {
                iov[1].iov_base = (void *)(uintptr_t)q.f.offset;    /* the range's address */
                iov[1].iov_len = q.f.length;
                f.length = q.f.length;
            }
        } else if (q.f.type == RT_READ_RESP) {     /* an atomic's old value */
            f.type = RT_READ_RESP;
            f.length = 8;
            iov[1].iov_base = &q.f.offset;
            iov[1].iov_len = 8;
        } else if (q.f.type == RT_RDONE) {
            f.type = RT_RDONE;
            f.region = q.f.region;
            f.offset = q.f.offset;
            if (cwhy && (!f.region || cidx < f.offset)) {
                f.region = (uint16_t)cwhy;
                f.offset = cidx;
            }
            cwhy = 0;
        } else {
            f.type = RT_READ_ERR;       /* a READ of a chain that failed before it */
        }
        if (turn == RT_QUEUE) {
            mode = rt_turn(c, 0, 0, &held);
            rc = mode < 0 ? mode : rt_commit(c, iov, 2, mode, held, 0, 0);
        } else {
            rc = rt_answer(c, iov, 2);
            pthread_mutex_unlock(&c->send_mu);
        }
        if (ranged) pthread_mutex_unlock(&c->xp_mu);
        __atomic_add_fetch(&c->rq_done, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* Expose / un-expose for the engine's thread (and a region's owner). Un-exposing waits
 * for a transfer from or into the range to end (xp_mu, then xw_mu: the order the
 * threads never invert); neither waits long for a peer that reads or sends nothing
 * (rt_answer, rt_rx_exposed). */
static uint32_t rt_expose(rt_conn *c, uint64_t addr, uint64_t len, uint32_t access) {
    uint32_t key;
    rt_xp_lock(c);
    rt_xw_lock(c);
    key = rm_xtab_add(c->xtab, addr, len, access, RM_XNONE);
    pthread_mutex_unlock(&c->xw_mu);
    pthread_mutex_unlock(&c->xp_mu);
    return key;
}

static void rt_unexpose(rt_conn *c, uint32_t key) {
    rm_xent xe;
    rt_xp_lock(c);
    rt_xw_lock(c);
    rm_xtab_del(c->xtab, key, &xe);
    pthread_mutex_unlock(&c->xw_mu);
    pthread_mutex_unlock(&c->xp_mu);
}

/* Local close without losing data in flight: send FIN after everything queued,
 * keep receiving until the peer's FIN (its progress thread answers EOF with one), so
 * the socket is closed with an empty receive queue and no RST can destroy what the
 * peer has not read yet. After linger_ns the connection is cut anyway. */
static void rt_close_graceful(rt_conn *c, int64_t linger_ns) {
    int up = RT_UP, cut = 1, rc;
    int64_t end = rt_now() + linger_ns, slice;
    size_t left;
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
        rc = c->torn ? RT_LOST : RT_PASSED;
        while (rc == RT_PASSED) {       /* in slices: a peer that takes nothing is cut */
            left = __atomic_load_n(&c->bl_len, __ATOMIC_ACQUIRE);
            slice = rt_now() + RT_CLOSE_LOCK_NS / 2;
            rc = rt_bl_flush(c, slice < end ? slice : end, 0, 1);
            if (rc == RT_PASSED && (c->bl_len >= left || rt_now() >= end)) break;
        }
        if (rc == 0) {
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
