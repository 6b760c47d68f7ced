/* rm_ibverbs.h - the part of libibverbs' ABI the verbs provider uses, declared here so
 * the extension builds without <infiniband/verbs.h> and never links libibverbs: the
 * library is dlopen()ed on first use (rm_ibv_load) and every exported function we call
 * is resolved into rm_ibv, a table of function pointers. ibv_post_send, ibv_post_recv,
 * ibv_poll_cq and ibv_req_notify_cq are static inline in verbs.h, calling through
 * context->ops: so are ours, so the data path costs what verbs.h's does.
 *
 * The structs are laid out exactly as rdma-core's ABI (stable since libibverbs 1.1;
 * the members we never touch keep their types so sizes and offsets match):
 * tests/providers/test_verbs_load.py (test_abi_declarations_match_rdma_core) compiles this header and the system's verbs.h, where that
 * exists, and compares every size, offset and constant used here. */
#ifndef RM_IBVERBS_H
#define RM_IBVERBS_H

#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

struct ibv_device;
struct ibv_pd;
struct ibv_srq;
struct ibv_ah;
struct ibv_mw;
struct ibv_qp;
struct ibv_cq;
struct ibv_wc;
struct ibv_send_wr;
struct ibv_recv_wr;

union ibv_gid {
    uint8_t raw[16];
    struct {
        uint64_t subnet_prefix;
        uint64_t interface_id;
    } global;
};

enum ibv_qp_type { IBV_QPT_RC = 2 };
enum ibv_qp_state { IBV_QPS_RESET = 0, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD,
                    IBV_QPS_SQE, IBV_QPS_ERR };
enum ibv_mtu { IBV_MTU_256 = 1, IBV_MTU_512, IBV_MTU_1024, IBV_MTU_2048, IBV_MTU_4096 };
enum ibv_wr_opcode { IBV_WR_RDMA_WRITE = 0, IBV_WR_RDMA_WRITE_WITH_IMM = 1, IBV_WR_SEND = 2,
                     IBV_WR_SEND_WITH_IMM = 3, IBV_WR_RDMA_READ = 4,
                     IBV_WR_ATOMIC_CMP_AND_SWP = 5, IBV_WR_ATOMIC_FETCH_AND_ADD = 6,
                     IBV_WR_LOCAL_INV = 7,
                     IBV_WR_BIND_MW = 8 };
enum ibv_mw_type { IBV_MW_TYPE_1 = 1, IBV_MW_TYPE_2 = 2 };
enum ibv_fork_status { IBV_FORK_DISABLED = 0, IBV_FORK_ENABLED = 1, IBV_FORK_UNNEEDED = 2 };
enum {
    IBV_QP_STATE = 1 << 0, IBV_QP_ACCESS_FLAGS = 1 << 3, IBV_QP_PKEY_INDEX = 1 << 4,
    IBV_QP_PORT = 1 << 5, IBV_QP_AV = 1 << 7, IBV_QP_PATH_MTU = 1 << 8,
    IBV_QP_TIMEOUT = 1 << 9, IBV_QP_RETRY_CNT = 1 << 10, IBV_QP_RNR_RETRY = 1 << 11,
    IBV_QP_RQ_PSN = 1 << 12, IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
    IBV_QP_MIN_RNR_TIMER = 1 << 15, IBV_QP_SQ_PSN = 1 << 16,
    IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17, IBV_QP_DEST_QPN = 1 << 20,
};
enum { IBV_ACCESS_LOCAL_WRITE = 1, IBV_ACCESS_REMOTE_WRITE = 2, IBV_ACCESS_REMOTE_READ = 4,
       IBV_ACCESS_REMOTE_ATOMIC = 8, IBV_ACCESS_MW_BIND = 16 };
enum { IBV_DEVICE_MEM_WINDOW_TYPE_2B = 1 << 24 };
enum { IBV_SEND_FENCE = 1, IBV_SEND_SIGNALED = 2, IBV_SEND_SOLICITED = 4,
       IBV_SEND_INLINE = 8 };
enum { IBV_WC_SUCCESS = 0, IBV_WC_WR_FLUSH_ERR = 5, IBV_WC_REM_ACCESS_ERR = 10 };
enum { IBV_PORT_ACTIVE = 4 };
enum { IBV_LINK_LAYER_INFINIBAND = 1, IBV_LINK_LAYER_ETHERNET = 2 };

