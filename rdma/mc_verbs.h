// mc_verbs.h: the part of the libibverbs ABI that the rdma package touches,
// declared here so that building the package needs neither rdma-core's
// headers nor the library itself (verbs.go loads it with dlopen).
//
// Every struct below has the layout of the rdma-core struct of the same name
// without the "mc_" prefix, on x86_64 and arm64 (LP64, glibc). Fields are
// spelled as rdma-core spells them so that layout.go can compare each
// sizeof and offsetof with the installed <infiniband/verbs.h>; enum-typed
// fields are 32-bit integers here, which is what GCC and Clang make of those
// enums on both targets. Function pointers the package never calls are
// void * placeholders of the same size.
//
// A few structs are prefixes of the real ones (marked below). They are only
// ever reached through pointers the library returns, never allocated here,
// so their tails do not matter.
//
// Only types and constants live here; no functions.

#ifndef MC_VERBS_H
#define MC_VERBS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

// Constants, with the values of the verbs ABI (enum ibv_* in verbs.h).
enum {
	MC_IBV_SYSFS_NAME_MAX = 64,
	MC_IBV_SYSFS_PATH_MAX = 256,

	// enum ibv_port_state
	MC_IBV_PORT_NOP = 0,
	MC_IBV_PORT_DOWN = 1,
	MC_IBV_PORT_INIT = 2,
	MC_IBV_PORT_ARMED = 3,
	MC_IBV_PORT_ACTIVE = 4,
	MC_IBV_PORT_ACTIVE_DEFER = 5,

	// IBV_LINK_LAYER_*
	MC_IBV_LINK_LAYER_UNSPECIFIED = 0,
	MC_IBV_LINK_LAYER_INFINIBAND = 1,
	MC_IBV_LINK_LAYER_ETHERNET = 2,

	// enum ibv_mtu
	MC_IBV_MTU_256 = 1,
	MC_IBV_MTU_512 = 2,
	MC_IBV_MTU_1024 = 3,
	MC_IBV_MTU_2048 = 4,
	MC_IBV_MTU_4096 = 5,

	// enum ibv_access_flags
	MC_IBV_ACCESS_LOCAL_WRITE = 1,
	MC_IBV_ACCESS_REMOTE_WRITE = 1 << 1,
	MC_IBV_ACCESS_REMOTE_READ = 1 << 2,

	// enum ibv_qp_type
	MC_IBV_QPT_RC = 2,

	// enum ibv_qp_state
	MC_IBV_QPS_RESET = 0,
	MC_IBV_QPS_INIT = 1,
	MC_IBV_QPS_RTR = 2,
	MC_IBV_QPS_RTS = 3,
	MC_IBV_QPS_SQD = 4,
	MC_IBV_QPS_SQE = 5,
	MC_IBV_QPS_ERR = 6,

	// enum ibv_qp_attr_mask
	MC_IBV_QP_STATE = 1 << 0,
	MC_IBV_QP_ACCESS_FLAGS = 1 << 3,
	MC_IBV_QP_PKEY_INDEX = 1 << 4,
	MC_IBV_QP_PORT = 1 << 5,
	MC_IBV_QP_AV = 1 << 7,
	MC_IBV_QP_PATH_MTU = 1 << 8,
	MC_IBV_QP_TIMEOUT = 1 << 9,
	MC_IBV_QP_RETRY_CNT = 1 << 10,
	MC_IBV_QP_RNR_RETRY = 1 << 11,
	MC_IBV_QP_RQ_PSN = 1 << 12,
	MC_IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
	MC_IBV_QP_MIN_RNR_TIMER = 1 << 15,
	MC_IBV_QP_SQ_PSN = 1 << 16,
	MC_IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
	MC_IBV_QP_DEST_QPN = 1 << 20,

	// enum ibv_wr_opcode
	MC_IBV_WR_RDMA_WRITE = 0,
	MC_IBV_WR_RDMA_READ = 4,

