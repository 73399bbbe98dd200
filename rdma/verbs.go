//go:build cgo

package rdma

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mc_verbs.h"

// This translation unit knows verbs only through mc_verbs.h; rdma-core's
// header is for layout.go's comparison and must not creep in here.
#ifdef INFINIBAND_VERBS_H
#error "verbs.go must not include <infiniband/verbs.h>"
#endif

enum { MC_MAX_SGE = 4 }; // rdma.MaxSGE; verbs.go checks they agree

// mc_post_req is one work request as Go hands it over: plain fields in
// C memory, which mc_post turns into a chain of ibv_send_wr.
struct mc_post_req {
	uint64_t wr_id;
	uint64_t remote_addr;
	uint32_t rkey;
	uint32_t opcode;
	int32_t num_sge;
	uint32_t pad;
	struct mc_ibv_sge sge[MC_MAX_SGE];
};

// The entry points, resolved once from the dlopened library.
struct mc_fns {
	struct mc_ibv_device **(*get_device_list)(int *num);
	void (*free_device_list)(struct mc_ibv_device **list);
	const char *(*get_device_name)(struct mc_ibv_device *dev);
	struct mc_ibv_context *(*open_device)(struct mc_ibv_device *dev);
	int (*close_device)(struct mc_ibv_context *ctx);
	int (*query_device)(struct mc_ibv_context *ctx, struct mc_ibv_device_attr *attr);
	int (*query_port)(struct mc_ibv_context *ctx, uint8_t port, struct mc_ibv_port_attr *attr);
	int (*query_gid)(struct mc_ibv_context *ctx, uint8_t port, int index, union mc_ibv_gid *gid);
	struct mc_ibv_pd *(*alloc_pd)(struct mc_ibv_context *ctx);
	int (*dealloc_pd)(struct mc_ibv_pd *pd);
	struct mc_ibv_mr *(*reg_mr)(struct mc_ibv_pd *pd, void *addr, size_t length, int access);
	struct mc_ibv_mr *(*reg_dmabuf_mr)(struct mc_ibv_pd *pd, uint64_t offset, size_t length,
					   uint64_t iova, int fd, int access);
	int (*dereg_mr)(struct mc_ibv_mr *mr);
	struct mc_ibv_cq *(*create_cq)(struct mc_ibv_context *ctx, int cqe, void *cq_context,
				       void *channel, int comp_vector);
	int (*destroy_cq)(struct mc_ibv_cq *cq);
	struct mc_ibv_qp *(*create_qp)(struct mc_ibv_pd *pd, struct mc_ibv_qp_init_attr *attr);
	int (*modify_qp)(struct mc_ibv_qp *qp, struct mc_ibv_qp_attr *attr, int mask);
	int (*destroy_qp)(struct mc_ibv_qp *qp);
};

static struct mc_fns mc_fn;
static void *mc_lib;

// mc_load dlopens path and resolves every entry point; 0 on success, else
// -1 with the reason in err. The first library that loads stays loaded
// and is what mc_fn calls; a second, different one is refused (only tests
// try). Loading the same one again is a no-op.
static int mc_load(const char *path, char *err, size_t errlen) {
	dlerror();
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		return -1;
	}
	struct mc_fns f;
	memset(&f, 0, sizeof f);
	struct { void *dst; const char *name; int optional; } syms[] = {
		{&f.get_device_list, "ibv_get_device_list", 0},
		{&f.free_device_list, "ibv_free_device_list", 0},
		{&f.get_device_name, "ibv_get_device_name", 0},
		{&f.open_device, "ibv_open_device", 0},
		{&f.close_device, "ibv_close_device", 0},
		{&f.query_device, "ibv_query_device", 0},
		{&f.query_port, "ibv_query_port", 0},
		{&f.query_gid, "ibv_query_gid", 0},
		{&f.alloc_pd, "ibv_alloc_pd", 0},
		{&f.dealloc_pd, "ibv_dealloc_pd", 0},
		{&f.reg_mr, "ibv_reg_mr", 0},
		{&f.reg_dmabuf_mr, "ibv_reg_dmabuf_mr", 1},
		{&f.dereg_mr, "ibv_dereg_mr", 0},
		{&f.create_cq, "ibv_create_cq", 0},
		{&f.destroy_cq, "ibv_destroy_cq", 0},
		{&f.create_qp, "ibv_create_qp", 0},
		{&f.modify_qp, "ibv_modify_qp", 0},
		{&f.destroy_qp, "ibv_destroy_qp", 0},
	};
	for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
		void *p = dlsym(h, syms[i].name);
		if (p == NULL && !syms[i].optional) {
			snprintf(err, errlen, "%s: missing symbol %s", path, syms[i].name);
			dlclose(h);
			return -1;
		}
		// Every slot is a function pointer, which has a data pointer's
		// size and representation on the targets this supports.
		memcpy(syms[i].dst, &p, sizeof p);
	}
	if (mc_lib != NULL) {
		dlclose(h);
		if (h == mc_lib)
			return 0;
		snprintf(err, errlen, "%s: another libibverbs is already loaded", path);
		return -1;
	}
	mc_fn = f;
	mc_lib = h;
	return 0;
}

// mc_errno turns a failed int-returning verbs call into a positive errno:
// calls either return the errno themselves or return -1 and set errno.
static int mc_errno(int r) {
	if (r > 0)
		return r;
	if (errno > 0)
		return errno;
	if (r < -1)
		return -r;
	return EIO;
}

// mc_errno_null is the errno of a verbs call that returned NULL.
static int mc_errno_null(void) { return errno > 0 ? errno : EIO; }

// Each wrapper below returns 0 or a positive errno, and its results
// through pointers.

static int mc_device_list(struct mc_ibv_device ***list, int *n) {
	errno = 0;
	*n = 0;
	*list = mc_fn.get_device_list(n);
	return *list ? 0 : mc_errno_null();
}

static void mc_free_device_list(struct mc_ibv_device **list) { mc_fn.free_device_list(list); }

static const char *mc_device_name(struct mc_ibv_device *dev) { return mc_fn.get_device_name(dev); }

static int mc_open_device(struct mc_ibv_device *dev, struct mc_ibv_context **ctx) {
	errno = 0;
	*ctx = mc_fn.open_device(dev);
	return *ctx ? 0 : mc_errno_null();
}

static int mc_close_device(struct mc_ibv_context *ctx) {
	errno = 0;
	int r = mc_fn.close_device(ctx);
	return r == 0 ? 0 : mc_errno(r);
}

static int mc_query_device(struct mc_ibv_context *ctx, struct mc_ibv_device_attr *attr) {
	memset(attr, 0, sizeof *attr);
	errno = 0;
	int r = mc_fn.query_device(ctx, attr);
	return r == 0 ? 0 : mc_errno(r);
}

