//go:build cgo

package rdma

/*
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "mc_verbs.h"

// rdma-core's header, where libibverbs-dev installed it, to compare
// mc_verbs.h with. Only this file's translation unit sees it.
#if defined(__has_include)
#if __has_include(<infiniband/verbs.h>)
#include <infiniband/verbs.h>
#define MC_HAVE_REAL 1
#endif
#endif

// mc_layout_row is one compared quantity: a size, an offset, an alignment
// or a constant, as mc_verbs.h has it and as verbs.h has it (-1 without
// verbs.h).
struct mc_layout_row {
	const char *what;
	long mirror;
	long real;
};

// MC_SIZE, MC_ALIGN and MC_OFF compare a mirrored struct m with the real
// struct r, MC_CONST a mirrored constant with the real one.
#ifdef MC_HAVE_REAL
#define MC_SIZE(m, r) {"sizeof(" #r ")", (long)sizeof(m), (long)sizeof(r)}
#define MC_ALIGN(m, r) {"alignof(" #r ")", (long)_Alignof(m), (long)_Alignof(r)}
#define MC_OFF(m, r, f) {"offsetof(" #r ", " #f ")", (long)offsetof(m, f), (long)offsetof(r, f)}
#define MC_CONST(m, r) {#r, (long)(m), (long)(r)}
#define MC_REAL(x) ((long)(x))
#else
#define MC_SIZE(m, r) {"sizeof(" #r ")", (long)sizeof(m), -1L}
#define MC_ALIGN(m, r) {"alignof(" #r ")", (long)_Alignof(m), -1L}
#define MC_OFF(m, r, f) {"offsetof(" #r ", " #f ")", (long)offsetof(m, f), -1L}
#define MC_CONST(m, r) {#r, (long)(m), -1L}
#define MC_REAL(x) (-1L)
#endif

#define MC_STRUCT(n) MC_SIZE(struct mc_##n, struct n), MC_ALIGN(struct mc_##n, struct n)
#define MC_FIELD(n, f) MC_OFF(struct mc_##n, struct n, f)

static const struct mc_layout_row mc_layout_rows[] = {
	MC_SIZE(union mc_ibv_gid, union ibv_gid),
	MC_ALIGN(union mc_ibv_gid, union ibv_gid),
	MC_OFF(union mc_ibv_gid, union ibv_gid, raw),
	MC_OFF(union mc_ibv_gid, union ibv_gid, global.subnet_prefix),
	MC_OFF(union mc_ibv_gid, union ibv_gid, global.interface_id),

	MC_SIZE(struct mc_ibv_device_ops, struct _ibv_device_ops),
	MC_OFF(struct mc_ibv_device_ops, struct _ibv_device_ops, _dummy1),
	MC_OFF(struct mc_ibv_device_ops, struct _ibv_device_ops, _dummy2),

	MC_STRUCT(ibv_device),
	MC_FIELD(ibv_device, _ops),
	MC_FIELD(ibv_device, node_type),
	MC_FIELD(ibv_device, transport_type),
	MC_FIELD(ibv_device, name),
	MC_FIELD(ibv_device, dev_name),
	MC_FIELD(ibv_device, dev_path),
	MC_FIELD(ibv_device, ibdev_path),

	// The ops table is mirrored up to post_send, so its mirror is as
	// long as the real table's prefix that ends there.
	{"sizeof(struct ibv_context_ops) up to post_send", (long)sizeof(struct mc_ibv_context_ops),
	 MC_REAL(offsetof(struct ibv_context_ops, post_send) + sizeof(void *))},
	MC_FIELD(ibv_context_ops, _compat_query_device),
	MC_FIELD(ibv_context_ops, _compat_query_port),
	MC_FIELD(ibv_context_ops, _compat_alloc_pd),
	MC_FIELD(ibv_context_ops, _compat_dealloc_pd),
	MC_FIELD(ibv_context_ops, _compat_reg_mr),
	MC_FIELD(ibv_context_ops, _compat_rereg_mr),
	MC_FIELD(ibv_context_ops, _compat_dereg_mr),
	MC_FIELD(ibv_context_ops, alloc_mw),
	MC_FIELD(ibv_context_ops, bind_mw),
	MC_FIELD(ibv_context_ops, dealloc_mw),
	MC_FIELD(ibv_context_ops, _compat_create_cq),
	MC_FIELD(ibv_context_ops, poll_cq),
	MC_FIELD(ibv_context_ops, req_notify_cq),
	MC_FIELD(ibv_context_ops, _compat_cq_event),
	MC_FIELD(ibv_context_ops, _compat_resize_cq),
	MC_FIELD(ibv_context_ops, _compat_destroy_cq),
	MC_FIELD(ibv_context_ops, _compat_create_srq),
	MC_FIELD(ibv_context_ops, _compat_modify_srq),
	MC_FIELD(ibv_context_ops, _compat_query_srq),
	MC_FIELD(ibv_context_ops, _compat_destroy_srq),
	MC_FIELD(ibv_context_ops, post_srq_recv),
	MC_FIELD(ibv_context_ops, _compat_create_qp),
	MC_FIELD(ibv_context_ops, _compat_query_qp),
	MC_FIELD(ibv_context_ops, _compat_modify_qp),
	MC_FIELD(ibv_context_ops, _compat_destroy_qp),
	MC_FIELD(ibv_context_ops, post_send),

	// The context is mirrored up to its ops table: no size to compare.
	MC_ALIGN(struct mc_ibv_context, struct ibv_context),
	MC_FIELD(ibv_context, device),
	MC_FIELD(ibv_context, ops),
	MC_FIELD(ibv_context, ops.poll_cq),
	MC_FIELD(ibv_context, ops.post_send),

	MC_STRUCT(ibv_device_attr),
	MC_FIELD(ibv_device_attr, fw_ver),
	MC_FIELD(ibv_device_attr, node_guid),
	MC_FIELD(ibv_device_attr, sys_image_guid),
	MC_FIELD(ibv_device_attr, max_mr_size),
	MC_FIELD(ibv_device_attr, page_size_cap),
	MC_FIELD(ibv_device_attr, vendor_id),
	MC_FIELD(ibv_device_attr, vendor_part_id),
	MC_FIELD(ibv_device_attr, hw_ver),
	MC_FIELD(ibv_device_attr, max_qp),
	MC_FIELD(ibv_device_attr, max_qp_wr),
	MC_FIELD(ibv_device_attr, device_cap_flags),
	MC_FIELD(ibv_device_attr, max_sge),
	MC_FIELD(ibv_device_attr, max_sge_rd),
	MC_FIELD(ibv_device_attr, max_cq),
	MC_FIELD(ibv_device_attr, max_cqe),
	MC_FIELD(ibv_device_attr, max_mr),
	MC_FIELD(ibv_device_attr, max_pd),
	MC_FIELD(ibv_device_attr, max_qp_rd_atom),
	MC_FIELD(ibv_device_attr, max_ee_rd_atom),
	MC_FIELD(ibv_device_attr, max_res_rd_atom),
	MC_FIELD(ibv_device_attr, max_qp_init_rd_atom),
	MC_FIELD(ibv_device_attr, max_ee_init_rd_atom),
	MC_FIELD(ibv_device_attr, atomic_cap),
	MC_FIELD(ibv_device_attr, max_ee),
	MC_FIELD(ibv_device_attr, max_rdd),
	MC_FIELD(ibv_device_attr, max_mw),
	MC_FIELD(ibv_device_attr, max_raw_ipv6_qp),
	MC_FIELD(ibv_device_attr, max_raw_ethy_qp),
	MC_FIELD(ibv_device_attr, max_mcast_grp),
	MC_FIELD(ibv_device_attr, max_mcast_qp_attach),
	MC_FIELD(ibv_device_attr, max_total_mcast_qp_attach),
	MC_FIELD(ibv_device_attr, max_ah),
	MC_FIELD(ibv_device_attr, max_fmr),
	MC_FIELD(ibv_device_attr, max_map_per_fmr),
	MC_FIELD(ibv_device_attr, max_srq),
	MC_FIELD(ibv_device_attr, max_srq_wr),
	MC_FIELD(ibv_device_attr, max_srq_sge),
	MC_FIELD(ibv_device_attr, max_pkeys),
	MC_FIELD(ibv_device_attr, local_ca_ack_delay),
	MC_FIELD(ibv_device_attr, phys_port_cnt),

	// verbs.h does not define struct _compat_ibv_port_attr, the struct
	// the exported ibv_query_port fills; it is struct ibv_port_attr cut
	// after flags, which is what the rows below check.
	{"sizeof(struct _compat_ibv_port_attr) = sizeof(struct ibv_port_attr) cut after flags",
	 (long)sizeof(struct mc_ibv_port_attr),
	 MC_REAL((offsetof(struct ibv_port_attr, flags) + 1 + _Alignof(struct ibv_port_attr) - 1) /
		 _Alignof(struct ibv_port_attr) * _Alignof(struct ibv_port_attr))},
	MC_ALIGN(struct mc_ibv_port_attr, struct ibv_port_attr),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, state),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, max_mtu),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, active_mtu),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, gid_tbl_len),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, port_cap_flags),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, max_msg_sz),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, bad_pkey_cntr),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, qkey_viol_cntr),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, pkey_tbl_len),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, lid),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, sm_lid),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, lmc),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, max_vl_num),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, sm_sl),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, subnet_timeout),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, init_type_reply),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, active_width),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, active_speed),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, phys_state),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, link_layer),
	MC_OFF(struct mc_ibv_port_attr, struct ibv_port_attr, flags),

	MC_STRUCT(ibv_pd),
	MC_FIELD(ibv_pd, context),
	MC_FIELD(ibv_pd, handle),

	MC_STRUCT(ibv_mr),
	MC_FIELD(ibv_mr, context),
	MC_FIELD(ibv_mr, pd),
	MC_FIELD(ibv_mr, addr),
	MC_FIELD(ibv_mr, length),
	MC_FIELD(ibv_mr, handle),
	MC_FIELD(ibv_mr, lkey),
	MC_FIELD(ibv_mr, rkey),

	MC_STRUCT(ibv_cq),
	MC_FIELD(ibv_cq, context),
	MC_FIELD(ibv_cq, channel),
	MC_FIELD(ibv_cq, cq_context),
	MC_FIELD(ibv_cq, handle),
	MC_FIELD(ibv_cq, cqe),
	MC_FIELD(ibv_cq, mutex),
	MC_FIELD(ibv_cq, cond),
	MC_FIELD(ibv_cq, comp_events_completed),
	MC_FIELD(ibv_cq, async_events_completed),

	MC_STRUCT(ibv_qp),
	MC_FIELD(ibv_qp, context),
	MC_FIELD(ibv_qp, qp_context),
	MC_FIELD(ibv_qp, pd),
	MC_FIELD(ibv_qp, send_cq),
	MC_FIELD(ibv_qp, recv_cq),
	MC_FIELD(ibv_qp, srq),
	MC_FIELD(ibv_qp, handle),
	MC_FIELD(ibv_qp, qp_num),
	MC_FIELD(ibv_qp, state),
	MC_FIELD(ibv_qp, qp_type),
	MC_FIELD(ibv_qp, mutex),
	MC_FIELD(ibv_qp, cond),
	MC_FIELD(ibv_qp, events_completed),

	MC_STRUCT(ibv_sge),
	MC_FIELD(ibv_sge, addr),
	MC_FIELD(ibv_sge, length),
	MC_FIELD(ibv_sge, lkey),

	MC_STRUCT(ibv_mw_bind_info),
	MC_FIELD(ibv_mw_bind_info, mr),
	MC_FIELD(ibv_mw_bind_info, addr),
	MC_FIELD(ibv_mw_bind_info, length),
	MC_FIELD(ibv_mw_bind_info, mw_access_flags),

	MC_STRUCT(ibv_send_wr),
	MC_FIELD(ibv_send_wr, wr_id),
	MC_FIELD(ibv_send_wr, next),
	MC_FIELD(ibv_send_wr, sg_list),
	MC_FIELD(ibv_send_wr, num_sge),
	MC_FIELD(ibv_send_wr, opcode),
	MC_FIELD(ibv_send_wr, send_flags),
	MC_FIELD(ibv_send_wr, imm_data),
	MC_FIELD(ibv_send_wr, invalidate_rkey),
	MC_FIELD(ibv_send_wr, wr),
	MC_FIELD(ibv_send_wr, wr.rdma.remote_addr),
	MC_FIELD(ibv_send_wr, wr.rdma.rkey),
	MC_FIELD(ibv_send_wr, wr.atomic.remote_addr),
	MC_FIELD(ibv_send_wr, wr.atomic.compare_add),
	MC_FIELD(ibv_send_wr, wr.atomic.swap),
	MC_FIELD(ibv_send_wr, wr.atomic.rkey),
	MC_FIELD(ibv_send_wr, wr.ud.ah),
	MC_FIELD(ibv_send_wr, wr.ud.remote_qpn),
	MC_FIELD(ibv_send_wr, wr.ud.remote_qkey),
	MC_FIELD(ibv_send_wr, qp_type),
	MC_FIELD(ibv_send_wr, qp_type.xrc.remote_srqn),
	MC_FIELD(ibv_send_wr, bind_mw),
	MC_FIELD(ibv_send_wr, bind_mw.mw),
	MC_FIELD(ibv_send_wr, bind_mw.rkey),
	MC_FIELD(ibv_send_wr, bind_mw.bind_info),
	MC_FIELD(ibv_send_wr, tso.hdr),
	MC_FIELD(ibv_send_wr, tso.hdr_sz),
	MC_FIELD(ibv_send_wr, tso.mss),

	MC_STRUCT(ibv_wc),
	MC_FIELD(ibv_wc, wr_id),
	MC_FIELD(ibv_wc, status),
	MC_FIELD(ibv_wc, opcode),
	MC_FIELD(ibv_wc, vendor_err),
	MC_FIELD(ibv_wc, byte_len),
	MC_FIELD(ibv_wc, imm_data),
	MC_FIELD(ibv_wc, invalidated_rkey),
	MC_FIELD(ibv_wc, qp_num),
	MC_FIELD(ibv_wc, src_qp),
	MC_FIELD(ibv_wc, wc_flags),
	MC_FIELD(ibv_wc, pkey_index),
	MC_FIELD(ibv_wc, slid),
	MC_FIELD(ibv_wc, sl),
	MC_FIELD(ibv_wc, dlid_path_bits),

	MC_STRUCT(ibv_qp_cap),
	MC_FIELD(ibv_qp_cap, max_send_wr),
	MC_FIELD(ibv_qp_cap, max_recv_wr),
	MC_FIELD(ibv_qp_cap, max_send_sge),
	MC_FIELD(ibv_qp_cap, max_recv_sge),
	MC_FIELD(ibv_qp_cap, max_inline_data),

	MC_STRUCT(ibv_qp_init_attr),
	MC_FIELD(ibv_qp_init_attr, qp_context),
	MC_FIELD(ibv_qp_init_attr, send_cq),
	MC_FIELD(ibv_qp_init_attr, recv_cq),
	MC_FIELD(ibv_qp_init_attr, srq),
	MC_FIELD(ibv_qp_init_attr, cap),
	MC_FIELD(ibv_qp_init_attr, qp_type),
	MC_FIELD(ibv_qp_init_attr, sq_sig_all),

	MC_STRUCT(ibv_global_route),
	MC_FIELD(ibv_global_route, dgid),
	MC_FIELD(ibv_global_route, flow_label),
	MC_FIELD(ibv_global_route, sgid_index),
	MC_FIELD(ibv_global_route, hop_limit),
	MC_FIELD(ibv_global_route, traffic_class),

	MC_STRUCT(ibv_ah_attr),
	MC_FIELD(ibv_ah_attr, grh),
	MC_FIELD(ibv_ah_attr, dlid),
	MC_FIELD(ibv_ah_attr, sl),
	MC_FIELD(ibv_ah_attr, src_path_bits),
	MC_FIELD(ibv_ah_attr, static_rate),
	MC_FIELD(ibv_ah_attr, is_global),
	MC_FIELD(ibv_ah_attr, port_num),

	MC_STRUCT(ibv_qp_attr),
	MC_FIELD(ibv_qp_attr, qp_state),
	MC_FIELD(ibv_qp_attr, cur_qp_state),
	MC_FIELD(ibv_qp_attr, path_mtu),
	MC_FIELD(ibv_qp_attr, path_mig_state),
	MC_FIELD(ibv_qp_attr, qkey),
	MC_FIELD(ibv_qp_attr, rq_psn),
	MC_FIELD(ibv_qp_attr, sq_psn),
	MC_FIELD(ibv_qp_attr, dest_qp_num),
	MC_FIELD(ibv_qp_attr, qp_access_flags),
	MC_FIELD(ibv_qp_attr, cap),
	MC_FIELD(ibv_qp_attr, ah_attr),
	MC_FIELD(ibv_qp_attr, ah_attr.grh.dgid),
	MC_FIELD(ibv_qp_attr, ah_attr.grh.sgid_index),
	MC_FIELD(ibv_qp_attr, ah_attr.grh.hop_limit),
	MC_FIELD(ibv_qp_attr, ah_attr.dlid),
	MC_FIELD(ibv_qp_attr, ah_attr.is_global),
	MC_FIELD(ibv_qp_attr, ah_attr.port_num),
	MC_FIELD(ibv_qp_attr, alt_ah_attr),
	MC_FIELD(ibv_qp_attr, pkey_index),
	MC_FIELD(ibv_qp_attr, alt_pkey_index),
	MC_FIELD(ibv_qp_attr, en_sqd_async_notify),
	MC_FIELD(ibv_qp_attr, sq_draining),
	MC_FIELD(ibv_qp_attr, max_rd_atomic),
	MC_FIELD(ibv_qp_attr, max_dest_rd_atomic),
	MC_FIELD(ibv_qp_attr, min_rnr_timer),
	MC_FIELD(ibv_qp_attr, port_num),
	MC_FIELD(ibv_qp_attr, timeout),
	MC_FIELD(ibv_qp_attr, retry_cnt),
	MC_FIELD(ibv_qp_attr, rnr_retry),
	MC_FIELD(ibv_qp_attr, alt_port_num),
	MC_FIELD(ibv_qp_attr, alt_timeout),
	MC_FIELD(ibv_qp_attr, rate_limit),

	MC_CONST(MC_IBV_SYSFS_NAME_MAX, IBV_SYSFS_NAME_MAX),
	MC_CONST(MC_IBV_SYSFS_PATH_MAX, IBV_SYSFS_PATH_MAX),
	MC_CONST(MC_IBV_PORT_NOP, IBV_PORT_NOP),
	MC_CONST(MC_IBV_PORT_DOWN, IBV_PORT_DOWN),
	MC_CONST(MC_IBV_PORT_INIT, IBV_PORT_INIT),
	MC_CONST(MC_IBV_PORT_ARMED, IBV_PORT_ARMED),
	MC_CONST(MC_IBV_PORT_ACTIVE, IBV_PORT_ACTIVE),
	MC_CONST(MC_IBV_PORT_ACTIVE_DEFER, IBV_PORT_ACTIVE_DEFER),
	MC_CONST(MC_IBV_LINK_LAYER_UNSPECIFIED, IBV_LINK_LAYER_UNSPECIFIED),
	MC_CONST(MC_IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_INFINIBAND),
	MC_CONST(MC_IBV_LINK_LAYER_ETHERNET, IBV_LINK_LAYER_ETHERNET),
	MC_CONST(MC_IBV_MTU_256, IBV_MTU_256),
	MC_CONST(MC_IBV_MTU_512, IBV_MTU_512),
	MC_CONST(MC_IBV_MTU_1024, IBV_MTU_1024),
	MC_CONST(MC_IBV_MTU_2048, IBV_MTU_2048),
	MC_CONST(MC_IBV_MTU_4096, IBV_MTU_4096),
	MC_CONST(MC_IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_LOCAL_WRITE),
	MC_CONST(MC_IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_WRITE),
	MC_CONST(MC_IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_READ),
	MC_CONST(MC_IBV_QPT_RC, IBV_QPT_RC),
	MC_CONST(MC_IBV_QPS_RESET, IBV_QPS_RESET),
	MC_CONST(MC_IBV_QPS_INIT, IBV_QPS_INIT),
	MC_CONST(MC_IBV_QPS_RTR, IBV_QPS_RTR),
	MC_CONST(MC_IBV_QPS_RTS, IBV_QPS_RTS),
	MC_CONST(MC_IBV_QPS_SQD, IBV_QPS_SQD),
	MC_CONST(MC_IBV_QPS_SQE, IBV_QPS_SQE),
	MC_CONST(MC_IBV_QPS_ERR, IBV_QPS_ERR),
	MC_CONST(MC_IBV_QP_STATE, IBV_QP_STATE),
	MC_CONST(MC_IBV_QP_ACCESS_FLAGS, IBV_QP_ACCESS_FLAGS),
	MC_CONST(MC_IBV_QP_PKEY_INDEX, IBV_QP_PKEY_INDEX),
	MC_CONST(MC_IBV_QP_PORT, IBV_QP_PORT),
	MC_CONST(MC_IBV_QP_AV, IBV_QP_AV),
	MC_CONST(MC_IBV_QP_PATH_MTU, IBV_QP_PATH_MTU),
	MC_CONST(MC_IBV_QP_TIMEOUT, IBV_QP_TIMEOUT),
	MC_CONST(MC_IBV_QP_RETRY_CNT, IBV_QP_RETRY_CNT),
	MC_CONST(MC_IBV_QP_RNR_RETRY, IBV_QP_RNR_RETRY),
	MC_CONST(MC_IBV_QP_RQ_PSN, IBV_QP_RQ_PSN),
	MC_CONST(MC_IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC),
	MC_CONST(MC_IBV_QP_MIN_RNR_TIMER, IBV_QP_MIN_RNR_TIMER),
	MC_CONST(MC_IBV_QP_SQ_PSN, IBV_QP_SQ_PSN),
	MC_CONST(MC_IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_DEST_RD_ATOMIC),
	MC_CONST(MC_IBV_QP_DEST_QPN, IBV_QP_DEST_QPN),
	MC_CONST(MC_IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE),
	MC_CONST(MC_IBV_WR_RDMA_READ, IBV_WR_RDMA_READ),
	MC_CONST(MC_IBV_SEND_SIGNALED, IBV_SEND_SIGNALED),
	MC_CONST(MC_IBV_WC_SUCCESS, IBV_WC_SUCCESS),
	MC_CONST(MC_IBV_WC_RDMA_WRITE, IBV_WC_RDMA_WRITE),
	MC_CONST(MC_IBV_WC_RDMA_READ, IBV_WC_RDMA_READ),
};

// mc_real_consts are the real values of the verbs constants that rdma.go
// gives Go names to (-1 without verbs.h).
static const struct { const char *name; long value; } mc_real_consts[] = {
	{"IBV_ACCESS_LOCAL_WRITE", MC_REAL(IBV_ACCESS_LOCAL_WRITE)},
	{"IBV_ACCESS_REMOTE_WRITE", MC_REAL(IBV_ACCESS_REMOTE_WRITE)},
	{"IBV_ACCESS_REMOTE_READ", MC_REAL(IBV_ACCESS_REMOTE_READ)},
	{"IBV_QPS_RESET", MC_REAL(IBV_QPS_RESET)},
	{"IBV_QPS_INIT", MC_REAL(IBV_QPS_INIT)},
	{"IBV_QPS_RTR", MC_REAL(IBV_QPS_RTR)},
	{"IBV_QPS_RTS", MC_REAL(IBV_QPS_RTS)},
	{"IBV_QPS_SQD", MC_REAL(IBV_QPS_SQD)},
	{"IBV_QPS_SQE", MC_REAL(IBV_QPS_SQE)},
	{"IBV_QPS_ERR", MC_REAL(IBV_QPS_ERR)},
	{"IBV_WC_SUCCESS", MC_REAL(IBV_WC_SUCCESS)},
	{"IBV_WC_LOC_LEN_ERR", MC_REAL(IBV_WC_LOC_LEN_ERR)},
	{"IBV_WC_LOC_QP_OP_ERR", MC_REAL(IBV_WC_LOC_QP_OP_ERR)},
	{"IBV_WC_LOC_PROT_ERR", MC_REAL(IBV_WC_LOC_PROT_ERR)},
	{"IBV_WC_WR_FLUSH_ERR", MC_REAL(IBV_WC_WR_FLUSH_ERR)},
	{"IBV_WC_LOC_ACCESS_ERR", MC_REAL(IBV_WC_LOC_ACCESS_ERR)},
	{"IBV_WC_REM_INV_REQ_ERR", MC_REAL(IBV_WC_REM_INV_REQ_ERR)},
	{"IBV_WC_REM_ACCESS_ERR", MC_REAL(IBV_WC_REM_ACCESS_ERR)},
	{"IBV_WC_REM_OP_ERR", MC_REAL(IBV_WC_REM_OP_ERR)},
	{"IBV_WC_RETRY_EXC_ERR", MC_REAL(IBV_WC_RETRY_EXC_ERR)},
	{"IBV_WC_FATAL_ERR", MC_REAL(IBV_WC_FATAL_ERR)},
	{"IBV_WC_GENERAL_ERR", MC_REAL(IBV_WC_GENERAL_ERR)},
};

static int mc_have_real(void) {
#ifdef MC_HAVE_REAL
	return 1;
#else
	return 0;
#endif
}

static int mc_layout_count(void) { return (int)(sizeof mc_layout_rows / sizeof mc_layout_rows[0]); }

static const struct mc_layout_row *mc_layout_row(int i) { return &mc_layout_rows[i]; }

// mc_real_const looks a constant up by name; 0 when it is not listed.
static int mc_real_const(const char *name, long *value) {
	for (size_t i = 0; i < sizeof mc_real_consts / sizeof mc_real_consts[0]; i++) {
		if (strcmp(mc_real_consts[i].name, name) == 0) {
			*value = mc_real_consts[i].value;
			return 1;
		}
	}
	return 0;
}
*/
import "C"

