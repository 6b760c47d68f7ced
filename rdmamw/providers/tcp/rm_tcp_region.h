/* Remote memory regions on tcp (docs/remote-memory.md), both sides of a chain.
 *
 * The initiator (TcpTransport._post_region) puts a chain of region READs/WRITEs on the
 * stream as one RCHAIN frame {RCHAIN, n, n * 24, 0}, its n descriptors (rt_rdesc),
 * then the payload of each WRITE in order: one sendmsg. Each READ takes a slot of the
 * READ ring (rd_*: its answer lands straight in the READ's target), and the chain's end
 * one more; the poster waits for the end (rt_rcell_wait) until its deadline, then
 * abandons the chain (rt_rcell_abandon): an answer that comes later is dropped.
 *
 * The owner's progress thread (rt_rchain) receives the descriptors into its own stack,
 * copies each into a local before it looks at it, and checks them all against its own
 * exposure table (key, tag, bounds, access: rm_region_why; only the owner writes the
 * table) before any byte moves: a refused chain moves nothing (its WRITE payloads go
 * to a sink) and is answered by one RDONE {why, index}. Else the operations run in
 * order: a WRITE lands straight in the region, re-checked under xw_mu (rt_rx_exposed);
 * a READ is queued for the responder thread, which re-checks it under xp_mu and answers
 * READ_RESP from the region (or READ_ERR); the chain's end is queued after them, so the
 * RDONE follows every answer and every write of the chain. A WRITE after a READ of its
 * chain waits until the responder answered that READ.
 *
 * Atomics (RT_OP_FADD, RT_OP_CSWAP; a region exposed with RM_XACC_ATOMIC): the
 * descriptor names one aligned 64-bit word (length 8), its payload is two
 * little-endian words (the value to add, or the expected value and the new one), and
 * it takes a READ slot for its answer, the word's old value (READ_RESP of 8 bytes).
 * The progress thread runs it with the CPU's atomic instruction on the owner's word
 * (rt_xatomic, re-checked under xw_mu as a WRITE is), after the READs before it in its
 * chain were answered, and queues the old value for the responder, which sends it in
 * the chain's order.
 *
 * Revoke (rt_unexpose) takes xp_mu, then xw_mu: an answer being sent from the region
 * lets go of it when the socket is full (the rest is copied into the backlog first:
 * rt_answer), a WRITE being received lets go between pieces and whenever the socket is
 * empty (rt_rx_exposed; the rest of it then goes to the sink if the region is gone). So
 * when revoke returns no byte of the region moves, whatever the peer sends or reads. */
#ifndef RM_TCP_REGION_H
#define RM_TCP_REGION_H
#include <sched.h>
#include "rm_tcp_send.h"
#include "rm_tcp_atomic.h"
#define RT_PIECE ((uint32_t)1 << 30)    /* the largest operation of a chain */
#define RT_XW_PIECE ((uint64_t)1 << 20) /* a WRITE lets a revoke go first this often */
#define RT_ANSWER_COPY ((size_t)8 << 20) /* the largest answer copied to the backlog for
                                           a progress thread waiting on it */

typedef struct {
    uint16_t op;        /* RT_OP_* */
    uint16_t key;       /* the exposure's key */
    uint32_t tag;       /* the region's tag (never 0) */
    uint64_t addr;      /* in the owner's memory */
    uint32_t length;    /* at most RT_PIECE */
    uint32_t reserved;  /* 0 */
} rt_rdesc;             /* 24 bytes on the wire */

static int rt_rx(rt_conn *c, char *buf, uint64_t n, char *nh, uint32_t *nh_got);
static int rt_rx_wait(rt_conn *c, int64_t cap_ms);

/* Why an access to [addr, addr+n) under key fails (RM_RWHY_*): a region's (tag != 0),
 * or a rendezvous range's (tag 0: an untagged entry only). */
static int rt_xwhy(rt_conn *c, uint32_t key, uint32_t tag, uint64_t addr, uint64_t n,
                   uint32_t acc) {
    rm_xent xe;
    if (tag) return rm_region_why(c->xtab, key, tag, addr, n, acc);
    if (rm_xtab_find(c->xtab, key, addr, n, acc, &xe) || (xe.access >> RM_XTAG_SHIFT))
        return RM_RWHY_GONE;
    return RM_RWHY_OK;
}