static int mc_query_port(struct mc_ibv_context *ctx, uint8_t port, struct mc_ibv_port_attr *attr) {
	memset(attr, 0, sizeof *attr);
	errno = 0;
	int r = mc_fn.query_port(ctx, port, attr);
	return r == 0 ? 0 : mc_errno(r);
}

static int mc_query_gid(struct mc_ibv_context *ctx, uint8_t port, int index, union mc_ibv_gid *gid) {
	memset(gid, 0, sizeof *gid);
	errno = 0;
	int r = mc_fn.query_gid(ctx, port, index, gid);
	return r == 0 ? 0 : mc_errno(r);
}

static int mc_alloc_pd(struct mc_ibv_context *ctx, struct mc_ibv_pd **pd) {
	errno = 0;
	*pd = mc_fn.alloc_pd(ctx);
	return *pd ? 0 : mc_errno_null();
}

static int mc_dealloc_pd(struct mc_ibv_pd *pd) {
	errno = 0;
	int r = mc_fn.dealloc_pd(pd);
	return r == 0 ? 0 : mc_errno(r);
}

static int mc_reg_mr(struct mc_ibv_pd *pd, void *addr, size_t length, int access, struct mc_ibv_mr **mr) {
	errno = 0;
	*mr = mc_fn.reg_mr(pd, addr, length, access);
	return *mr ? 0 : mc_errno_null();
}

static int mc_have_reg_dmabuf_mr(void) { return mc_fn.reg_dmabuf_mr != NULL; }

static int mc_reg_dmabuf_mr(struct mc_ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova,
			    int fd, int access, struct mc_ibv_mr **mr) {
	errno = 0;
	*mr = mc_fn.reg_dmabuf_mr(pd, offset, length, iova, fd, access);
	return *mr ? 0 : mc_errno_null();
}

static int mc_dereg_mr(struct mc_ibv_mr *mr) {
	errno = 0;
	int r = mc_fn.dereg_mr(mr);
	return r == 0 ? 0 : mc_errno(r);
}

static int mc_create_cq(struct mc_ibv_context *ctx, int cqe, struct mc_ibv_cq **cq) {
	errno = 0;
	*cq = mc_fn.create_cq(ctx, cqe, NULL, NULL, 0);
	return *cq ? 0 : mc_errno_null();
}

static int mc_destroy_cq(struct mc_ibv_cq *cq) {
	errno = 0;
	int r = mc_fn.destroy_cq(cq);
	return r == 0 ? 0 : mc_errno(r);
}

// mc_create_qp creates an RC QP whose send and receive completions go to
// cq, with depth send slots of max_sge SGEs, a single receive slot (the
// package never posts receives) and every send signaled.
static int mc_create_qp(struct mc_ibv_pd *pd, struct mc_ibv_cq *cq, uint32_t depth, uint32_t max_sge,
			struct mc_ibv_qp **qp) {
	struct mc_ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.send_cq = cq;
	a.recv_cq = cq;
	a.cap.max_send_wr = depth;
	a.cap.max_recv_wr = 1;
	a.cap.max_send_sge = max_sge;
	a.cap.max_recv_sge = 1;
	a.qp_type = MC_IBV_QPT_RC;
	a.sq_sig_all = 1;
	errno = 0;
	*qp = mc_fn.create_qp(pd, &a);
	return *qp ? 0 : mc_errno_null();
}

static int mc_destroy_qp(struct mc_ibv_qp *qp) {
	errno = 0;
	int r = mc_fn.destroy_qp(qp);
	return r == 0 ? 0 : mc_errno(r);
}

static int mc_modify_qp(struct mc_ibv_qp *qp, struct mc_ibv_qp_attr *a, int mask) {
	errno = 0;
	int r = mc_fn.modify_qp(qp, a, mask);
	return r == 0 ? 0 : mc_errno(r);
}

// mc_qp_init moves a QP from RESET to INIT on port with the given remote
// access rights, with the default partition key.
static int mc_qp_init(struct mc_ibv_qp *qp, uint8_t port, uint32_t access) {
	struct mc_ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = MC_IBV_QPS_INIT;
	a.pkey_index = 0;
	a.port_num = port;
	a.qp_access_flags = access;
	return mc_modify_qp(qp, &a, MC_IBV_QP_STATE | MC_IBV_QP_PKEY_INDEX | MC_IBV_QP_PORT |
				    MC_IBV_QP_ACCESS_FLAGS);
}

// mc_qp_rtr moves a QP from INIT to RTR, connected to QP dest_qpn at dlid
// (and, with global set, at dgid through a GRH from local GID sgid_index).
// A receiver-not-ready NAK asks the peer to wait 0.64 ms (timer 12).
static int mc_qp_rtr(struct mc_ibv_qp *qp, uint32_t mtu, uint32_t dest_qpn, uint32_t rq_psn,
		     uint8_t max_dest_rd_atomic, uint16_t dlid, uint8_t port, int global,
		     const uint8_t *dgid, uint8_t sgid_index) {
	struct mc_ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = MC_IBV_QPS_RTR;
	a.path_mtu = mtu;
	a.dest_qp_num = dest_qpn;
	a.rq_psn = rq_psn;
	a.max_dest_rd_atomic = max_dest_rd_atomic;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = dlid;
	a.ah_attr.sl = 0;
	a.ah_attr.src_path_bits = 0;
	a.ah_attr.port_num = port;
	if (global) {
		a.ah_attr.is_global = 1;
		memcpy(a.ah_attr.grh.dgid.raw, dgid, sizeof a.ah_attr.grh.dgid.raw);
		a.ah_attr.grh.sgid_index = sgid_index;
		a.ah_attr.grh.hop_limit = 64;
	}
	return mc_modify_qp(qp, &a, MC_IBV_QP_STATE | MC_IBV_QP_AV | MC_IBV_QP_PATH_MTU |
				    MC_IBV_QP_DEST_QPN | MC_IBV_QP_RQ_PSN |
				    MC_IBV_QP_MAX_DEST_RD_ATOMIC | MC_IBV_QP_MIN_RNR_TIMER);
}

// mc_qp_rts moves a QP from RTR to RTS. The ack timeout is 4.096 us * 2^14
// (about 67 ms), retried 7 times; receiver-not-ready is retried forever (7).
static int mc_qp_rts(struct mc_ibv_qp *qp, uint32_t sq_psn, uint8_t max_rd_atomic) {
	struct mc_ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = MC_IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = sq_psn;
	a.max_rd_atomic = max_rd_atomic;
	return mc_modify_qp(qp, &a, MC_IBV_QP_STATE | MC_IBV_QP_TIMEOUT | MC_IBV_QP_RETRY_CNT |
				    MC_IBV_QP_RNR_RETRY | MC_IBV_QP_SQ_PSN | MC_IBV_QP_MAX_QP_RD_ATOMIC);
}