struct ibv_device_attr {
    char fw_ver[64];
    uint64_t node_guid, sys_image_guid, max_mr_size, page_size_cap;
    uint32_t vendor_id, vendor_part_id, hw_ver;
    int max_qp, max_qp_wr;
    unsigned int device_cap_flags;
    int max_sge, max_sge_rd, max_cq, max_cqe, max_mr, max_pd, max_qp_rd_atom,
        max_ee_rd_atom, max_res_rd_atom, max_qp_init_rd_atom, max_ee_init_rd_atom;
    int atomic_cap;                     /* enum ibv_atomic_cap */
    int max_ee, max_rdd, max_mw, max_raw_ipv6_qp, max_raw_ethy_qp, max_mcast_grp,
        max_mcast_qp_attach, max_total_mcast_qp_attach, max_ah, max_fmr, max_map_per_fmr,
        max_srq, max_srq_wr, max_srq_sge;
    uint16_t max_pkeys;
    uint8_t local_ca_ack_delay, phys_port_cnt;
};

/* the full struct; the exported ibv_query_port fills its older (shorter) prefix */
struct ibv_port_attr {
    int state, max_mtu, active_mtu;     /* enum ibv_port_state, enum ibv_mtu x2 */
    int gid_tbl_len;
    uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
    uint16_t pkey_tbl_len, lid, sm_lid;
    uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width,
        active_speed, phys_state, link_layer, flags;
    uint16_t port_cap_flags2;
};

struct ibv_context_ops {
    void *compat_a[7];                  /* _compat_query_device .. _compat_dereg_mr */
    void *alloc_mw, *bind_mw, *dealloc_mw, *compat_create_cq;
    int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
    void *compat_b[7];                  /* _compat_cq_event .. _compat_destroy_srq */
    void *post_srq_recv;
    void *compat_c[4];                  /* _compat_create_qp .. _compat_destroy_qp */
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);
    void *compat_d[5];                  /* _compat_create_ah .. _compat_async_event */
};

struct ibv_context {
    struct ibv_device *device;
    struct ibv_context_ops ops;
    int cmd_fd, async_fd, num_comp_vectors;
    pthread_mutex_t mutex;
    void *abi_compat;
};

struct ibv_comp_channel {
    struct ibv_context *context;
    int fd;
    int refcnt;
};

struct ibv_cq {
    struct ibv_context *context;
    struct ibv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed, async_events_completed;
};

struct ibv_qp {
    struct ibv_context *context;
    void *qp_context;
    struct ibv_pd *pd;
    struct ibv_cq *send_cq, *recv_cq;
    struct ibv_srq *srq;
    uint32_t handle, qp_num;
    int state, qp_type;                 /* enum ibv_qp_state, enum ibv_qp_type */
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};

struct ibv_pd {
    struct ibv_context *context;
    uint32_t handle;
};

struct ibv_mw {
    struct ibv_context *context;
    struct ibv_pd *pd;
    uint32_t rkey, handle;
    enum ibv_mw_type type;
};

struct ibv_mr {
    struct ibv_context *context;
    struct ibv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle, lkey, rkey;
};

struct ibv_qp_cap {
    uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data;
};

struct ibv_qp_init_attr {
    void *qp_context;
    struct ibv_cq *send_cq, *recv_cq;
    struct ibv_srq *srq;
    struct ibv_qp_cap cap;
    enum ibv_qp_type qp_type;
    int sq_sig_all;
};

struct ibv_global_route {
    union ibv_gid dgid;
    uint32_t flow_label;
    uint8_t sgid_index, hop_limit, traffic_class;
};

struct ibv_ah_attr {
    struct ibv_global_route grh;
    uint16_t dlid;
    uint8_t sl, src_path_bits, static_rate, is_global, port_num;
};

struct ibv_qp_attr {
    enum ibv_qp_state qp_state, cur_qp_state;
    enum ibv_mtu path_mtu;
    int path_mig_state;                 /* enum ibv_mig_state */
    uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
    unsigned int qp_access_flags;
    struct ibv_qp_cap cap;
    struct ibv_ah_attr ah_attr, alt_ah_attr;
    uint16_t pkey_index, alt_pkey_index;
    uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic,
        min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
    uint32_t rate_limit;
};

struct ibv_mw_bind_info {
    struct ibv_mr *mr;
    uint64_t addr, length;
    unsigned int mw_access_flags;
};

struct ibv_sge {
    uint64_t addr;
    uint32_t length, lkey;
};

struct ibv_send_wr {
    uint64_t wr_id;
    struct ibv_send_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
    enum ibv_wr_opcode opcode;
    unsigned int send_flags;
    uint32_t imm_data;                  /* network order; or invalidate_rkey */
    union {
        struct { uint64_t remote_addr; uint32_t rkey; } rdma;
        struct { uint64_t remote_addr, compare_add, swap; uint32_t rkey; } atomic;
        struct { struct ibv_ah *ah; uint32_t remote_qpn, remote_qkey; } ud;
    } wr;
    union { struct { uint32_t remote_srqn; } xrc; } qp_type;
    union {
        struct {
            struct ibv_mw *mw;
            uint32_t rkey;
            struct ibv_mw_bind_info bind_info;
        } bind_mw;
        struct { void *hdr; uint16_t hdr_sz, mss; } tso;
    };                                  /* anonymous, as in verbs.h */
};