/* What is on the socket now, up to n bytes: the count, 0 (nothing), or -RT_WHY_*. */
static int64_t rt_rx_now(rt_conn *c, char *buf, uint64_t n) {
    ssize_t r;
    for (;;) {
        r = recv(c->sock, buf, n, MSG_DONTWAIT);
        if (r > 0) {
            c->bytes_rx += (uint64_t)r;
            c->last_rx = rt_now();
            return r;
        }
        if (r == 0) return -RT_WHY_EOF;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        c->err_no = errno;
        return -RT_WHY_IO;
    }
}

/* Receive n bytes and drop them (a refused WRITE's payload). */
static int rt_rx_sink(rt_conn *c, uint64_t n) {
    char sink[65536];
    uint64_t k;
    int rc;
    while (n) {
        k = n < sizeof sink ? n : sizeof sink;
        rc = rt_rx(c, sink, k, NULL, NULL);
        if (rc) return rc;
        n -= k;
    }
    return 0;
}

/* Receive into dst[*done, n) what comes, holding *mu (the caller took it), until all
 * came or a thread waits for *mu (*wanted, checked between pieces and whenever the
 * socket is empty): that one goes first, *mu is taken again and this returns, so the
 * caller checks again what it receives into. 0 or -RT_WHY_*. */
static int rt_rx_yielding(rt_conn *c, pthread_mutex_t *mu, int *wanted, char *dst,
                          uint64_t n, uint64_t *done) {
    uint64_t want;
    int64_t got;
    int rc;
    while (*done < n) {
        if (__atomic_load_n(wanted, __ATOMIC_ACQUIRE)) {
            pthread_mutex_unlock(mu);
            while (__atomic_load_n(wanted, __ATOMIC_ACQUIRE)) sched_yield();
            pthread_mutex_lock(mu);
            return 0;
        }
        want = n - *done < RT_XW_PIECE ? n - *done : RT_XW_PIECE;
        got = rt_rx_now(c, dst + *done, want);
        if (got > 0) {
            *done += (uint64_t)got;
            continue;
        }
        if (got < 0) return (int)got;
        if (!__atomic_load_n(wanted, __ATOMIC_ACQUIRE)) {
            rc = rt_rx_wait(c, 5);      /* a thread that comes meanwhile waits <= 5 ms */
            if (rc) return rc;
        }
    }
    return 0;
}

/* Receive a WRITE's n-byte payload straight into [addr, addr+n), exposed under key and
 * tag (0: a rendezvous range), holding xw_mu. A revoke waiting for xw_mu (xw_wanted)
 * goes first between pieces and whenever the socket is empty; the range is then
 * checked again. *why: RM_RWHY_* of the check that failed, the rest of the payload then
 * dropped. 0 or -RT_WHY_*. */
static int rt_rx_exposed(rt_conn *c, uint32_t key, uint32_t tag, uint64_t addr, uint64_t n,
                         int *why) {
    uint64_t done = 0;
    int rc = 0;
    pthread_mutex_lock(&c->xw_mu);
    *why = rt_xwhy(c, key, tag, addr, n, RM_XACC_WRITE);
    while (!rc && done < n && !*why) {
        rc = rt_rx_yielding(c, &c->xw_mu, &c->xw_wanted, (char *)(uintptr_t)addr, n, &done);
        if (!rc && done < n) *why = rt_xwhy(c, key, tag, addr + done, n - done, RM_XACC_WRITE);
    }
    pthread_mutex_unlock(&c->xw_mu);
    if (!rc && done < n) rc = rt_rx_sink(c, n - done);
    return rc;
}

/* Receive the n-byte answer of region READ k (a READ_RESP) holding rf_mu: straight
 * into its target while the slot is RT_RK_RREAD, dropped once its poster abandoned it
 * (RT_RK_DROP: rt_rcell_abandon, which goes first between pieces and whenever the
 * socket is empty, as a revoke does for rt_rx_exposed). 0 or -RT_WHY_*. */