// mc_post turns reqs[0..n) into a chain of signaled RDMA work requests in
// wrs and posts it with one call of the provider's post_send. *queued is
// how many the provider accepted (all of them on success).
static int mc_post(struct mc_ibv_qp *qp, struct mc_post_req *reqs, struct mc_ibv_send_wr *wrs, int n,
		   int *queued) {
	for (int i = 0; i < n; i++) {
		struct mc_ibv_send_wr *w = &wrs[i];
		memset(w, 0, sizeof *w);
		w->wr_id = reqs[i].wr_id;
		w->next = i + 1 < n ? &wrs[i + 1] : NULL;
		w->sg_list = reqs[i].sge;
		w->num_sge = reqs[i].num_sge;
		w->opcode = reqs[i].opcode;
		w->send_flags = MC_IBV_SEND_SIGNALED;
		w->wr.rdma.remote_addr = reqs[i].remote_addr;
		w->wr.rdma.rkey = reqs[i].rkey;
	}
	struct mc_ibv_send_wr *bad = NULL;
	errno = 0;
	int r = qp->context->ops.post_send(qp, wrs, &bad);
	if (r == 0) {
		*queued = n;
		return 0;
	}
	*queued = (bad != NULL && bad >= wrs && bad < wrs + n) ? (int)(bad - wrs) : 0;
	return mc_errno(r);
}

// mc_poll takes up to n completions from cq into wc through the provider's
// poll_cq. It returns their number, or what poll_cq returned when that is
// negative, with errno in *err.
static int mc_poll(struct mc_ibv_cq *cq, struct mc_ibv_wc *wc, int n, int *err) {
	errno = 0;
	int r = cq->context->ops.poll_cq(cq, n, wc);
	*err = errno;
	return r;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// libibverbsEnv names the environment variable that overrides which
// library is loaded (a path or a name for the dynamic loader).
const libibverbsEnv = "MOONCAKE_LIBIBVERBS"

// defaultLibibverbs is the library loaded when libibverbsEnv is unset.
const defaultLibibverbs = "libibverbs.so.1"

// Settings of every connection (see Connect).
const (
	// maxRdAtomic is the most RDMA READs a QP keeps in flight, as
	// initiator and as responder; the device's limits lower it.
	maxRdAtomic = 16
	// qpAccess is what a connected QP lets its peer do.
	qpAccess = C.MC_IBV_ACCESS_LOCAL_WRITE | C.MC_IBV_ACCESS_REMOTE_READ | C.MC_IBV_ACCESS_REMOTE_WRITE
)

// MaxSGE and the C side's MC_MAX_SGE must agree: either difference being
// negative is a compile-time overflow.
const _ = uint(MaxSGE-C.MC_MAX_SGE) + uint(C.MC_MAX_SGE-MaxSGE)

// verbsError is a failed libibverbs call: which one, and its errno.
type verbsError struct {
	call  string
	errno syscall.Errno
}

// Error names the call and the errno, with the errno's text.
func (e *verbsError) Error() string {
	return fmt.Sprintf("%s: %v (errno %d)", e.call, e.errno, int(e.errno))
}

// Unwrap returns the errno, so errors.Is works with syscall values.
func (e *verbsError) Unwrap() error { return e.errno }

// callErr wraps the errno e of the verbs call named call.
func callErr(call string, e C.int) error {
	return &verbsError{call: call, errno: syscall.Errno(e)}
}

// unsupported reports whether errno e means the library or the driver does
// not implement the operation.
func unsupported(e syscall.Errno) bool {
	switch e {
	case syscall.EOPNOTSUPP, syscall.ENOSYS, syscall.EPROTONOSUPPORT:
		return true
	}
	return false
}

// loadMu serializes mc_load, which publishes C globals.
var loadMu sync.Mutex

// verbsProvider is the libibverbs implementation of Provider. The library
// is loaded on first use.
type verbsProvider struct {
	once   sync.Once
	path   string // what was passed to dlopen
	err    error  // why the library is unusable, wrapping ErrUnavailable
	loader string // the loader's message when loading failed
}

// defaultVerbs is the provider Verbs returns.
var defaultVerbs = &verbsProvider{}

// Verbs returns the libibverbs provider. The library (libibverbs.so.1, or
// whatever MOONCAKE_LIBIBVERBS names) is loaded once, on first use; if that
// fails, Devices and Open return an error wrapping ErrUnavailable.
func Verbs() Provider { return defaultVerbs }

// Reason says in one line why RDMA cannot be used here, or returns "" when
// the library loaded and some device has an active port.
func Reason() string { return defaultVerbs.reason() }

// Name returns "libibverbs".
func (p *verbsProvider) Name() string { return "libibverbs" }

// load loads the library once and returns why it cannot be used, if so.
func (p *verbsProvider) load() error {
	p.once.Do(func() {
		p.path = os.Getenv(libibverbsEnv)
		if p.path == "" {
			p.path = defaultLibibverbs
		}
		cpath := C.CString(p.path)
		defer C.free(unsafe.Pointer(cpath))
		var msg [1024]C.char
		loadMu.Lock()
		r := C.mc_load(cpath, &msg[0], C.size_t(len(msg)))
		loadMu.Unlock()
		if r != 0 {
			p.loader = C.GoString(&msg[0])
			p.err = fmt.Errorf("%w: %s", ErrUnavailable, p.loader)
		}
	})
	return p.err
}

// devCaps are the device and port limits the package checks against; a
// zero means the device did not say.
type devCaps struct {
	maxQPWr       int
	maxCQE        int
	maxSGE        int
	maxRdAtom     int // as responder (max_dest_rd_atomic)
	maxInitRdAtom int // as initiator (max_rd_atomic)
	maxMsg        uint64
}

// maxDepth is the deepest QP the device supports, 0 when unknown.
func (c devCaps) maxDepth() int {
	switch {
	case c.maxQPWr > 0 && c.maxCQE > 0:
		return min(c.maxQPWr, c.maxCQE)
	case c.maxQPWr > 0:
		return c.maxQPWr
	}
	return c.maxCQE
}

// devDesc is one queried device: what Devices reports and what the
// package keeps for itself.
type devDesc struct {
	info      DeviceInfo
	portState uint32
	caps      devCaps
}

// downReason is the one-line reason why d cannot be used.
func (d devDesc) downReason() string {
	return fmt.Sprintf("%s port %d is %s", d.info.Name, d.info.Port, portStateName(d.portState))
}

// scanResult is what a walk over the device list found.
type scanResult struct {
	devs     []devDesc
	failed   []error // devices that could not be opened or queried, unprefixed
	noKernel bool    // libibverbs found no RDMA support in the kernel
}

// deviceList returns the library's device list, which the caller frees
// with C.mc_free_device_list, or nil when the kernel has no RDMA support.
func deviceList() (**C.struct_mc_ibv_device, int, error) {
	var list **C.struct_mc_ibv_device
	var n C.int
	if e := C.mc_device_list(&list, &n); e != 0 {
		if syscall.Errno(e) == syscall.ENOSYS {
			return nil, 0, nil
		}
		return nil, 0, fmt.Errorf("rdma: %w", callErr("ibv_get_device_list", e))
	}
	return list, int(n), nil
}

// devName returns a device's kernel name and its sysfs directory.
func devName(dev *C.struct_mc_ibv_device) (name, sysfs string) {
	name = C.GoString(C.mc_device_name(dev))
	sysfs = C.GoString(&dev.ibdev_path[0])
	if sysfs == "" {
		sysfs = "/sys/class/infiniband/" + name
	}
	return name, sysfs
}

// scan opens and queries every device, closing each again.
func (p *verbsProvider) scan() (scanResult, error) {
	if err := p.load(); err != nil {
		return scanResult{}, err
	}
	list, n, err := deviceList()
	if err != nil {
		return scanResult{}, err
	}
	if list == nil {
		return scanResult{noKernel: true}, nil
	}
	defer C.mc_free_device_list(list)
	var res scanResult
	for _, dev := range unsafe.Slice(list, n) {
		name, sysfs := devName(dev)
		var ctx *C.struct_mc_ibv_context
		if e := C.mc_open_device(dev, &ctx); e != 0 {
			res.failed = append(res.failed, fmt.Errorf("%s: %w", name, callErr("ibv_open_device", e)))
			continue
		}
		d, err := describe(ctx, name, sysfs)
		C.mc_close_device(ctx)
		if err != nil {
			res.failed = append(res.failed, err)
			continue
		}
		res.devs = append(res.devs, d)
	}
	return res, nil
}

// Devices lists the devices that could be opened, each with the port the
// transport would use: the first active one, else port 1. No devices is an
// empty list; when every device fails to open, the first failure is
// returned, wrapping ErrUnavailable.
func (p *verbsProvider) Devices() ([]DeviceInfo, error) {
	res, err := p.scan()
	if err != nil {
		return nil, err
	}
	if len(res.devs) == 0 && len(res.failed) > 0 {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, res.failed[0])
	}
	out := make([]DeviceInfo, 0, len(res.devs))
	for _, d := range res.devs {
		out = append(out, d.info)
	}
	return out, nil
}

