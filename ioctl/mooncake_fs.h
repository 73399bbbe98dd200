/*
 * mooncake_fs.h - the ioctl ABI of mooncake-fs, for C and C++ programs.
 *
 * Every argument is a fixed-size, 8-byte-aligned, explicitly padded,
 * little-endian struct starting with {size, flags}; set size to
 * sizeof(struct) before each call. Commands act on the key of the open
 * file (batch commands on a directory). Errors come back in errno:
 * ENOTTY (unknown command), EINVAL (bad size, flags or arguments), EFAULT
 * (memory outside a registered buffer or the caller's address space),
 * ERANGE (offset outside the object), ENOENT, EEXIST (MC_FLAG_EXCL),
 * ENOSPC, EBADMSG (meta mismatch), EPERM (another process's MC_KIND_VM
 * registration), EBUSY (a user other than root with 256 data commands
 * running at once, or all such users with 4096). This header must agree
 * with package ioctl; a Go test checks it.
 */
#ifndef MOONCAKE_FS_H
#define MOONCAKE_FS_H

#include <stdint.h>
#include <linux/ioctl.h>

#define MC_IOC_TYPE 'M'
#define MC_MAGIC 0x454b41434e4f4f4dULL /* "MOONCAKE" little-endian */
#define MC_ABI_MAJOR 1
#define MC_ABI_MINOR 9

struct mc_header {
	uint32_t size;
	uint32_t flags;
};

struct mc_magic {
	struct mc_header h;
	uint64_t magic; /* out */
};

struct mc_abi_version {
	struct mc_header h;
	uint32_t major; /* out */
	uint32_t minor; /* out */
};

#define MC_KIND_HOST 1u
#define MC_KIND_CUDA 2u /* handle = cuIpcGetMemHandle, offset = offset in it */
#define MC_KIND_VM 3u   /* fd = -1, offset = address of the caller's own memory (1.3) */

/*
 * ABI 1.5: h.flags of a MC_KIND_CUDA registration. MC_REGISTER_DMABUF:
 * fd is a dma-buf of the caller exporting the whole allocation the handle
 * names (cuMemGetHandleForAddressRange of the range cuMemGetAddressRange
 * gives), for GPUDirect RDMA; the daemon takes its own copy. EINVAL when
 * fd is not a dma-buf of the allocation's size.
 */
#define MC_REGISTER_DMABUF (1u << 0)

struct mc_register {
	struct mc_header h;
	int32_t fd;         /* in: memfd or shm fd (MC_KIND_HOST), dma-buf fd (MC_REGISTER_DMABUF), else -1 */
	uint32_t kind;      /* in: MC_KIND_HOST */
	uint64_t len;       /* in */
	uint64_t offset;    /* in: page aligned */
	uint64_t id;        /* out */
	uint8_t handle[64]; /* reserved (CUDA IPC handle) */
};

struct mc_unregister {
	struct mc_header h;
	uint64_t id;
};

#define MC_FLAG_EXCL (1u << 0)   /* put: fail with EEXIST if the key exists */
#define MC_FLAG_UPDATE (1u << 1) /* put: write at obj_off into a copy */
/*
 * ABI 1.4: MC_FLAG_PARENTS on a batch or key put whose key names a path
 * below the directory fd creates the missing directories first (mode
 * 0755, the caller's; it needs write and search permission where each
 * goes). A put through an open file refuses the flag with EINVAL.
 */
#define MC_FLAG_PARENTS (1u << 2)
/*
 * ABI 1.6: MC_FLAG_WHOLE on a batch get entry or a MC_IOC_GET_KEY fails
 * that key with EOVERFLOW, moving nothing, when its value from obj_off on
 * is longer than the key's buffers. Other gets take no flags (EINVAL).
 */
#define MC_FLAG_WHOLE (1u << 3)

struct mc_buf {
	struct mc_header h;
	uint64_t id;
	uint64_t buf_off;
	uint64_t len;
	uint64_t obj_off;
	uint64_t result;  /* out: bytes moved */
	uint64_t version; /* out */
};

struct mc_vm {
	struct mc_header h;
	uint64_t addr;
	uint64_t len;
	uint64_t obj_off;
	uint64_t result;  /* out */
	uint64_t version; /* out */
};

struct mc_stat {
	struct mc_header h;
	uint64_t size;
	uint64_t version;
	uint64_t ino;
	int64_t mtime_ns;
	uint32_t mode;
	uint32_t pinned;
	uint32_t replicas;
	uint32_t extents;
	char location[192]; /* NUL-terminated, truncated */
};

#define MC_MAX_BATCH 64
#define MC_BATCH_BUF 0u /* entry addr is an offset in buffer id */
#define MC_BATCH_VM 1u  /* entry addr is an address of the caller */