static int rt_rx_rread(rt_conn *c, uint64_t k, uint64_t n) {
    uint32_t slot = (uint32_t)(k % RT_RD_MAX);
    uint64_t done = 0;
    int rc = 0;
    pthread_mutex_lock(&c->rf_mu);
    while (!rc && done < n && c->rd_kind[slot] == RT_RK_RREAD)
        rc = rt_rx_yielding(c, &c->rf_mu, &c->rf_wanted,
                            (char *)(uintptr_t)c->rd_addr[slot], n, &done);
    if (!rc && done < n) {              /* abandoned: the rest goes to the sink */
        pthread_mutex_unlock(&c->rf_mu);
        rc = rt_rx_sink(c, n - done);
        pthread_mutex_lock(&c->rf_mu);
    }
    if (!rc) rt_read_done(c, k);
    pthread_mutex_unlock(&c->rf_mu);
    return rc;
}

/* Take rf_mu for a poster that gives up, telling an answer being received to let go. */
static void rt_rf_lock(rt_conn *c) {
    __atomic_add_fetch(&c->rf_wanted, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&c->rf_mu);
    __atomic_sub_fetch(&c->rf_wanted, 1, __ATOMIC_SEQ_CST);
}

/* Take xw_mu for expose / unexpose, telling a WRITE being received to let go. */
static void rt_xw_lock(rt_conn *c) {
    __atomic_add_fetch(&c->xw_wanted, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&c->xw_mu);
    __atomic_sub_fetch(&c->xw_wanted, 1, __ATOMIC_SEQ_CST);
}

/* Queue a request for the responder. 0, or -RT_WHY_FRAME when the peer has more
 * outstanding than its READ ring allows. */
static int rt_rq_push(rt_conn *c, const rt_frame *f, uint32_t tag, uint32_t index) {
    pthread_mutex_lock(&c->rq_mu);
    if (c->rq_tail - c->rq_head >= RT_RD_MAX) {
        pthread_mutex_unlock(&c->rq_mu);
        return -RT_WHY_FRAME;
    }
    c->rq[c->rq_tail % RT_RD_MAX].f = *f;
    c->rq[c->rq_tail % RT_RD_MAX].tag = tag;
    c->rq[c->rq_tail % RT_RD_MAX].index = index;
    c->rq_tail++;
    pthread_cond_signal(&c->rq_cv);
    pthread_mutex_unlock(&c->rq_mu);
    return 0;
}

static int rt_rq_part(rt_conn *c, uint16_t type, uint16_t region, uint32_t length,
                      uint64_t offset, uint32_t tag, uint32_t index) {
    rt_frame f;
    f.type = type;
    f.region = region;
    f.length = length;
    f.offset = offset;
    return rt_rq_push(c, &f, tag, index);
}

/* Wait until the responder has answered the first `upto` requests (a WRITE after a READ
 * of its chain). 0, or -RT_WHY_LOCAL once the connection is going. */
static int rt_rq_drain(rt_conn *c, uint64_t upto) {
    struct timespec tick = {0, 20000};
    int rc = 0;
    __atomic_store_n(&c->rq_wait, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&c->rq_done, __ATOMIC_ACQUIRE) < upto) {
        if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) || rt_state(c) != RT_UP) {
            rc = -RT_WHY_LOCAL;
            break;
        }
        nanosleep(&tick, NULL);
    }
    __atomic_store_n(&c->rq_wait, 0, __ATOMIC_SEQ_CST);
    return rc;
}

/* The owner's access bits an operation needs, or 0 for a descriptor no rdmamw sends
 * (the connection is then hung up). */
static uint32_t rt_rdesc_acc(const rt_rdesc *d) {
    if (d->reserved || d->length > RT_PIECE) return 0;
    switch (d->op) {
    case RT_OP_READ: return RM_XACC_READ;
    case RT_OP_WRITE: return RM_XACC_WRITE;
    case RT_OP_FADD:
    case RT_OP_CSWAP: return d->length == 8 ? RM_XACC_ATOMIC : 0;
    default: return 0;
    }
}