struct ibv_recv_wr {
    uint64_t wr_id;
    struct ibv_recv_wr *next;
    struct ibv_sge *sg_list;
    int num_sge;
};

struct ibv_wc {
    uint64_t wr_id;
    int status, opcode;                 /* enum ibv_wc_status, enum ibv_wc_opcode */
    uint32_t vendor_err, byte_len;
    uint32_t imm_data;                  /* network order; or invalidated_rkey */
    uint32_t qp_num, src_qp;
    unsigned int wc_flags;
    uint16_t pkey_index, slid;
    uint8_t sl, dlid_path_bits;
};

/* ---- the exported functions, resolved at run time -------------------------------- */

/* X(return type, name, parameters, symbol version or NULL for the default, required) */
#define RM_IBV_FUNCS(X) \
    X(struct ibv_device **, get_device_list, (int *num), "IBVERBS_1.1", 1) \
    X(void, free_device_list, (struct ibv_device **list), "IBVERBS_1.1", 1) \
    X(const char *, get_device_name, (struct ibv_device *dev), "IBVERBS_1.1", 1) \
    X(struct ibv_context *, open_device, (struct ibv_device *dev), "IBVERBS_1.1", 1) \
    X(int, close_device, (struct ibv_context *c), "IBVERBS_1.1", 1) \
    X(int, query_device, (struct ibv_context *c, struct ibv_device_attr *a), "IBVERBS_1.1", 1) \
    X(int, query_port, (struct ibv_context *c, uint8_t port, struct ibv_port_attr *a), \
      "IBVERBS_1.1", 1) \
    X(int, query_gid, (struct ibv_context *c, uint8_t port, int index, union ibv_gid *gid), \
      "IBVERBS_1.1", 1) \
    X(struct ibv_pd *, alloc_pd, (struct ibv_context *c), "IBVERBS_1.1", 1) \
    X(int, dealloc_pd, (struct ibv_pd *pd), "IBVERBS_1.1", 1) \
    X(struct ibv_mr *, reg_mr, (struct ibv_pd *pd, void *addr, size_t length, int access), \
      "IBVERBS_1.1", 1) \
    X(int, dereg_mr, (struct ibv_mr *mr), "IBVERBS_1.1", 1) \
    X(struct ibv_comp_channel *, create_comp_channel, (struct ibv_context *c), \
      "IBVERBS_1.0", 1) \
    X(int, destroy_comp_channel, (struct ibv_comp_channel *ch), "IBVERBS_1.0", 1) \
    X(struct ibv_cq *, create_cq, (struct ibv_context *c, int cqe, void *cq_context, \
                                   struct ibv_comp_channel *ch, int comp_vector), \
      "IBVERBS_1.1", 1) \
    X(int, destroy_cq, (struct ibv_cq *cq), "IBVERBS_1.1", 1) \
    X(int, get_cq_event, (struct ibv_comp_channel *ch, struct ibv_cq **cq, void **ctx), \
      "IBVERBS_1.1", 1) \
    X(void, ack_cq_events, (struct ibv_cq *cq, unsigned int nevents), "IBVERBS_1.1", 1) \
    X(struct ibv_qp *, create_qp, (struct ibv_pd *pd, struct ibv_qp_init_attr *a), \
      "IBVERBS_1.1", 1) \
    X(int, destroy_qp, (struct ibv_qp *qp), "IBVERBS_1.1", 1) \
    X(int, modify_qp, (struct ibv_qp *qp, struct ibv_qp_attr *a, int mask), "IBVERBS_1.1", 1) \
    X(const char *, wc_status_str, (int status), NULL, 1) \
    X(int, fork_init, (void), NULL, 1) \
    X(enum ibv_fork_status, is_fork_initialized, (void), NULL, 0) /* rdma-core >= 35 */

#define RM_IBV_PTR(ret, name, params, ver, req) ret (*name) params;
struct rm_ibv_table { RM_IBV_FUNCS(RM_IBV_PTR) };
#undef RM_IBV_PTR

static struct rm_ibv_table rm_ibv;
static void *rm_ibv_handle;
static char rm_ibv_path[4096];

/* the symbol at the version libibverbs exports it as default (dlsym alone may give an
 * old compat one), or the default when ver is NULL */
static void *rm_ibv_sym(void *h, const char *name, const char *ver) {
    return ver ? dlvsym(h, name, ver) : dlsym(h, name);
}

