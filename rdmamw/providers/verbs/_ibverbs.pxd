# The part of libibverbs the verbs provider uses, from the project's own declarations
# (rdmamw/providers/verbs/rm_ibverbs.h: rdma-core's ABI, no <infiniband/verbs.h> at build time).
# libibverbs is dlopen()ed by rm_ibv_load; the ibv_* names call through its table.
# Field lists here are partial on purpose (Cython only needs the members it touches).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "rm_ibverbs.h" nogil:
    int rm_ibv_load(const char *lib, char *err, size_t errlen)
    bint rm_ibv_loaded()
    char rm_ibv_path[4096]

    cdef struct ibv_device:
        pass
    cdef struct ibv_context:
        pass
    cdef struct ibv_pd:
        pass
    cdef struct ibv_srq:
        pass
    cdef struct ibv_comp_channel:
        int fd
    cdef enum ibv_mw_type:
        IBV_MW_TYPE_1
        IBV_MW_TYPE_2
    cdef struct ibv_mw:
        uint32_t rkey
    cdef struct ibv_mr:
        void *addr
        size_t length
        uint32_t lkey
        uint32_t rkey
    cdef struct ibv_cq:
        pass
    cdef struct ibv_qp:
        uint32_t qp_num

    cdef struct ibv_device_attr:
        uint32_t vendor_id
        unsigned int device_cap_flags
        int max_qp
        int max_qp_wr
        int max_cq
        int max_mr
        int max_pd
        int max_sge
        int max_cqe
        uint8_t phys_port_cnt

    cdef struct ibv_port_attr:
        int state
        int max_mtu
        int active_mtu
        int gid_tbl_len
        uint16_t lid
        uint8_t link_layer

    union ibv_gid:
        uint8_t raw[16]

    cdef struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data

    cdef enum ibv_qp_type:
        IBV_QPT_RC

    cdef struct ibv_qp_init_attr:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        ibv_qp_cap cap
        ibv_qp_type qp_type
        int sq_sig_all

    cdef struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class

    cdef struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num

    cdef enum ibv_qp_state:
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_ERR

    cdef enum ibv_mtu:
        IBV_MTU_256
        IBV_MTU_1024
        IBV_MTU_4096

    cdef struct ibv_qp_attr:
        ibv_qp_state qp_state
        ibv_mtu path_mtu
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        ibv_ah_attr ah_attr
        uint16_t pkey_index
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry

    enum:
        IBV_QP_STATE
        IBV_QP_AV
        IBV_QP_PATH_MTU
        IBV_QP_DEST_QPN
        IBV_QP_RQ_PSN
        IBV_QP_SQ_PSN
        IBV_QP_ACCESS_FLAGS
        IBV_QP_PKEY_INDEX
        IBV_QP_PORT
        IBV_QP_MAX_QP_RD_ATOMIC
        IBV_QP_MAX_DEST_RD_ATOMIC
        IBV_QP_MIN_RNR_TIMER
        IBV_QP_TIMEOUT
        IBV_QP_RETRY_CNT
        IBV_QP_RNR_RETRY
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_WRITE
        IBV_ACCESS_REMOTE_READ
        IBV_ACCESS_REMOTE_ATOMIC
        IBV_ACCESS_MW_BIND
        IBV_DEVICE_MEM_WINDOW_TYPE_2B
        IBV_SEND_FENCE
        IBV_SEND_SIGNALED
        IBV_SEND_SOLICITED
        IBV_SEND_INLINE
        IBV_WC_SUCCESS
        IBV_WC_WR_FLUSH_ERR
        IBV_WC_REM_ACCESS_ERR
        IBV_PORT_ACTIVE
        IBV_LINK_LAYER_INFINIBAND
        IBV_LINK_LAYER_ETHERNET

    cdef enum ibv_wr_opcode:
        IBV_WR_RDMA_WRITE
        IBV_WR_RDMA_WRITE_WITH_IMM
        IBV_WR_SEND
        IBV_WR_RDMA_READ
        IBV_WR_ATOMIC_CMP_AND_SWP
        IBV_WR_ATOMIC_FETCH_AND_ADD
        IBV_WR_BIND_MW

    cdef struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    cdef struct _ibv_rdma:
        uint64_t remote_addr
        uint32_t rkey

    cdef struct _ibv_atomic:
        uint64_t remote_addr
        uint64_t compare_add
        uint64_t swap
        uint32_t rkey

    cdef union _ibv_wr_u:
        _ibv_rdma rdma
        _ibv_atomic atomic

    cdef struct ibv_mw_bind_info:
        ibv_mr *mr
        uint64_t addr
        uint64_t length
        unsigned int mw_access_flags

    cdef struct _ibv_bind_mw:
        ibv_mw *mw
        uint32_t rkey
        ibv_mw_bind_info bind_info

    cdef struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr *next
        ibv_sge *sg_list
        int num_sge
        ibv_wr_opcode opcode
        unsigned int send_flags
        uint32_t imm_data
        _ibv_wr_u wr
        _ibv_bind_mw bind_mw        # in an anonymous union (rm_ibverbs.h)

    cdef struct ibv_recv_wr:
        uint64_t wr_id
        ibv_recv_wr *next
        ibv_sge *sg_list
        int num_sge

    cdef struct ibv_wc:
        uint64_t wr_id
        int status
        int opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t qp_num
        unsigned int wc_flags

    cdef enum ibv_fork_status:
        IBV_FORK_DISABLED
        IBV_FORK_ENABLED
        IBV_FORK_UNNEEDED
    int ibv_fork_init()
    ibv_fork_status ibv_is_fork_initialized()
    ibv_device **ibv_get_device_list(int *num)
    void ibv_free_device_list(ibv_device **lst)
    const char *ibv_get_device_name(ibv_device *d)
    ibv_context *ibv_open_device(ibv_device *d)
    int ibv_close_device(ibv_context *c)
    int ibv_query_device(ibv_context *c, ibv_device_attr *attr)
    int ibv_query_port(ibv_context *c, uint8_t port, ibv_port_attr *attr)
    int ibv_query_gid(ibv_context *c, uint8_t port, int index, ibv_gid *gid)
    ibv_pd *ibv_alloc_pd(ibv_context *c)
    int ibv_dealloc_pd(ibv_pd *pd)
    ibv_mr *ibv_reg_mr(ibv_pd *pd, void *addr, size_t length, int access)
    int ibv_dereg_mr(ibv_mr *mr)
    ibv_mw *ibv_alloc_mw(ibv_pd *pd, ibv_mw_type t)
    int ibv_dealloc_mw(ibv_mw *mw)
    uint32_t ibv_inc_rkey(uint32_t rkey)
    ibv_comp_channel *ibv_create_comp_channel(ibv_context *c)
    int ibv_destroy_comp_channel(ibv_comp_channel *ch)
    ibv_cq *ibv_create_cq(ibv_context *c, int cqe, void *cq_context, ibv_comp_channel *ch,
                          int comp_vector)
    int ibv_destroy_cq(ibv_cq *cq)
    int ibv_req_notify_cq(ibv_cq *cq, int solicited_only)
    int ibv_get_cq_event(ibv_comp_channel *ch, ibv_cq **cq, void **ctx)
    void ibv_ack_cq_events(ibv_cq *cq, unsigned int nevents)
    ibv_qp *ibv_create_qp(ibv_pd *pd, ibv_qp_init_attr *attr)
    int ibv_destroy_qp(ibv_qp *qp)
    int ibv_modify_qp(ibv_qp *qp, ibv_qp_attr *attr, int mask)
    int ibv_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad)
    int ibv_post_recv(ibv_qp *qp, ibv_recv_wr *wr, ibv_recv_wr **bad)
    int ibv_poll_cq(ibv_cq *cq, int n, ibv_wc *wc)
    const char *ibv_wc_status_str(int status)