/* The payload bytes an operation carries after the chain's descriptors. */
static uint64_t rt_rdesc_pay(const rt_rdesc *d) {
    return d->op == RT_OP_WRITE ? d->length : d->op == RT_OP_READ ? 0 : RT_ATOMIC_OPERANDS;
}

/* The progress thread: atomic d, index i of its chain (*why, *idx: the chain's first
 * refusal), its operands received here; its answer queued for the responder: the old
 * value, or READ_ERR when the chain failed before it or the word is refused now.
 * 0 or -RT_WHY_*. */
static int rt_ratomic(rt_conn *c, const rt_rdesc *d, uint32_t i, int *why, uint32_t *idx) {
    uint64_t w[2], old = 0;
    int rc = rt_rx(c, (char *)w, sizeof w, NULL, NULL), r;
    if (rc) return rc;
    if (!*why) {
        r = rt_xatomic(c, d->op, d->key, d->tag, d->addr, w[0], w[1], &old);
        if (r) {
            *why = r;
            *idx = i;
        }
    }
    if (*why) return rt_rq_part(c, RT_READ_ERR, d->key, 0, d->addr, d->tag, i);
    return rt_rq_part(c, RT_READ_RESP, 0, 8, old, 0, i);    /* a value, not a range */
}

/* The owner's progress thread: an RCHAIN frame f (see the top). 0 or -RT_WHY_*. */
static int rt_rchain(rt_conn *c, const rt_frame *f) {
    rt_rdesc descs[RT_RCH_MAX], d;
    uint32_t n = f->region, i, idx = 0, acc;
    uint64_t pay = 0, reads_upto = 0;
    int rc, why = 0, w;
    if (!c->xtab || n == 0 || n > RT_RCH_MAX || f->length != n * sizeof(rt_rdesc) || f->offset)
        return -RT_WHY_FRAME;
    rc = rt_rx(c, (char *)descs, f->length, NULL, NULL);
    if (rc) return rc;
    for (i = 0; i < n; i++) {               /* the whole chain first: all or nothing */
        memcpy(&d, &descs[i], sizeof d);    /* each field read once, into a local */
        acc = rt_rdesc_acc(&d);
        if (!acc) return -RT_WHY_FRAME;     /* not a chain rdmamw makes: hang up */
        pay += rt_rdesc_pay(&d);
        if (!why) {
            w = rm_region_why(c->xtab, d.key, d.tag, d.addr, d.length, acc);
            if (!w && acc == RM_XACC_ATOMIC && (d.addr & 7)) w = RM_RWHY_ACCESS;
            if (w) {
                why = w;
                idx = i;
            }
        }
    }
    if (why) {                              /* refused: nothing moves */
        rc = rt_rx_sink(c, pay);
        return rc ? rc : rt_rq_part(c, RT_RDONE, (uint16_t)why, 0, idx, 0, 0);
    }
    for (i = 0; i < n; i++) {
        memcpy(&d, &descs[i], sizeof d);
        if (d.op == RT_OP_READ) {           /* the responder re-checks it */
            rc = rt_rq_part(c, why ? RT_READ_ERR : RT_RCHAIN, d.key, d.length, d.addr,
                            d.tag, i);
            if (rc) return rc;
            reads_upto = c->rq_tail;
            continue;
        }
        if (why) {          /* after a refusal: the rest is not done (READ_ERR answers
                               an atomic's slot) */
            rc = d.op == RT_OP_WRITE ? rt_rx_sink(c, d.length) : rt_ratomic(c, &d, i, &why, &idx);
            if (rc) return rc;
            continue;
        }
        if (reads_upto) {                   /* the chain's order: its READs first */
            rc = rt_rq_drain(c, reads_upto);
            if (rc) return rc;
            reads_upto = 0;
        }
        if (d.op != RT_OP_WRITE) {          /* an atomic: its answer is queued */
            rc = rt_ratomic(c, &d, i, &why, &idx);
            if (rc) return rc;
            continue;
        }
        rc = rt_rx_exposed(c, d.key, d.tag, d.addr, d.length, &w);
        if (rc) return rc;
        if (w) {
            why = w;
            idx = i;
        }
    }
    return rt_rq_part(c, RT_RDONE, (uint16_t)why, 0, idx, 0, 0);
}