// reason implements Reason for p.
func (p *verbsProvider) reason() string {
	res, err := p.scan()
	switch {
	case err != nil && p.loader != "":
		return p.loader
	case err != nil:
		return err.Error()
	case res.noKernel:
		return "no RDMA devices (the kernel has no RDMA support)"
	case len(res.devs) == 0 && len(res.failed) > 0:
		return res.failed[0].Error()
	case len(res.devs) == 0:
		return "no RDMA devices"
	}
	var down []string
	for _, d := range res.devs {
		if d.info.PortUp {
			return ""
		}
		down = append(down, d.downReason())
	}
	return strings.Join(down, "; ")
}

// Open opens the named device and allocates its protection domain. It
// fails with ErrUnavailable when there is no such device or its port is
// not active.
func (p *verbsProvider) Open(name string) (Device, error) {
	if err := p.load(); err != nil {
		return nil, err
	}
	list, n, err := deviceList()
	if err != nil {
		return nil, err
	}
	if list == nil {
		return nil, fmt.Errorf("%w: no RDMA device %q: the kernel has no RDMA support", ErrUnavailable, name)
	}
	var ctx *C.struct_mc_ibv_context
	var sysfs string
	var names []string
	for _, dev := range unsafe.Slice(list, n) {
		dn, ds := devName(dev)
		names = append(names, dn)
		if dn != name {
			continue
		}
		sysfs = ds
		if e := C.mc_open_device(dev, &ctx); e != 0 {
			C.mc_free_device_list(list)
			return nil, fmt.Errorf("rdma: %s: %w", name, callErr("ibv_open_device", e))
		}
		break
	}
	// An opened context outlives the list it came from.
	C.mc_free_device_list(list)
	if ctx == nil {
		have := "none"
		if len(names) > 0 {
			have = strings.Join(names, ", ")
		}
		return nil, fmt.Errorf("%w: no RDMA device %q (devices: %s)", ErrUnavailable, name, have)
	}
	d, err := describe(ctx, name, sysfs)
	if err != nil {
		C.mc_close_device(ctx)
		return nil, fmt.Errorf("rdma: %w", err)
	}
	if !d.info.PortUp {
		C.mc_close_device(ctx)
		return nil, fmt.Errorf("%w: %s", ErrUnavailable, d.downReason())
	}
	var pd *C.struct_mc_ibv_pd
	if e := C.mc_alloc_pd(ctx, &pd); e != 0 {
		C.mc_close_device(ctx)
		return nil, fmt.Errorf("rdma: %s: %w", name, callErr("ibv_alloc_pd", e))
	}
	return &verbsDevice{desc: d, ctx: ctx, pd: pd}, nil
}

// describe queries an opened device: its limits, the port to use (the
// first active one, else port 1), that port's addresses, and where sysfs
// puts it. Its errors name the device but not the package.
func describe(ctx *C.struct_mc_ibv_context, name, sysfs string) (devDesc, error) {
	var da C.struct_mc_ibv_device_attr
	if e := C.mc_query_device(ctx, &da); e != 0 {
		return devDesc{}, fmt.Errorf("%s: %w", name, callErr("ibv_query_device", e))
	}
	ports := int(da.phys_port_cnt)
	if ports < 1 {
		ports = 1
	}
	var pa C.struct_mc_ibv_port_attr
	port := 0
	for p := 1; p <= ports; p++ {
		var a C.struct_mc_ibv_port_attr
		if e := C.mc_query_port(ctx, C.uint8_t(p), &a); e != 0 {
			return devDesc{}, fmt.Errorf("%s port %d: %w", name, p, callErr("ibv_query_port", e))
		}
		if port == 0 || (a.state == C.MC_IBV_PORT_ACTIVE && pa.state != C.MC_IBV_PORT_ACTIVE) {
			port, pa = p, a
		}
	}
	d := devDesc{
		portState: uint32(pa.state),
		caps: devCaps{
			maxQPWr:       int(da.max_qp_wr),
			maxCQE:        int(da.max_cqe),
			maxSGE:        int(da.max_sge),
			maxRdAtom:     int(da.max_qp_rd_atom),
			maxInitRdAtom: int(da.max_qp_init_rd_atom),
			maxMsg:        uint64(pa.max_msg_sz),
		},
		info: DeviceInfo{
			Name:      name,
			Port:      uint8(port),
			PortUp:    pa.state == C.MC_IBV_PORT_ACTIVE,
			LinkLayer: "InfiniBand",
			LID:       uint16(pa.lid),
			MTU:       mtuBytes(uint32(pa.active_mtu)),
			NUMANode:  numaNode(sysfs),
			PCI:       pciBusID(sysfs),
		},
	}
	ethernet := pa.link_layer == C.MC_IBV_LINK_LAYER_ETHERNET
	if ethernet {
		d.info.LinkLayer = "Ethernet"
	}
	gid, idx, err := pickGID(ctx, port, int(pa.gid_tbl_len), ethernet, sysfs)
	if err != nil {
		return devDesc{}, fmt.Errorf("%s port %d: %w", name, port, err)
	}
	d.info.GID, d.info.GIDIndex = gid, idx
	return d, nil
}