import "unsafe"

// layoutRow is one quantity of mc_verbs.h (or rdma.go) compared with the
// same one in <infiniband/verbs.h>: a size, an offset, an alignment or a
// constant. real is -1 when the header is not installed.
type layoutRow struct {
	what         string
	mirror, real int64
}

// layoutHaveHeader reports whether <infiniband/verbs.h> was found when
// this package was built.
func layoutHaveHeader() bool { return C.mc_have_real() != 0 }

// layoutRows returns every size, alignment and offset of the structs in
// mc_verbs.h, and every constant it defines, next to the real header's;
// then the Go constants of rdma.go that carry verbs ABI values, next to
// the header's.
func layoutRows() []layoutRow {
	n := int(C.mc_layout_count())
	rows := make([]layoutRow, 0, n+len(goABIConsts))
	for i := range n {
		r := C.mc_layout_row(C.int(i))
		rows = append(rows, layoutRow{what: C.GoString(r.what), mirror: int64(r.mirror), real: int64(r.real)})
	}
	for _, c := range goABIConsts {
		name := C.CString(c.name)
		var v C.long
		found := C.mc_real_const(name, &v)
		C.free(unsafe.Pointer(name))
		real := int64(-2) // not in the C table: a bug in this file
		if found != 0 {
			real = int64(v)
		}
		rows = append(rows, layoutRow{what: c.goName + " = " + c.name, mirror: c.value, real: real})
	}
	return rows
}