/* ---- the initiator ------------------------------------------------------------- */

/* The progress thread: slot k's answer came (a region READ's or a chain's end: nobody
 * but its poster waits, on its cell). */
static void rt_rcell_wake(rt_conn *c) {
    if (__atomic_load_n(&c->rd_sleepers, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&c->rd_mu);
        pthread_cond_broadcast(&c->rd_cv);
        pthread_mutex_unlock(&c->rd_mu);
    }
}

/* The progress thread: an RDONE frame f, the end of the oldest outstanding chain. The
 * READ slots before its end are skipped only when the chain was refused (none was
 * answered). 0 or -RT_WHY_FRAME (an owner that answers what was not asked). */
static int rt_rdone(rt_conn *c, const rt_frame *f) {
    uint64_t k, posted = __atomic_load_n(&c->rd_posted, __ATOMIC_ACQUIRE);
    uint32_t why = f->region;
    rt_rcell *cell;
    if (f->length || why > RM_RWHY_ACCESS) return -RT_WHY_FRAME;
    pthread_mutex_lock(&c->rf_mu);          /* the cells may be abandoned meanwhile */
    k = __atomic_load_n(&c->rd_done, __ATOMIC_ACQUIRE);
    while (why && k < posted && (c->rd_kind[k % RT_RD_MAX] == RT_RK_RREAD ||
                                 c->rd_kind[k % RT_RD_MAX] == RT_RK_DROP))
        c->rd_cell[k++ % RT_RD_MAX]->read_err = 1;
    if (k >= posted || c->rd_kind[k % RT_RD_MAX] != RT_RK_DONE) {
        pthread_mutex_unlock(&c->rf_mu);
        return -RT_WHY_FRAME;
    }
    cell = c->rd_cell[k % RT_RD_MAX];
    cell->why = why;
    cell->index = f->offset > 0xFFFFFFFFu ? 0xFFFFFFFFu : (uint32_t)f->offset;
    __atomic_store_n(&c->rd_done, k + 1, __ATOMIC_RELEASE);
    __atomic_store_n(&cell->done, 1, __ATOMIC_SEQ_CST);     /* the cell is the poster's now */
    pthread_mutex_unlock(&c->rf_mu);
    rt_rcell_wake(c);
    return 0;
}

/* The poster whose deadline passed: unless its chain ended meanwhile (0: the cell is
 * done, use it), its slots not yet answered let go of its targets (RT_RK_DROP: an
 * answer that comes later is received and dropped) and of its cell (rd_dead), and
 * RT_LATE. When it returns, nothing of this process writes the chain's READ targets
 * nor its cell any more (an answer being received let go between two pieces). */
static int rt_rcell_abandon(rt_conn *c, rt_rcell *cell) {
    uint64_t s;
    uint32_t slot;
    rt_rf_lock(c);
    if (__atomic_load_n(&cell->done, __ATOMIC_ACQUIRE)) {
        pthread_mutex_unlock(&c->rf_mu);
        return 0;
    }
    /* slots before rd_done were answered (and may be another chain's by now) */
    s = __atomic_load_n(&c->rd_done, __ATOMIC_ACQUIRE);
    if (s < cell->first) s = cell->first;
    for (; s < cell->first + cell->nslots; s++) {
        slot = (uint32_t)(s % RT_RD_MAX);
        if (c->rd_kind[slot] == RT_RK_RREAD) c->rd_kind[slot] = RT_RK_DROP;
        c->rd_cell[slot] = &c->rd_dead;
    }
    pthread_mutex_unlock(&c->rf_mu);
    return RT_LATE;
}

/* The poster: arrays for an n-operation chain (descriptors, local addresses, n + 2
 * iovecs): the connection's scratch, grown if it is short, when no other poster holds
 * it (*own = 0), else fresh ones for this chain alone (*own = 1). 0, or -1 (no
 * memory: nothing is held). */