	// enum ibv_send_flags
	MC_IBV_SEND_SIGNALED = 1 << 1,

	// enum ibv_wc_status (the first one; the rest are Go's Status values)
	MC_IBV_WC_SUCCESS = 0,

	// enum ibv_wc_opcode
	MC_IBV_WC_RDMA_WRITE = 1,
	MC_IBV_WC_RDMA_READ = 2,
};

struct mc_ibv_context;
struct mc_ibv_cq;
struct mc_ibv_qp;
struct mc_ibv_wc;
struct mc_ibv_send_wr;

// union ibv_gid
union mc_ibv_gid {
	uint8_t raw[16];
	struct {
		uint64_t subnet_prefix; // big-endian
		uint64_t interface_id;  // big-endian
	} global;
};

// struct _ibv_device_ops (obsolete, never called)
struct mc_ibv_device_ops {
	void *_dummy1;
	void *_dummy2;
};

// struct ibv_device
struct mc_ibv_device {
	struct mc_ibv_device_ops _ops;
	int32_t node_type;      // enum ibv_node_type
	int32_t transport_type; // enum ibv_transport_type
	char name[MC_IBV_SYSFS_NAME_MAX];
	char dev_name[MC_IBV_SYSFS_NAME_MAX];
	char dev_path[MC_IBV_SYSFS_PATH_MAX];
	char ibdev_path[MC_IBV_SYSFS_PATH_MAX];
};

// struct ibv_context_ops, a prefix: every slot up to and including
// post_send, which is where the inline ibv_post_send of verbs.h finds it
// (and poll_cq likewise for ibv_poll_cq). The real struct goes on with
// post_recv and a few compatibility slots.
struct mc_ibv_context_ops {
	void *_compat_query_device;
	void *_compat_query_port;
	void *_compat_alloc_pd;
	void *_compat_dealloc_pd;
	void *_compat_reg_mr;
	void *_compat_rereg_mr;
	void *_compat_dereg_mr;
	void *alloc_mw;
	void *bind_mw;
	void *dealloc_mw;
	void *_compat_create_cq;
	int (*poll_cq)(struct mc_ibv_cq *cq, int num_entries, struct mc_ibv_wc *wc);
	void *req_notify_cq;
	void *_compat_cq_event;
	void *_compat_resize_cq;
	void *_compat_destroy_cq;
	void *_compat_create_srq;
	void *_compat_modify_srq;
	void *_compat_query_srq;
	void *_compat_destroy_srq;
	void *post_srq_recv;
	void *_compat_create_qp;
	void *_compat_query_qp;
	void *_compat_modify_qp;
	void *_compat_destroy_qp;
	int (*post_send)(struct mc_ibv_qp *qp, struct mc_ibv_send_wr *wr,
			 struct mc_ibv_send_wr **bad_wr);
};

// struct ibv_context, a prefix: the device and the ops table. The real
// struct continues with cmd_fd, async_fd, num_comp_vectors, a mutex and
// abi_compat, and providers embed it in larger structs of their own.
struct mc_ibv_context {
	struct mc_ibv_device *device;
	struct mc_ibv_context_ops ops;
};

