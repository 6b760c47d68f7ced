/* The tcp provider's connection: its frame header, its state (rt_conn) and the few
 * helpers every thread uses; the send path is rm_tcp_send.h, the threads rm_tcp.h. */
#ifndef RM_TCP_CONN_H
#define RM_TCP_CONN_H
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
    RT_RCHAIN = 11,    /* a chain of region READs/WRITEs (rm_tcp_region.h)    */
    RT_RDONE = 12,     /* the end of the oldest outstanding chain: {why, index} */
    RT_NTYPES = 13
};
/* RT_RD_MAX: READ answers (and chain ends) a side may have outstanding; RT_RCH_MAX:
 * operations in one chain (its READs and its end fit in RT_RD_MAX) */
enum { RT_NREG = 4, RT_RD_MAX = 1024, RT_IOV_MAX = 1024, RT_RCH_MAX = RT_RD_MAX - 1 };
/* what a slot of the READ ring waits for: a READ's answer (the engine's, or a region
 * READ of a chain), a chain's end, or the answer of a region READ whose poster gave up
 * (its deadline passed: the answer is received and dropped, rm_tcp_region.h) */
enum { RT_RK_READ = 0, RT_RK_RREAD = 1, RT_RK_DONE = 2, RT_RK_DROP = 3 };
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

/* A queued request for the responder thread: a frame (XREAD_REQ; or, for a chain's
 * parts, RCHAIN = a region READ, READ_ERR = a READ to refuse, RDONE = its end), and for
 * a region READ its tag and its index in the chain. */
typedef struct {
    rt_frame f;
    uint32_t tag, index;
} rt_req;

/* The end of a chain, as its poster waits for it (on the poster's stack): written by
 * the progress thread, under rf_mu, until `done` or until the poster abandoned it
 * (rt_rcell_abandon), never after. */
typedef struct {
    uint32_t why, index;    /* RM_RWHY_* of the first refused operation, and which */
    int read_err;           /* a READ of the chain was answered READ_ERR */
    int queued;             /* its slots were taken: the poster must wait for `done` */
    int done;
    uint32_t nslots;        /* its slots in the READ ring: [first, first + nslots) */
    uint64_t first;
} rt_rcell;

/* The arrays a region chain is built in (TcpTransport._post_region): one set per
 * connection, grown to the longest chain, held by one poster at a time (busy). */
typedef struct {
    void *descs;            /* rt_rdesc[cap] (rm_tcp_region.h) */
    uint64_t *local;        /* [cap] */
    struct iovec *iov;      /* [cap + 2] */
    uint32_t cap;
    int busy;
} rt_rscratch;

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
    uint8_t rd_kind[RT_RD_MAX];         /* RT_RK_* */
    rt_rcell *rd_cell[RT_RD_MAX];       /* a region READ's or a chain end's poster */
    uint64_t rd_posted, rd_done;
    pthread_mutex_t rd_mu;              /* posters asleep until their chain ends */
    pthread_cond_t rd_cv;
    int rd_sleepers;
    /* region READ answers and chain ends are delivered holding rf_mu; a poster whose
     * deadline passed takes it (rf_wanted: a long answer lets go between pieces) and
     * turns its slots to RT_RK_DROP, its cell to rd_dead (rm_tcp_region.h) */
    pthread_mutex_t rf_mu;
    int rf_wanted;
    rt_rcell rd_dead;
    rt_rscratch rs;                     /* region chains' arrays */
    /* rendezvous: what this side exposed, and the XREAD_REQs the responder answers */
    rm_xtab *xtab;
    pthread_mutex_t xp_mu;      /* held by the responder while it sends from a range */
    pthread_mutex_t xw_mu;      /* held by the progress thread while it writes a range */
    pthread_mutex_t rq_mu;      /* the request queue; never held across I/O */
    pthread_cond_t rq_cv;
    rt_req rq[RT_RD_MAX];
    uint64_t rq_head, rq_tail;
    uint64_t rq_done;           /* requests the responder has answered */
    int rq_wait;                /* the progress thread waits for rq_done (a chain's order) */
    int xw_wanted;              /* threads waiting for xw_mu (unexpose): a region WRITE
                                   being received lets go between pieces */
    uint64_t frames_rx, bytes_rx, wakes_rx, heartbeats_tx;
    rt_frame bad;           /* the frame that broke the connection, if any */
    /* the send backlog (see the top): bl[bl_head, +bl_len); bl_mu decides the order */
    pthread_mutex_t bl_mu;
    char *bl;
    size_t bl_head, bl_len, bl_cap;
    uint64_t bl_bytes;      /* counter: bytes that went through the backlog */
    int torn;               /* a send stopped half-way through a frame (send_mu held) */
    int xp_wanted;          /* threads waiting for xp_mu (expose, unexpose): the
                               responder then stops waiting for a peer that reads nothing */
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
#endif