static int rt_rscratch_take(rt_conn *c, uint32_t n, rt_rdesc **descs, uint64_t **local,
                            struct iovec **iov, int *own) {
    rt_rscratch *s = &c->rs;
    void *p;
    *own = __atomic_exchange_n(&s->busy, 1, __ATOMIC_ACQUIRE);
    if (*own) {                         /* another poster has it: this chain's own */
        *descs = malloc(n * sizeof(rt_rdesc));
        *local = malloc(n * sizeof(uint64_t));
        *iov = malloc((n + 2) * sizeof(struct iovec));
        if (*descs && *local && *iov) return 0;
        free(*descs);
        free(*local);
        free(*iov);
        return -1;
    }
    if (n > s->cap) {                   /* grown, never shrunk: no allocation after */
        uint32_t cap = n > 2 * s->cap ? n : 2 * s->cap;
        if (cap < 16) cap = 16;
        if (cap > RT_RCH_MAX) cap = RT_RCH_MAX;
        if ((p = realloc(s->descs, cap * sizeof(rt_rdesc)))) s->descs = p;
        if (p && (p = realloc(s->local, cap * sizeof(uint64_t)))) s->local = p;
        if (p && (p = realloc(s->iov, (cap + 2) * sizeof(struct iovec)))) s->iov = p;
        if (!p) {
            __atomic_store_n(&s->busy, 0, __ATOMIC_RELEASE);
            return -1;
        }
        s->cap = cap;
    }
    *descs = s->descs;
    *local = s->local;
    *iov = s->iov;
    return 0;
}

/* The poster is done with the arrays of rt_rscratch_take (the chain was sent, or
 * copied into the backlog). */
static void rt_rscratch_give(rt_conn *c, rt_rdesc *descs, uint64_t *local,
                             struct iovec *iov, int own) {
    if (!own) {
        __atomic_store_n(&c->rs.busy, 0, __ATOMIC_RELEASE);
        return;
    }
    free(descs);
    free(local);
    free(iov);
}

/* The connection goes: its scratch with it (no poster holds it any more). */
static void rt_rscratch_free(rt_conn *c) {
    free(c->rs.descs);
    free(c->rs.local);
    free(c->rs.iov);
    memset(&c->rs, 0, sizeof c->rs);
}

/* The poster: put the chain descs[0..n) (local[i]: a READ's target, a WRITE's source,
 * or an atomic's 16 bytes of operands, whose first 8 its answer replaces)
 * on the stream as one RCHAIN frame and one sendmsg (iov: room for n + 2), the slots of
 * its READs and of its end taken in the stream's order, once the ring has room for
 * them; `cell` is where its end will be told. rt_commit's code, or the state. */
static int rt_rchain_send(rt_conn *c, const rt_rdesc *descs, const uint64_t *local,
                          uint32_t n, struct iovec *iov, rt_rcell *cell, int64_t deadline,
                          int may_wait) {
    rt_frame hdr;
    uint32_t i, k = 2, nreads = 0, slot;
    uint64_t posted;
    int mode, held;
    memset(&hdr, 0, sizeof hdr);
    hdr.type = RT_RCHAIN;
    hdr.region = (uint16_t)n;
    hdr.length = n * (uint32_t)sizeof(rt_rdesc);
    iov[0].iov_base = &hdr;
    iov[0].iov_len = sizeof hdr;
    iov[1].iov_base = (void *)descs;
    iov[1].iov_len = n * sizeof(rt_rdesc);
    for (i = 0; i < n; i++) {               /* a READ's or an atomic's answer: a slot */
        if (descs[i].op != RT_OP_WRITE) nreads++;
        if (descs[i].op == RT_OP_READ) continue;
        iov[k].iov_base = (void *)(uintptr_t)local[i];
        iov[k++].iov_len = descs[i].op == RT_OP_WRITE ? descs[i].length : RT_ATOMIC_OPERANDS;
    }
    for (;;) {
        if (rt_state(c) != RT_UP) return rt_state(c);
        mode = rt_turn(c, deadline, may_wait, &held);       /* bl_mu held from here */
        if (mode < 0) return mode;
        posted = c->rd_posted;
        if (posted + nreads + 1 - __atomic_load_n(&c->rd_done, __ATOMIC_ACQUIRE) <= RT_RD_MAX)
            break;
        pthread_mutex_unlock(&c->bl_mu);        /* other chains' answers free the ring */
        if (held) pthread_mutex_unlock(&c->send_mu);
        if (deadline && rt_now() >= deadline) return RT_LATE;   /* nothing was sent */
        sched_yield();
    }
    cell->first = posted;
    cell->nslots = nreads + 1;
    for (i = 0; i <= n; i++) {
        if (i < n && descs[i].op == RT_OP_WRITE) continue;
        slot = posted++ % RT_RD_MAX;
        c->rd_addr[slot] = i < n ? local[i] : 0;
        c->rd_len[slot] = i < n ? descs[i].length : 0;
        c->rd_err[slot] = 0;
        c->rd_kind[slot] = i < n ? RT_RK_RREAD : RT_RK_DONE;
        c->rd_cell[slot] = cell;
    }
    __atomic_store_n(&c->rd_posted, posted, __ATOMIC_RELEASE);
    cell->queued = 1;
    return rt_commit(c, iov, (int)k, mode, held, deadline, may_wait);
}