// queryGID reads entry idx of a port's GID table.
func queryGID(ctx *C.struct_mc_ibv_context, port, idx int) (GID, error) {
	var g C.union_mc_ibv_gid
	if e := C.mc_query_gid(ctx, C.uint8_t(port), C.int(idx), &g); e != 0 {
		return GID{}, callErr("ibv_query_gid", e)
	}
	return *(*GID)(unsafe.Pointer(&g)), nil
}

// pickGID chooses the GID a port's connections use. InfiniBand uses entry
// 0. Ethernet (RoCE) uses the best non-zero entry by gidScore, the first
// of equals; a table with no non-zero entry gives entry 0.
func pickGID(ctx *C.struct_mc_ibv_context, port, tblLen int, ethernet bool, sysfs string) (GID, int, error) {
	if !ethernet || tblLen <= 1 {
		g, err := queryGID(ctx, port, 0)
		return g, 0, err
	}
	var best GID
	bestIdx, bestScore := 0, 0
	var firstErr error
	for i := range tblLen {
		g, err := queryGID(ctx, port, i)
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		if s := gidScore(g, gidType(sysfs, port, i)); s > bestScore {
			best, bestIdx, bestScore = g, i, s
			if s == maxGIDScore {
				break
			}
		}
	}
	if bestScore == 0 && firstErr != nil {
		return GID{}, 0, firstErr
	}
	return best, bestIdx, nil
}

// maxGIDScore is gidScore's best result.
const maxGIDScore = 4

// gidScore ranks a RoCE GID entry for use: 0 for an empty one, else 1,
// plus 2 for a RoCE v2 (routable, UDP-encapsulated) entry, plus 1 for an
// IPv4-mapped address (what a routed network most likely carries). typ is
// the entry's type as sysfs spells it ("RoCE v2", "IB/RoCE v1"), "" when
// unknown.
func gidScore(g GID, typ string) int {
	if g == (GID{}) {
		return 0
	}
	s := 1
	if strings.EqualFold(strings.TrimSpace(typ), "RoCE v2") {
		s += 2
	}
	if isIPv4Mapped(g) {
		s++
	}
	return s
}

// isIPv4Mapped reports whether g is an IPv4-mapped IPv6 address
// (::ffff:a.b.c.d).
func isIPv4Mapped(g GID) bool {
	for _, b := range g[:10] {
		if b != 0 {
			return false
		}
	}
	return g[10] == 0xff && g[11] == 0xff
}

// gidType reads a GID entry's type from sysfs; "" when unknown.
func gidType(sysfs string, port, idx int) string {
	b, err := os.ReadFile(filepath.Join(sysfs, "ports", strconv.Itoa(port), "gid_attrs", "types", strconv.Itoa(idx)))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// numaNode reads the device's NUMA node from sysfs; -1 when unknown.
func numaNode(sysfs string) int {
	b, err := os.ReadFile(filepath.Join(sysfs, "device", "numa_node"))
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 {
		return -1
	}
	return n
}

// pciBusID returns the PCI bus id ("0000:3b:00.0") that the device's sysfs
// "device" link points at; "" for devices not on PCI (or not found).
func pciBusID(sysfs string) string {
	target, err := filepath.EvalSymlinks(filepath.Join(sysfs, "device"))
	if err != nil {
		return ""
	}
	if id := filepath.Base(target); isPCIBusID(id) {
		return strings.ToLower(id)
	}
	return ""
}

// isPCIBusID reports whether s has the form dddd:bb:dd.f in hex.
func isPCIBusID(s string) bool {
	if len(s) != 12 || s[4] != ':' || s[7] != ':' || s[10] != '.' {
		return false
	}
	for i, c := range []byte(s) {
		if i == 4 || i == 7 || i == 10 {
			continue
		}
		hex := c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F'
		if !hex || i == 11 && c > '7' {
			return false
		}
	}
	return true
}

// mtuBytes converts an enum ibv_mtu to bytes; 0 for unknown values.
func mtuBytes(m uint32) int {
	if m < C.MC_IBV_MTU_256 || m > C.MC_IBV_MTU_4096 {
		return 0
	}
	return 128 << m
}

// mtuEnum converts bytes to the largest enum ibv_mtu that fits them; false
// below 256 bytes.
func mtuEnum(bytes int) (uint32, bool) {
	for m := uint32(C.MC_IBV_MTU_4096); m >= C.MC_IBV_MTU_256; m-- {
		if mtuBytes(m) <= bytes {
			return m, true
		}
	}
	return 0, false
}

// portStateName spells an enum ibv_port_state as ibv_devinfo does.
func portStateName(s uint32) string {
	switch s {
	case C.MC_IBV_PORT_NOP:
		return "NOP"
	case C.MC_IBV_PORT_DOWN:
		return "DOWN"
	case C.MC_IBV_PORT_INIT:
		return "INIT"
	case C.MC_IBV_PORT_ARMED:
		return "ARMED"
	case C.MC_IBV_PORT_ACTIVE:
		return "ACTIVE"
	case C.MC_IBV_PORT_ACTIVE_DEFER:
		return "ACTIVE_DEFER"
	}
	return fmt.Sprintf("in state %d", s)
}

// checkAccess rejects access sets verbs would refuse.
func checkAccess(a Access) error {
	if a&^(AccessLocalWrite|AccessRemoteWrite|AccessRemoteRead) != 0 {
		return fmt.Errorf("rdma: unknown access bits %#x", uint32(a))
	}
	if a&AccessRemoteWrite != 0 && a&AccessLocalWrite == 0 {
		return errors.New("rdma: remote write access needs local write access")
	}
	return nil
}

// verbsDevice is an opened device with its protection domain.
type verbsDevice struct {
	desc devDesc

	mu     sync.Mutex // guards what follows
	ctx    *C.struct_mc_ibv_context
	pd     *C.struct_mc_ibv_pd
	mrs    int // open memory regions
	qps    int // open queue pairs
	closed bool
}

// Info describes the device and the port in use.
func (d *verbsDevice) Info() DeviceInfo { return d.desc.info }

// acquire counts one more MR (or QP, with qp set) and returns the handles
// to create it with; ErrClosed after Close.
func (d *verbsDevice) acquire(qp bool) (*C.struct_mc_ibv_context, *C.struct_mc_ibv_pd, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, nil, ErrClosed
	}
	if qp {
		d.qps++
	} else {
		d.mrs++
	}
	return d.ctx, d.pd, nil
}