struct mc_batch_entry {
	uint16_t key_off;
	uint16_t key_len;
	uint32_t flags;
	uint64_t addr;
	uint64_t len;
	uint64_t obj_off;
	int64_t result; /* out: bytes, or -errno for this key */
	uint64_t version;
};

struct mc_batch {
	struct mc_header h;
	uint32_t count;
	uint32_t source;
	uint64_t id;
	struct mc_batch_entry entries[MC_MAX_BATCH];
	char keys[16376 - 24 - MC_MAX_BATCH * 48];
};

/* GPU memory of the caller: one copy between it and the pinned segments. */
struct mc_cuda {
	struct mc_header h;
	uint8_t handle[64]; /* cuIpcGetMemHandle of the allocation */
	uint64_t dev_off;   /* offset of the data in the allocation */
	uint64_t len;
	uint64_t obj_off;
	uint64_t result;    /* out */
	uint64_t version;   /* out */
	uint8_t device[16]; /* GPU UUID; all zero: the first GPU */
};

/*
 * ABI 1.3: one key by name on a directory fd, in one small call. A put
 * stores meta (<= MC_MAX_META bytes, the xattr user.mooncake.meta) with
 * the value; a get returns the value's size and meta, and fails with
 * EBADMSG, moving nothing, if it carries a meta the value does not have.
 * A get of len 0 (source MC_SRC_VM) is a lookup. Longer keys go by batch.
 */
#define MC_SRC_BUF 0u  /* addr = offset in registration id */
#define MC_SRC_VM 1u   /* addr = address of the caller */
#define MC_SRC_CUDA 2u /* addr = offset in the allocation gpu names */
#define MC_MAX_META 128

struct mc_gpu_ref {
	uint8_t handle[64]; /* cuIpcGetMemHandle of the allocation */
	uint8_t device[16]; /* GPU UUID; all zero: the first GPU */
};

struct mc_key {
	struct mc_header h;
	uint32_t source;
	uint16_t key_len;
	uint16_t meta_len; /* in; out (get) */
	uint64_t id;
	uint64_t addr;
	uint64_t len;
	uint64_t obj_off;
	uint64_t result;  /* out: bytes moved */
	uint64_t version; /* out */
	uint64_t size;    /* out (get): the value's size */
	struct mc_gpu_ref gpu;
	char meta[MC_MAX_META];
	char key[1024 - 280];
};

/*
 * ABI 1.9: one key whose value (at most MC_INLINE_BYTES) travels in the
 * call: k.h.size = sizeof(struct mc_key_inline), k.source = MC_SRC_INLINE,
 * k.id = k.addr = 0, k.len the value's length. A put stores data[0, len);
 * a get returns up to len bytes from obj_off in data, the rest zeroed.
 * For small values the kernel's copy of the call costs less than the
 * daemon reaching into the caller's memory.
 */
#define MC_SRC_INLINE 3u
#define MC_INLINE_BYTES 4096

struct mc_key_inline {
	struct mc_key k;
	uint8_t data[MC_INLINE_BYTES];
};

/*
 * Vector batches: each key's value is the concatenation of its segments.
 * A segment is caller memory (id MC_SEG_VM, off = address), a registration
 * made on the directory fd (id, off in it), or an allocation of the
 * batch's GPU table (id MC_SEG_GPU | index, off in it). Keys, segment
 * lists (8-aligned) and metas lie in area.
 */
#define MC_MAX_GPU_REFS 16
#define MC_MAX_SEGS 256
#define MC_SEG_VM 0ull
#define MC_SEG_GPU (1ull << 63)

struct mc_seg {
	uint64_t id;
	uint64_t off;
	uint64_t len;
};

struct mc_vbatch_entry {
	uint16_t key_off;
	uint16_t key_len;
	uint32_t flags;
	uint32_t seg_off;
	uint32_t nseg;
	uint32_t meta_off;
	uint32_t meta_len;
	uint64_t obj_off;
	int64_t result; /* out: bytes, or -errno for this key */
	uint64_t version;
};

struct mc_vbatch {
	struct mc_header h;
	uint32_t count;
	uint32_t ngpu;
	struct mc_vbatch_entry entries[MC_MAX_BATCH];
	struct mc_gpu_ref gpus[MC_MAX_GPU_REFS];
	uint8_t area[16376 - 16 - MC_MAX_BATCH * 48 - MC_MAX_GPU_REFS * 80];
};