/* The poster: wait for the end of its chain until `deadline` (rt_now() time; 0: none).
 * 0 once it came; RT_LATE once the deadline passed (rt_rcell_abandon: nothing writes
 * the chain's READ targets nor its cell after); else the state, once the connection
 * is down and the progress thread (which writes them) has returned. */
static int rt_rcell_wait(rt_conn *c, rt_rcell *cell, int64_t deadline) {
    struct timespec until;
    int64_t nap, now;
    int i, st = 0, late = 0;
    for (i = 0; i < 200; i++) {             /* an answer within a round trip: no sleep */
        if (__atomic_load_n(&cell->done, __ATOMIC_ACQUIRE)) return 0;
        sched_yield();
    }
    pthread_mutex_lock(&c->rd_mu);
    __atomic_add_fetch(&c->rd_sleepers, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        if (__atomic_load_n(&cell->done, __ATOMIC_SEQ_CST)) {
            st = 0;
            break;
        }
        st = rt_state(c);
        if (st != RT_UP && __atomic_load_n(&c->exited, __ATOMIC_ACQUIRE)) break;
        nap = 20000000;
        if (deadline) {
            now = rt_now();
            if (now >= deadline) {
                late = 1;
                break;
            }
            if (deadline - now < nap) nap = deadline - now;
        }
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += nap;
        if (until.tv_nsec >= 1000000000) { until.tv_sec++; until.tv_nsec -= 1000000000; }
        pthread_cond_timedwait(&c->rd_cv, &c->rd_mu, &until);
    }
    __atomic_sub_fetch(&c->rd_sleepers, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&c->rd_mu);
    return late ? rt_rcell_abandon(c, cell) : st;   /* rf_mu is taken before rd_mu */
}

/* Why this thread's last chain on c was refused, for the operation that covers
 * [addr, addr+len) under key and tag (remote.py asks right after the post): RM_RWHY_*,
 * 0 if not that one. */
typedef struct {
    const rt_conn *c;
    uint32_t why, key, tag, write;
    uint64_t addr, len;
} rt_refusal;
static __thread rt_refusal rt_last_refusal;

static void rt_refusal_set(const rt_conn *c, uint32_t why, uint32_t key, uint32_t tag,
                           int write, uint64_t addr, uint64_t len) {
    rt_refusal r = {c, why, key, tag, (uint32_t)write, addr, len};
    rt_last_refusal = r;
}

static uint32_t rt_refusal_get(const rt_conn *c, uint32_t key, uint32_t tag, int write,
                               uint64_t addr, uint64_t len) {
    const rt_refusal *r = &rt_last_refusal;
    if (r->c != c || r->key != key || r->tag != tag || r->write != (uint32_t)write ||
        r->addr < addr || r->len > len || r->addr - addr > len - r->len)
        return 0;
    return r->why;
}
#endif