// release undoes one acquire.
func (d *verbsDevice) release(qp bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if qp {
		d.qps--
	} else {
		d.mrs--
	}
}

// RegMR registers mem with ibv_reg_mr. The MR's addresses are mem's
// virtual addresses.
func (d *verbsDevice) RegMR(mem []byte, access Access) (MR, error) {
	if len(mem) == 0 {
		return nil, fmt.Errorf("rdma: %s: register memory: empty buffer", d.desc.info.Name)
	}
	if err := checkAccess(access); err != nil {
		return nil, err
	}
	_, pd, err := d.acquire(false)
	if err != nil {
		return nil, err
	}
	var mr *C.struct_mc_ibv_mr
	if e := C.mc_reg_mr(pd, unsafe.Pointer(&mem[0]), C.size_t(len(mem)), C.int(access), &mr); e != 0 {
		d.release(false)
		return nil, fmt.Errorf("rdma: %s: register %d bytes at %p: %w", d.desc.info.Name, len(mem), &mem[0],
			callErr("ibv_reg_mr", e))
	}
	return newMR(d, mr), nil
}

// RegDmabufMR registers part of a dma-buf with ibv_reg_dmabuf_mr, which
// libibverbs has since rdma-core 34; ErrUnavailable where it or the driver
// lacks it.
func (d *verbsDevice) RegDmabufMR(fd int, offset, length, iova uint64, access Access) (MR, error) {
	if fd < 0 {
		return nil, fmt.Errorf("rdma: %s: register dma-buf: bad fd %d", d.desc.info.Name, fd)
	}
	if length == 0 {
		return nil, fmt.Errorf("rdma: %s: register dma-buf: zero length", d.desc.info.Name)
	}
	if err := checkAccess(access); err != nil {
		return nil, err
	}
	if C.mc_have_reg_dmabuf_mr() == 0 {
		return nil, fmt.Errorf("%w: %s: libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or later has it)",
			ErrUnavailable, d.desc.info.Name)
	}
	_, pd, err := d.acquire(false)
	if err != nil {
		return nil, err
	}
	var mr *C.struct_mc_ibv_mr
	e := C.mc_reg_dmabuf_mr(pd, C.uint64_t(offset), C.size_t(length), C.uint64_t(iova), C.int(fd), C.int(access), &mr)
	if e != 0 {
		d.release(false)
		what := fmt.Sprintf("%s: register %d bytes of dma-buf %d at offset %d", d.desc.info.Name, length, fd, offset)
		if unsupported(syscall.Errno(e)) {
			return nil, fmt.Errorf("%w: %s: %w", ErrUnavailable, what, callErr("ibv_reg_dmabuf_mr", e))
		}
		return nil, fmt.Errorf("rdma: %s: %w", what, callErr("ibv_reg_dmabuf_mr", e))
	}
	return newMR(d, mr), nil
}

// CreateQP creates an RC queue pair and a completion queue of depth
// entries for it; at most depth work requests are outstanding at once, so
// the completion queue cannot overflow.
func (d *verbsDevice) CreateQP(depth int) (QP, error) {
	name := d.desc.info.Name
	if depth < 1 {
		return nil, fmt.Errorf("rdma: %s: create QP: depth %d, want at least 1", name, depth)
	}
	if m := d.desc.caps.maxDepth(); m > 0 && depth > m {
		return nil, fmt.Errorf("rdma: %s: create QP: depth %d exceeds the device's %d", name, depth, m)
	}
	if m := d.desc.caps.maxSGE; m > 0 && m < MaxSGE {
		return nil, fmt.Errorf("rdma: %s: create QP: device takes %d SGEs per request, want %d", name, m, MaxSGE)
	}
	ctx, pd, err := d.acquire(true)
	if err != nil {
		return nil, err
	}
	q := &verbsQP{dev: d, depth: depth, psn: rand.Uint32() & 0xffffff}
	fail := func(err error) (QP, error) {
		q.destroy()
		d.release(true)
		return nil, fmt.Errorf("rdma: %s: create QP of depth %d: %w", name, depth, err)
	}
	if e := C.mc_create_cq(ctx, C.int(depth), &q.cq); e != 0 {
		return fail(callErr("ibv_create_cq", e))
	}
	if e := C.mc_create_qp(pd, q.cq, C.uint32_t(depth), MaxSGE, &q.qp); e != 0 {
		return fail(callErr("ibv_create_qp", e))
	}
	q.qpn = uint32(q.qp.qp_num)
	q.reqs = C.calloc(C.size_t(depth), C.size_t(unsafe.Sizeof(C.struct_mc_post_req{})))
	q.wrs = C.calloc(C.size_t(depth), C.size_t(unsafe.Sizeof(C.struct_mc_ibv_send_wr{})))
	q.wcs = C.calloc(C.size_t(depth), C.size_t(unsafe.Sizeof(C.struct_mc_ibv_wc{})))
	if q.reqs == nil || q.wrs == nil || q.wcs == nil {
		return fail(errors.New("out of memory for work request buffers"))
	}
	q.ring = make([]wrSlot, depth)
	q.state.Store(uint32(QPReset))
	return q, nil
}

// Close deallocates the protection domain and closes the device. It
// refuses while memory regions or queue pairs are open; once closed, it
// returns nil.
func (d *verbsDevice) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	if d.mrs > 0 || d.qps > 0 {
		return fmt.Errorf("rdma: close %s: %d memory regions and %d queue pairs still open",
			d.desc.info.Name, d.mrs, d.qps)
	}
	if d.pd != nil {
		if e := C.mc_dealloc_pd(d.pd); e != 0 {
			return fmt.Errorf("rdma: close %s: %w", d.desc.info.Name, callErr("ibv_dealloc_pd", e))
		}
		d.pd = nil
	}
	if e := C.mc_close_device(d.ctx); e != 0 {
		return fmt.Errorf("rdma: close %s: %w", d.desc.info.Name, callErr("ibv_close_device", e))
	}
	d.ctx = nil
	d.closed = true
	return nil
}

// verbsMR is a registered memory region.
type verbsMR struct {
	dev          *verbsDevice
	addr, length uint64
	lkey, rkey   uint32
	mu           sync.Mutex // guards mr
	mr           *C.struct_mc_ibv_mr
}