/*
 * ABI 1.7: vector batches that run while the caller goes on. A
 * BATCH_PUTV or BATCH_GETV with MC_VBATCH_ASYNC in h.flags checks the
 * call's shape, starts it and returns at once: the ioctl's value is the
 * call's number on that directory fd (1 to 2^31-1); results are not
 * filled. It may name only memfd registrations and GPU memory, not the
 * caller's own memory (MC_SEG_VM, MC_KIND_VM registrations: EINVAL), and
 * that memory must stay as it is until MC_IOC_BATCH_WAIT returns for it.
 * BATCH_WAIT
 * takes a struct mc_vbatch whose count is the call's number, blocks until
 * the call is done and returns the call's struct with every result
 * filled; each call is waited for once (EINVAL otherwise). count 0 waits
 * for every call submitted on the fd before it and consumes none. An fd
 * holds at most MC_MAX_ASYNC_CALLS calls not waited for, a user (root
 * aside) 256, the mount 1024 (EBUSY beyond); closing the fd drops their
 * results and stops the calls still running at their next key. The
 * call's keys are relative to the fd's directory where it is when the
 * call runs (each key's result -ESTALE if it was removed by then), and
 * checked as the caller, with the groups it had at the submit.
 */
#define MC_VBATCH_ASYNC (1u << 0)
#define MC_MAX_ASYNC_CALLS 16

/*
 * ABI 1.8: batches whose entries stay in the caller's memory. The
 * argument names a table of count struct mc_batch_entry (the layout of
 * struct mc_batch's) and the key bytes its key_off index, both in the
 * caller's own memory: one call carries up to MC_MAX_TABLE keys, as one
 * FUSE round trip. The daemon reads both when the call starts and checks
 * that it can write the table (EFAULT, and nothing done, if not); at the
 * end it writes every entry back with result, version and a get's len
 * set. Keep the table mapped, writable and unchanged until the ioctl
 * returns. Not submittable (no async flag).
 */
#define MC_MAX_TABLE 1024
#define MC_MAX_TABLE_KEY_BYTES 65536

struct mc_table {
	struct mc_header h;
	uint32_t count;    /* 1 to MC_MAX_TABLE */
	uint32_t source;   /* MC_BATCH_BUF or MC_BATCH_VM */
	uint64_t id;       /* registered buffer of MC_BATCH_BUF */
	uint64_t entries;  /* address of count struct mc_batch_entry */
	uint64_t keys;     /* address of the key bytes */
	uint32_t keys_len; /* at most MC_MAX_TABLE_KEY_BYTES */
	uint32_t pad;      /* zero */
};

#define MC_IOC_GET_MAGIC _IOR(MC_IOC_TYPE, 0x01, struct mc_magic)
#define MC_IOC_GET_ABI_VERSION _IOR(MC_IOC_TYPE, 0x02, struct mc_abi_version)
#define MC_IOC_REGISTER_BUFFER _IOWR(MC_IOC_TYPE, 0x10, struct mc_register)
#define MC_IOC_UNREGISTER_BUFFER _IOW(MC_IOC_TYPE, 0x11, struct mc_unregister)
#define MC_IOC_PUT_BUF _IOWR(MC_IOC_TYPE, 0x12, struct mc_buf)
#define MC_IOC_GET_BUF _IOWR(MC_IOC_TYPE, 0x13, struct mc_buf)
#define MC_IOC_PUT_VM _IOWR(MC_IOC_TYPE, 0x14, struct mc_vm)
#define MC_IOC_GET_VM _IOWR(MC_IOC_TYPE, 0x15, struct mc_vm)
#define MC_IOC_STAT _IOWR(MC_IOC_TYPE, 0x16, struct mc_stat)
#define MC_IOC_BATCH_PUT _IOWR(MC_IOC_TYPE, 0x17, struct mc_batch)
#define MC_IOC_BATCH_GET _IOWR(MC_IOC_TYPE, 0x18, struct mc_batch)
#define MC_IOC_PUT_CUDA _IOWR(MC_IOC_TYPE, 0x19, struct mc_cuda)
#define MC_IOC_GET_CUDA _IOWR(MC_IOC_TYPE, 0x1a, struct mc_cuda)
#define MC_IOC_PUT_KEY _IOWR(MC_IOC_TYPE, 0x1b, struct mc_key)
#define MC_IOC_GET_KEY _IOWR(MC_IOC_TYPE, 0x1c, struct mc_key)
#define MC_IOC_BATCH_PUTV _IOWR(MC_IOC_TYPE, 0x1d, struct mc_vbatch)
#define MC_IOC_BATCH_GETV _IOWR(MC_IOC_TYPE, 0x1e, struct mc_vbatch)
#define MC_IOC_BATCH_WAIT _IOWR(MC_IOC_TYPE, 0x1f, struct mc_vbatch)
#define MC_IOC_BATCH_PUT_TABLE _IOWR(MC_IOC_TYPE, 0x20, struct mc_table)
#define MC_IOC_BATCH_GET_TABLE _IOWR(MC_IOC_TYPE, 0x21, struct mc_table)
#define MC_IOC_PUT_KEY_INLINE _IOWR(MC_IOC_TYPE, 0x22, struct mc_key_inline)
#define MC_IOC_GET_KEY_INLINE _IOWR(MC_IOC_TYPE, 0x23, struct mc_key_inline)

#endif /* MOONCAKE_FS_H */