// struct ibv_device_attr, what ibv_query_device fills.
struct mc_ibv_device_attr {
	char fw_ver[64];
	uint64_t node_guid;      // big-endian
	uint64_t sys_image_guid; // big-endian
	uint64_t max_mr_size;
	uint64_t page_size_cap;
	uint32_t vendor_id;
	uint32_t vendor_part_id;
	uint32_t hw_ver;
	int32_t max_qp;
	int32_t max_qp_wr;
	uint32_t device_cap_flags;
	int32_t max_sge;
	int32_t max_sge_rd;
	int32_t max_cq;
	int32_t max_cqe;
	int32_t max_mr;
	int32_t max_pd;
	int32_t max_qp_rd_atom;
	int32_t max_ee_rd_atom;
	int32_t max_res_rd_atom;
	int32_t max_qp_init_rd_atom;
	int32_t max_ee_init_rd_atom;
	int32_t atomic_cap; // enum ibv_atomic_cap
	int32_t max_ee;
	int32_t max_rdd;
	int32_t max_mw;
	int32_t max_raw_ipv6_qp;
	int32_t max_raw_ethy_qp;
	int32_t max_mcast_grp;
	int32_t max_mcast_qp_attach;
	int32_t max_total_mcast_qp_attach;
	int32_t max_ah;
	int32_t max_fmr;
	int32_t max_map_per_fmr;
	int32_t max_srq;
	int32_t max_srq_wr;
	int32_t max_srq_sge;
	uint16_t max_pkeys;
	uint8_t local_ca_ack_delay;
	uint8_t phys_port_cnt;
};

// struct _compat_ibv_port_attr, what the exported ibv_query_port symbol
// fills: struct ibv_port_attr without its trailing port_cap_flags2 (verbs.h
// wraps that symbol in an inline function for the longer struct; a dlsym
// caller gets the short one).
struct mc_ibv_port_attr {
	uint32_t state;      // enum ibv_port_state
	uint32_t max_mtu;    // enum ibv_mtu
	uint32_t active_mtu; // enum ibv_mtu
	int32_t gid_tbl_len;
	uint32_t port_cap_flags;
	uint32_t max_msg_sz;
	uint32_t bad_pkey_cntr;
	uint32_t qkey_viol_cntr;
	uint16_t pkey_tbl_len;
	uint16_t lid;
	uint16_t sm_lid;
	uint8_t lmc;
	uint8_t max_vl_num;
	uint8_t sm_sl;
	uint8_t subnet_timeout;
	uint8_t init_type_reply;
	uint8_t active_width;
	uint8_t active_speed;
	uint8_t phys_state;
	uint8_t link_layer;
	uint8_t flags;
};

// struct ibv_pd
struct mc_ibv_pd {
	struct mc_ibv_context *context;
	uint32_t handle;
};

// struct ibv_mr
struct mc_ibv_mr {
	struct mc_ibv_context *context;
	struct mc_ibv_pd *pd;
	void *addr;
	size_t length;
	uint32_t handle;
	uint32_t lkey;
	uint32_t rkey;
};

// struct ibv_cq
struct mc_ibv_cq {
	struct mc_ibv_context *context;
	void *channel; // struct ibv_comp_channel *
	void *cq_context;
	uint32_t handle;
	int32_t cqe;
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t comp_events_completed;
	uint32_t async_events_completed;
};

// struct ibv_qp
struct mc_ibv_qp {
	struct mc_ibv_context *context;
	void *qp_context;
	struct mc_ibv_pd *pd;
	struct mc_ibv_cq *send_cq;
	struct mc_ibv_cq *recv_cq;
	void *srq; // struct ibv_srq *
	uint32_t handle;
	uint32_t qp_num;
	uint32_t state;   // enum ibv_qp_state
	uint32_t qp_type; // enum ibv_qp_type
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t events_completed;
};

// struct ibv_sge
struct mc_ibv_sge {
	uint64_t addr;
	uint32_t length;
	uint32_t lkey;
};

// struct ibv_mw_bind_info (inside ibv_send_wr's last union)
struct mc_ibv_mw_bind_info {
	struct mc_ibv_mr *mr;
	uint64_t addr;
	uint64_t length;
	uint32_t mw_access_flags;
};