// newMR wraps a region the library registered.
func newMR(d *verbsDevice, mr *C.struct_mc_ibv_mr) *verbsMR {
	return &verbsMR{
		dev:    d,
		addr:   uint64(uintptr(mr.addr)),
		length: uint64(mr.length),
		lkey:   uint32(mr.lkey),
		rkey:   uint32(mr.rkey),
		mr:     mr,
	}
}

// Addr is the region's first address.
func (m *verbsMR) Addr() uint64 { return m.addr }

// Len is the region's length in bytes.
func (m *verbsMR) Len() uint64 { return m.length }

// LKey is the key local SGEs name the region by.
func (m *verbsMR) LKey() uint32 { return m.lkey }

// RKey is the key a peer's work requests name the region by.
func (m *verbsMR) RKey() uint32 { return m.rkey }

// Close deregisters the region; once closed, it returns nil.
func (m *verbsMR) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mr == nil {
		return nil
	}
	if e := C.mc_dereg_mr(m.mr); e != 0 {
		return fmt.Errorf("rdma: %s: deregister MR lkey %#x: %w", m.dev.desc.info.Name, m.lkey, callErr("ibv_dereg_mr", e))
	}
	m.mr = nil
	m.dev.release(false)
	return nil
}

// wrSlot remembers a posted work request until its completion: verbs
// defines a failed completion's opcode and length as garbage, and the
// package posts its own sequence numbers as wr_id.
type wrSlot struct {
	seq   uint64
	id    uint64
	op    Opcode
	bytes uint32
	live  bool
}

// verbsQP is an RC queue pair with its own completion queue.
//
// Post fills C buffers under postMu, Poll drains into another under
// pollMu, and the ring of outstanding requests that both touch is guarded
// by ringMu. Close takes postMu and then pollMu.
type verbsQP struct {
	dev   *verbsDevice
	depth int
	psn   uint32
	qpn   uint32
	state atomic.Uint32

	postMu  sync.Mutex
	pollMu  sync.Mutex
	ringMu  sync.Mutex
	ring    []wrSlot // by seq % depth; guarded by ringMu
	pending int      // outstanding work requests; guarded by ringMu
	nextSeq uint64   // guarded by postMu

	// Set at creation, cleared by Close with postMu and pollMu held.
	qp     *C.struct_mc_ibv_qp
	cq     *C.struct_mc_ibv_cq
	reqs   unsafe.Pointer // [depth]struct mc_post_req, C memory
	wrs    unsafe.Pointer // [depth]struct mc_ibv_send_wr, C memory
	wcs    unsafe.Pointer // [depth]struct mc_ibv_wc, C memory
	closed bool
}

// where names the QP in errors; built only when one occurs.
func (q *verbsQP) where() string {
	return fmt.Sprintf("rdma: %s: QP %#x", q.dev.desc.info.Name, q.qpn)
}

// Endpoint is what the peer connects to.
func (q *verbsQP) Endpoint() Endpoint {
	i := q.dev.desc.info
	return Endpoint{LID: i.LID, GID: i.GID, QPN: q.qpn, PSN: q.psn, MTU: i.MTU, ReadDepth: q.dev.desc.caps.readDepth()}
}

// readDepth is the RDMA READs a QP of the device serves in flight as the
// responder: the package's limit, or the device's when lower.
func (c devCaps) readDepth() int {
	if c.maxRdAtom > 0 {
		return min(maxRdAtomic, c.maxRdAtom)
	}
	return maxRdAtomic
}

// State is the state the package last moved the QP to, or ERR after a
// failed completion was polled.
func (q *verbsQP) State() QPState { return QPState(q.state.Load()) }

// Connect moves the QP through INIT and RTR to RTS, connected to remote:
// path MTU the smaller of both ends', a GRH when the link is Ethernet or
// remote has a GID, up to 16 RDMA READs in flight each way (less if the
// device allows less), and the retry settings of mc_qp_rts.
func (q *verbsQP) Connect(remote Endpoint) error {
	q.postMu.Lock()
	defer q.postMu.Unlock()
	if q.closed {
		return ErrClosed
	}
	info, caps := q.dev.desc.info, q.dev.desc.caps
	where := fmt.Sprintf("rdma: %s: connect QP %#x to QP %#x", info.Name, q.qpn, remote.QPN)
	if st := q.State(); st != QPReset {
		return fmt.Errorf("%s: QP is %v, not RESET", where, st)
	}
	if remote.QPN == 0 || remote.QPN > 0xffffff {
		return fmt.Errorf("%s: remote QP number is not 24-bit non-zero", where)
	}
	if remote.PSN > 0xffffff {
		return fmt.Errorf("%s: remote PSN %#x is wider than 24 bits", where, remote.PSN)
	}
	mtu, ok := mtuEnum(min(info.MTU, remote.MTU))
	if !ok {
		return fmt.Errorf("%s: path MTU min(%d, %d) is below 256 bytes", where, info.MTU, remote.MTU)
	}
	global := info.LinkLayer == "Ethernet" || remote.GID != (GID{})
	if !global && remote.LID == 0 {
		return fmt.Errorf("%s: remote endpoint has neither LID nor GID", where)
	}
	destRd, initRd := caps.readDepth(), maxRdAtomic
	if caps.maxInitRdAtom > 0 {
		initRd = min(initRd, caps.maxInitRdAtom)
	}
	if remote.ReadDepth > 0 {
		// No more READs in flight than the responder takes.
		initRd = min(initRd, remote.ReadDepth)
	}
	if e := C.mc_qp_init(q.qp, C.uint8_t(info.Port), qpAccess); e != 0 {
		return fmt.Errorf("%s: RESET->INIT: %w", where, callErr("ibv_modify_qp", e))
	}
	q.state.Store(uint32(QPInit))
	isGlobal := 0
	if global {
		isGlobal = 1
	}
	dgid := remote.GID
	if e := C.mc_qp_rtr(q.qp, C.uint32_t(mtu), C.uint32_t(remote.QPN), C.uint32_t(remote.PSN),
		C.uint8_t(destRd), C.uint16_t(remote.LID), C.uint8_t(info.Port), C.int(isGlobal),
		(*C.uint8_t)(unsafe.Pointer(&dgid[0])), C.uint8_t(info.GIDIndex)); e != 0 {
		return fmt.Errorf("%s: INIT->RTR: %w", where, callErr("ibv_modify_qp", e))
	}
	q.state.Store(uint32(QPRTR))
	if e := C.mc_qp_rts(q.qp, C.uint32_t(q.psn), C.uint8_t(initRd)); e != 0 {
		return fmt.Errorf("%s: RTR->RTS: %w", where, callErr("ibv_modify_qp", e))
	}
	q.state.Store(uint32(QPRTS))
	return nil
}