// goABIConsts are rdma.go's constants whose values are the verbs ABI's.
var goABIConsts = []struct {
	goName, name string
	value        int64
}{
	{"AccessLocalWrite", "IBV_ACCESS_LOCAL_WRITE", int64(AccessLocalWrite)},
	{"AccessRemoteWrite", "IBV_ACCESS_REMOTE_WRITE", int64(AccessRemoteWrite)},
	{"AccessRemoteRead", "IBV_ACCESS_REMOTE_READ", int64(AccessRemoteRead)},
	{"QPReset", "IBV_QPS_RESET", int64(QPReset)},
	{"QPInit", "IBV_QPS_INIT", int64(QPInit)},
	{"QPRTR", "IBV_QPS_RTR", int64(QPRTR)},
	{"QPRTS", "IBV_QPS_RTS", int64(QPRTS)},
	{"QPSQD", "IBV_QPS_SQD", int64(QPSQD)},
	{"QPSQE", "IBV_QPS_SQE", int64(QPSQE)},
	{"QPError", "IBV_QPS_ERR", int64(QPError)},
	{"StatusSuccess", "IBV_WC_SUCCESS", int64(StatusSuccess)},
	{"StatusLocLenErr", "IBV_WC_LOC_LEN_ERR", int64(StatusLocLenErr)},
	{"StatusLocQPOpErr", "IBV_WC_LOC_QP_OP_ERR", int64(StatusLocQPOpErr)},
	{"StatusLocProtErr", "IBV_WC_LOC_PROT_ERR", int64(StatusLocProtErr)},
	{"StatusFlushErr", "IBV_WC_WR_FLUSH_ERR", int64(StatusFlushErr)},
	{"StatusLocAccessErr", "IBV_WC_LOC_ACCESS_ERR", int64(StatusLocAccessErr)},
	{"StatusRemInvReqErr", "IBV_WC_REM_INV_REQ_ERR", int64(StatusRemInvReqErr)},
	{"StatusRemAccessErr", "IBV_WC_REM_ACCESS_ERR", int64(StatusRemAccessErr)},
	{"StatusRemOpErr", "IBV_WC_REM_OP_ERR", int64(StatusRemOpErr)},
	{"StatusRetryExcErr", "IBV_WC_RETRY_EXC_ERR", int64(StatusRetryExcErr)},
	{"StatusFatalErr", "IBV_WC_FATAL_ERR", int64(StatusFatalErr)},
	{"StatusGeneralErr", "IBV_WC_GENERAL_ERR", int64(StatusGeneralErr)},
}