/* Open `lib` (e.g. "libibverbs.so.1") and resolve the table: 0; -1 when the library
 * cannot be opened (`err`: dlerror), -2 when symbols are missing (`err`: their names,
 * rm_ibv_path: the library's path). The table is set only when all are there. */
static int rm_ibv_load(const char *lib, char *err, size_t errlen) {
    struct rm_ibv_table t;
    struct link_map *lm = NULL;
    void *h, *p;
    size_t used = 0;
    if (rm_ibv_handle)
        return 0;
    memset(&t, 0, sizeof t);
    err[0] = 0;
    dlerror();
    h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(err, errlen, "%s", e ? e : lib);
        return -1;
    }
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0])
        snprintf(rm_ibv_path, sizeof rm_ibv_path, "%s", lm->l_name);
    else
        snprintf(rm_ibv_path, sizeof rm_ibv_path, "%s", lib);
#define RM_IBV_RESOLVE(ret, name, params, ver, req) \
    p = rm_ibv_sym(h, "ibv_" #name, ver); \
    if (p) memcpy(&t.name, &p, sizeof p); \
    else if (req && used < errlen) \
        used += snprintf(err + used, errlen - used, "%sibv_%s%s%s", used ? ", " : "", \
                         #name, (ver) ? "@" : "", (ver) ? (const char *)(ver) : "");
    RM_IBV_FUNCS(RM_IBV_RESOLVE)
#undef RM_IBV_RESOLVE
    if (err[0]) {
        dlclose(h);
        return -2;
    }
    rm_ibv = t;
    rm_ibv_handle = h;
    return 0;
}

static inline int rm_ibv_loaded(void) { return rm_ibv_handle != NULL; }

/* ---- the verbs API by its usual names ------------------------------------------- */

#define ibv_get_device_list rm_ibv.get_device_list
#define ibv_free_device_list rm_ibv.free_device_list
#define ibv_get_device_name rm_ibv.get_device_name
#define ibv_open_device rm_ibv.open_device
#define ibv_close_device rm_ibv.close_device
#define ibv_query_device rm_ibv.query_device
#define ibv_query_port rm_ibv.query_port
#define ibv_query_gid rm_ibv.query_gid
#define ibv_alloc_pd rm_ibv.alloc_pd
#define ibv_dealloc_pd rm_ibv.dealloc_pd
#define ibv_reg_mr rm_ibv.reg_mr
#define ibv_dereg_mr rm_ibv.dereg_mr
#define ibv_create_comp_channel rm_ibv.create_comp_channel
#define ibv_destroy_comp_channel rm_ibv.destroy_comp_channel
#define ibv_create_cq rm_ibv.create_cq
#define ibv_destroy_cq rm_ibv.destroy_cq
#define ibv_get_cq_event rm_ibv.get_cq_event
#define ibv_ack_cq_events rm_ibv.ack_cq_events
#define ibv_create_qp rm_ibv.create_qp
#define ibv_destroy_qp rm_ibv.destroy_qp
#define ibv_modify_qp rm_ibv.modify_qp
#define ibv_wc_status_str rm_ibv.wc_status_str
#define ibv_fork_init rm_ibv.fork_init

/* rdma-core < 35 has no ibv_is_fork_initialized: it never skips ibv_fork_init */
static inline enum ibv_fork_status ibv_is_fork_initialized(void) {
    return rm_ibv.is_fork_initialized ? rm_ibv.is_fork_initialized() : IBV_FORK_DISABLED;
}

static inline int ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr,
                                struct ibv_send_wr **bad) {
    return qp->context->ops.post_send(qp, wr, bad);
}

/* Memory windows: static inline in verbs.h too, through context->ops. */
static inline struct ibv_mw *ibv_alloc_mw(struct ibv_pd *pd, enum ibv_mw_type type) {
    struct ibv_mw *(*f)(struct ibv_pd *, enum ibv_mw_type) =
        (struct ibv_mw *(*)(struct ibv_pd *, enum ibv_mw_type))pd->context->ops.alloc_mw;
    if (!f) {
        errno = EOPNOTSUPP;
        return NULL;
    }
    return f(pd, type);
}

static inline int ibv_dealloc_mw(struct ibv_mw *mw) {
    return ((int (*)(struct ibv_mw *))mw->context->ops.dealloc_mw)(mw);
}

static inline uint32_t ibv_inc_rkey(uint32_t rkey) {
    return (rkey & ~(uint32_t)0xff) | ((rkey + 1) & 0xff);
}

static inline int ibv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr,
                                struct ibv_recv_wr **bad) {
    return qp->context->ops.post_recv(qp, wr, bad);
}

static inline int ibv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
    return cq->context->ops.poll_cq(cq, n, wc);
}

static inline int ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only) {
    return cq->context->ops.req_notify_cq(cq, solicited_only);
}

#endif