// struct ibv_send_wr, complete: the package allocates arrays of it, so its
// size is the ABI's, unions and all.
struct mc_ibv_send_wr {
	uint64_t wr_id;
	struct mc_ibv_send_wr *next;
	struct mc_ibv_sge *sg_list;
	int32_t num_sge;
	uint32_t opcode; // enum ibv_wr_opcode
	uint32_t send_flags;
	union {
		uint32_t imm_data; // big-endian
		uint32_t invalidate_rkey;
	};
	union {
		struct {
			uint64_t remote_addr;
			uint32_t rkey;
		} rdma;
		struct {
			uint64_t remote_addr;
			uint64_t compare_add;
			uint64_t swap;
			uint32_t rkey;
		} atomic;
		struct {
			void *ah; // struct ibv_ah *
			uint32_t remote_qpn;
			uint32_t remote_qkey;
		} ud;
	} wr;
	union {
		struct {
			uint32_t remote_srqn;
		} xrc;
	} qp_type;
	union {
		struct {
			void *mw; // struct ibv_mw *
			uint32_t rkey;
			struct mc_ibv_mw_bind_info bind_info;
		} bind_mw;
		struct {
			void *hdr;
			uint16_t hdr_sz;
			uint16_t mss;
		} tso;
	};
};

// struct ibv_wc
struct mc_ibv_wc {
	uint64_t wr_id;
	uint32_t status; // enum ibv_wc_status
	uint32_t opcode; // enum ibv_wc_opcode
	uint32_t vendor_err;
	uint32_t byte_len;
	union {
		uint32_t imm_data; // big-endian
		uint32_t invalidated_rkey;
	};
	uint32_t qp_num;
	uint32_t src_qp;
	uint32_t wc_flags;
	uint16_t pkey_index;
	uint16_t slid;
	uint8_t sl;
	uint8_t dlid_path_bits;
};

// struct ibv_qp_cap
struct mc_ibv_qp_cap {
	uint32_t max_send_wr;
	uint32_t max_recv_wr;
	uint32_t max_send_sge;
	uint32_t max_recv_sge;
	uint32_t max_inline_data;
};

// struct ibv_qp_init_attr
struct mc_ibv_qp_init_attr {
	void *qp_context;
	struct mc_ibv_cq *send_cq;
	struct mc_ibv_cq *recv_cq;
	void *srq; // struct ibv_srq *
	struct mc_ibv_qp_cap cap;
	uint32_t qp_type; // enum ibv_qp_type
	int32_t sq_sig_all;
};

// struct ibv_global_route
struct mc_ibv_global_route {
	union mc_ibv_gid dgid;
	uint32_t flow_label;
	uint8_t sgid_index;
	uint8_t hop_limit;
	uint8_t traffic_class;
};

// struct ibv_ah_attr
struct mc_ibv_ah_attr {
	struct mc_ibv_global_route grh;
	uint16_t dlid;
	uint8_t sl;
	uint8_t src_path_bits;
	uint8_t static_rate;
	uint8_t is_global;
	uint8_t port_num;
};

// struct ibv_qp_attr
struct mc_ibv_qp_attr {
	uint32_t qp_state;       // enum ibv_qp_state
	uint32_t cur_qp_state;   // enum ibv_qp_state
	uint32_t path_mtu;       // enum ibv_mtu
	uint32_t path_mig_state; // enum ibv_mig_state
	uint32_t qkey;
	uint32_t rq_psn;
	uint32_t sq_psn;
	uint32_t dest_qp_num;
	uint32_t qp_access_flags;
	struct mc_ibv_qp_cap cap;
	struct mc_ibv_ah_attr ah_attr;
	struct mc_ibv_ah_attr alt_ah_attr;
	uint16_t pkey_index;
	uint16_t alt_pkey_index;
	uint8_t en_sqd_async_notify;
	uint8_t sq_draining;
	uint8_t max_rd_atomic;
	uint8_t max_dest_rd_atomic;
	uint8_t min_rnr_timer;
	uint8_t port_num;
	uint8_t timeout;
	uint8_t retry_cnt;
	uint8_t rnr_retry;
	uint8_t alt_port_num;
	uint8_t alt_timeout;
	uint32_t rate_limit;
};

#endif // MC_VERBS_H