// checkWR returns why w cannot be posted, or nil.
func (q *verbsQP) checkWR(w *WorkRequest) error {
	switch {
	case w.Op != OpWrite && w.Op != OpRead:
		return fmt.Errorf("unknown opcode %d", uint8(w.Op))
	case len(w.Local) == 0:
		return errors.New("no local SGE")
	case len(w.Local) > MaxSGE:
		return fmt.Errorf("%d local SGEs, at most %d", len(w.Local), MaxSGE)
	}
	for i, s := range w.Local {
		if s.Len == 0 {
			return fmt.Errorf("SGE %d has zero length", i)
		}
	}
	n := w.Bytes()
	if m := q.dev.desc.caps.maxMsg; m > 0 && n > m {
		return fmt.Errorf("%d bytes exceed the port's largest message (%d)", n, m)
	}
	if n > 1<<31 {
		return fmt.Errorf("%d bytes exceed 2 GiB", n)
	}
	return nil
}

// Post queues wrs in order with one post_send call. It checks each
// request first; the first that is malformed or does not fit in the
// QP's depth fails the call, and the ones before it are still posted.
func (q *verbsQP) Post(wrs []WorkRequest) error {
	if len(wrs) == 0 {
		return nil
	}
	q.postMu.Lock()
	defer q.postMu.Unlock()
	if q.closed {
		return ErrClosed
	}
	if st := q.State(); st != QPRTS {
		return fmt.Errorf("%s: post: QP is %v, not RTS", q.where(), st)
	}
	q.ringMu.Lock()
	room := q.depth - q.pending
	q.ringMu.Unlock()

	// Completions only make room, so room can only grow meanwhile.
	n := len(wrs)
	var stop error
	for i := range wrs {
		if i >= room {
			n, stop = i, fmt.Errorf("%s: post work request %d (id %d): QP full, %d of %d outstanding",
				q.where(), i, wrs[i].ID, q.depth-room+i, q.depth)
			break
		}
		if err := q.checkWR(&wrs[i]); err != nil {
			n, stop = i, fmt.Errorf("%s: post work request %d (id %d): %w", q.where(), i, wrs[i].ID, err)
			break
		}
	}
	if n == 0 {
		return stop
	}

	reqs := unsafe.Slice((*C.struct_mc_post_req)(q.reqs), q.depth)
	q.ringMu.Lock()
	for i := range n {
		w := &wrs[i]
		seq := q.nextSeq + uint64(i)
		r := &reqs[i]
		r.wr_id = C.uint64_t(seq)
		r.remote_addr = C.uint64_t(w.Remote)
		r.rkey = C.uint32_t(w.RKey)
		r.opcode = C.MC_IBV_WR_RDMA_WRITE
		if w.Op == OpRead {
			r.opcode = C.MC_IBV_WR_RDMA_READ
		}
		r.num_sge = C.int32_t(len(w.Local))
		for j, s := range w.Local {
			r.sge[j] = C.struct_mc_ibv_sge{addr: C.uint64_t(s.Addr), length: C.uint32_t(s.Len), lkey: C.uint32_t(s.LKey)}
		}
		q.ring[seq%uint64(q.depth)] = wrSlot{seq: seq, id: w.ID, op: w.Op, bytes: uint32(w.Bytes()), live: true}
	}
	q.pending += n
	q.ringMu.Unlock()

	var queued C.int
	e := C.mc_post(q.qp, (*C.struct_mc_post_req)(q.reqs), (*C.struct_mc_ibv_send_wr)(q.wrs), C.int(n), &queued)
	if e != 0 {
		k := int(queued)
		q.ringMu.Lock()
		for i := k; i < n; i++ {
			q.ring[(q.nextSeq+uint64(i))%uint64(q.depth)].live = false
		}
		q.pending -= n - k
		q.ringMu.Unlock()
		q.nextSeq += uint64(k)
		return fmt.Errorf("%s: post work request %d (id %d): %w", q.where(), k, wrs[k].ID, callErr("ibv_post_send", e))
	}
	q.nextSeq += uint64(n)
	return stop
}

// Poll takes up to len(out) completions (at most the QP's depth per call)
// without blocking. A failed completion moves State to ERR; the requests
// behind it then complete as flushed.
func (q *verbsQP) Poll(out []Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	q.pollMu.Lock()
	defer q.pollMu.Unlock()
	if q.closed {
		return 0, ErrClosed
	}
	var errno C.int
	r := C.mc_poll(q.cq, (*C.struct_mc_ibv_wc)(q.wcs), C.int(min(len(out), q.depth)), &errno)
	if r < 0 {
		return 0, fmt.Errorf("%s: ibv_poll_cq returned %d: %v", q.where(), int(r), syscall.Errno(errno))
	}
	wcs := unsafe.Slice((*C.struct_mc_ibv_wc)(q.wcs), int(r))
	failed := false
	q.ringMu.Lock()
	defer q.ringMu.Unlock()
	for i := range wcs {
		wc := &wcs[i]
		seq := uint64(wc.wr_id)
		slot := &q.ring[seq%uint64(q.depth)]
		if !slot.live || slot.seq != seq {
			// Cannot happen while the provider is sane: the package
			// posts every wr_id on this QP and its CQ is the QP's own.
			return i, fmt.Errorf("%s: completion for unknown work request %d (status %v)",
				q.where(), seq, Status(wc.status))
		}
		c := Completion{ID: slot.id, Op: slot.op, Status: Status(wc.status), Vendor: uint32(wc.vendor_err)}
		if c.Status == StatusSuccess {
			c.Bytes = slot.bytes
		} else {
			failed = true
		}
		out[i] = c
		slot.live = false
		q.pending--
	}
	if failed {
		q.state.Store(uint32(QPError))
	}
	return int(r), nil
}

// destroy destroys what exists of the QP and its CQ and frees the C
// buffers, stopping at the first failure.
func (q *verbsQP) destroy() error {
	if q.qp != nil {
		if e := C.mc_destroy_qp(q.qp); e != 0 {
			return callErr("ibv_destroy_qp", e)
		}
		q.qp = nil
	}
	if q.cq != nil {
		if e := C.mc_destroy_cq(q.cq); e != 0 {
			return callErr("ibv_destroy_cq", e)
		}
		q.cq = nil
	}
	for _, p := range []*unsafe.Pointer{&q.reqs, &q.wrs, &q.wcs} {
		if *p != nil {
			C.free(*p)
			*p = nil
		}
	}
	return nil
}

// Close destroys the QP and then its CQ; work in flight is lost. Once
// closed, it returns nil.
func (q *verbsQP) Close() error {
	q.postMu.Lock()
	defer q.postMu.Unlock()
	q.pollMu.Lock()
	defer q.pollMu.Unlock()
	if q.closed {
		return nil
	}
	if err := q.destroy(); err != nil {
		return fmt.Errorf("%s: close: %w", q.where(), err)
	}
	q.closed = true
	q.dev.release(true)
	return nil
}
