//go:build cgo

package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

// The few driver API types we use, declared here so that no CUDA header or
// toolkit is needed at build time. Layouts are the driver ABI's.
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;

enum {
	MC_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
	MC_POINTER_ATTRIBUTE_IS_MANAGED = 8,
	MC_MEMORYTYPE_DEVICE = 2,
	MC_STREAM_NON_BLOCKING = 1,
	MC_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
};

static void *mc_lib;
static char mc_err[768];

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDriverGetVersion)(int *);
static CUresult (*p_cuGetErrorString)(CUresult, const char **);
static CUresult (*p_cuGetErrorName)(CUresult, const char **);
static CUresult (*p_cuDeviceGetCount)(int *);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDeviceGetName)(char *, int, CUdevice);
static CUresult (*p_cuDeviceGetUuid)(CUuuid *, CUdevice);
static CUresult (*p_cuDeviceGetPCIBusId)(char *, int, CUdevice);
static CUresult (*p_cuDeviceTotalMem)(size_t *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRelease)(CUdevice);
static CUresult (*p_cuDevicePrimaryCtxGetState)(CUdevice, unsigned int *, int *);
static CUresult (*p_cuCtxGetCurrent)(CUcontext *);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree)(CUdeviceptr);
static CUresult (*p_cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
static CUresult (*p_cuMemHostRegister)(void *, size_t, unsigned int);
static CUresult (*p_cuMemHostUnregister)(void *);
static CUresult (*p_cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*p_cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*p_cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*p_cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*p_cuStreamCreate)(CUstream *, unsigned int);
static CUresult (*p_cuStreamSynchronize)(CUstream);
static CUresult (*p_cuStreamDestroy)(CUstream);
static CUresult (*p_cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
static CUresult (*p_cuIpcOpenMemHandle)(CUdeviceptr *, CUipcMemHandle, unsigned int);
static CUresult (*p_cuIpcCloseMemHandle)(CUdeviceptr);
static CUresult (*p_cuPointerGetAttribute)(void *, int, CUdeviceptr);
// Optional (CUDA 11.7+ drivers): NULL where the driver lacks it.
static CUresult (*p_cuMemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, int, unsigned long long);

// mc_open dlopens path; NULL on success, else the loader's message.
static const char *mc_open(const char *path) {
	dlerror();
	mc_lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (mc_lib == NULL) {
		const char *e = dlerror();
		snprintf(mc_err, sizeof mc_err, "%s", e ? e : "dlopen failed");
		return mc_err;
	}
	return NULL;
}

// mc_resolve looks up every entry point, preferring the versioned name the
// current ABI exports; NULL on success, else which symbol is missing.
static const char *mc_resolve(void) {
	struct { void **dst; const char *name, *alt; } syms[] = {
		{(void **)&p_cuInit, "cuInit", NULL},
		{(void **)&p_cuDriverGetVersion, "cuDriverGetVersion", NULL},
		{(void **)&p_cuGetErrorString, "cuGetErrorString", NULL},
		{(void **)&p_cuGetErrorName, "cuGetErrorName", NULL},
		{(void **)&p_cuDeviceGetCount, "cuDeviceGetCount", NULL},
		{(void **)&p_cuDeviceGet, "cuDeviceGet", NULL},
		{(void **)&p_cuDeviceGetName, "cuDeviceGetName", NULL},
		{(void **)&p_cuDeviceGetUuid, "cuDeviceGetUuid_v2", "cuDeviceGetUuid"},
		{(void **)&p_cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId", NULL},
		{(void **)&p_cuDeviceTotalMem, "cuDeviceTotalMem_v2", NULL},
		{(void **)&p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL},
		{(void **)&p_cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"},
		{(void **)&p_cuDevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState", NULL},
		{(void **)&p_cuCtxGetCurrent, "cuCtxGetCurrent", NULL},
		{(void **)&p_cuCtxSetCurrent, "cuCtxSetCurrent", NULL},
		{(void **)&p_cuMemAlloc, "cuMemAlloc_v2", NULL},
		{(void **)&p_cuMemFree, "cuMemFree_v2", NULL},
		{(void **)&p_cuMemGetAddressRange, "cuMemGetAddressRange_v2", NULL},
		{(void **)&p_cuMemHostRegister, "cuMemHostRegister_v2", "cuMemHostRegister"},
		{(void **)&p_cuMemHostUnregister, "cuMemHostUnregister", NULL},
		{(void **)&p_cuMemcpyHtoD, "cuMemcpyHtoD_v2", NULL},
		{(void **)&p_cuMemcpyDtoH, "cuMemcpyDtoH_v2", NULL},
		{(void **)&p_cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", NULL},
		{(void **)&p_cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", NULL},
		{(void **)&p_cuStreamCreate, "cuStreamCreate", NULL},
		{(void **)&p_cuStreamSynchronize, "cuStreamSynchronize", NULL},
		{(void **)&p_cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy"},
		{(void **)&p_cuIpcGetMemHandle, "cuIpcGetMemHandle", NULL},
		{(void **)&p_cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"},
		{(void **)&p_cuIpcCloseMemHandle, "cuIpcCloseMemHandle", NULL},
		{(void **)&p_cuPointerGetAttribute, "cuPointerGetAttribute", NULL},
	};
	for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
		void *f = dlsym(mc_lib, syms[i].name);
		if (f == NULL && syms[i].alt != NULL)
			f = dlsym(mc_lib, syms[i].alt);
		if (f == NULL) {
			snprintf(mc_err, sizeof mc_err, "missing symbol %s", syms[i].name);
			return mc_err;
		}
		*syms[i].dst = f;
	}
	p_cuMemGetHandleForAddressRange = dlsym(mc_lib, "cuMemGetHandleForAddressRange");
	return NULL;
}

static const char *mc_errname(CUresult r) {
	const char *s = NULL;
	if (p_cuGetErrorName == NULL || p_cuGetErrorName(r, &s) != 0)
		return NULL;
	return s;
}

static const char *mc_errstr(CUresult r) {
	const char *s = NULL;
	if (p_cuGetErrorString == NULL || p_cuGetErrorString(r, &s) != 0)
		return NULL;
	return s;
}

// MC_IN runs call with ctx current on this thread and puts back whatever
// was current before. A cgo call stays on one OS thread, so the switch
// cannot leak to another goroutine and callers need no LockOSThread.
#define MC_IN(ctx, call) do { \
	CUcontext prev_ = NULL; \
	CUresult r_ = p_cuCtxGetCurrent(&prev_); \
	if (r_ != 0) return r_; \
	if (prev_ != (ctx)) { \
		r_ = p_cuCtxSetCurrent(ctx); \
		if (r_ != 0) return r_; \
	} \
	r_ = (call); \
	if (prev_ != (ctx)) p_cuCtxSetCurrent(prev_); \
	return r_; \
} while (0)

static CUresult mc_init(void) { return p_cuInit(0); }
static CUresult mc_driverVersion(int *v) { return p_cuDriverGetVersion(v); }
static CUresult mc_deviceCount(int *n) { return p_cuDeviceGetCount(n); }
static CUresult mc_deviceGet(CUdevice *d, int ordinal) { return p_cuDeviceGet(d, ordinal); }
static CUresult mc_deviceName(char *buf, int n, CUdevice d) { return p_cuDeviceGetName(buf, n, d); }
static CUresult mc_deviceUuid(unsigned char *out, CUdevice d) {
	CUuuid u;
	CUresult r = p_cuDeviceGetUuid(&u, d);
	if (r == 0) memcpy(out, u.bytes, sizeof u.bytes);
	return r;
}
static CUresult mc_deviceBusId(char *buf, int n, CUdevice d) { return p_cuDeviceGetPCIBusId(buf, n, d); }
static CUresult mc_deviceTotalMem(size_t *n, CUdevice d) { return p_cuDeviceTotalMem(n, d); }
static CUresult mc_primaryRetain(CUcontext *c, CUdevice d) { return p_cuDevicePrimaryCtxRetain(c, d); }
static CUresult mc_primaryRelease(CUdevice d) { return p_cuDevicePrimaryCtxRelease(d); }
static CUresult mc_setCurrent(CUcontext c) { return p_cuCtxSetCurrent(c); }

static CUresult mc_memAlloc(CUcontext c, CUdeviceptr *p, size_t n) { MC_IN(c, p_cuMemAlloc(p, n)); }
static CUresult mc_memFree(CUcontext c, CUdeviceptr p) { MC_IN(c, p_cuMemFree(p)); }
static CUresult mc_addressRange(CUcontext c, CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	MC_IN(c, p_cuMemGetAddressRange(base, size, p));
}
static CUresult mc_hostRegister(CUcontext c, void *p, size_t n, unsigned int flags) {
	MC_IN(c, p_cuMemHostRegister(p, n, flags));
}
static CUresult mc_hostUnregister(CUcontext c, void *p) { MC_IN(c, p_cuMemHostUnregister(p)); }
static CUresult mc_copyHtoD(CUcontext c, CUdeviceptr dst, const void *src, size_t n) {
	MC_IN(c, p_cuMemcpyHtoD(dst, src, n));
}
static CUresult mc_copyDtoH(CUcontext c, void *dst, CUdeviceptr src, size_t n) {
	MC_IN(c, p_cuMemcpyDtoH(dst, src, n));
}
static CUresult mc_copyHtoDAsync(CUcontext c, CUdeviceptr dst, const void *src, size_t n, CUstream s) {
	MC_IN(c, p_cuMemcpyHtoDAsync(dst, src, n, s));
}
static CUresult mc_copyDtoHAsync(CUcontext c, void *dst, CUdeviceptr src, size_t n, CUstream s) {
	MC_IN(c, p_cuMemcpyDtoHAsync(dst, src, n, s));
}
static CUresult mc_streamCreate(CUcontext c, CUstream *s) {
	MC_IN(c, p_cuStreamCreate(s, MC_STREAM_NON_BLOCKING));
}
static CUresult mc_streamSync(CUcontext c, CUstream s) { MC_IN(c, p_cuStreamSynchronize(s)); }
// mc_sleep sleeps ns nanoseconds with this thread's timer slack (50 us by
// default, by which the kernel may wake it late) lowered to 1 us for the
// time.
static void mc_sleep(long long ns) {
	if (ns <= 0) return;
	int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
	prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
	struct timespec ts = { ns / 1000000000LL, ns % 1000000000LL }, rem;
	while (nanosleep(&ts, &rem) != 0) ts = rem;
	if (slack > 0) prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
}
static CUresult mc_streamSyncAfter(CUcontext c, CUstream s, long long ns) {
	mc_sleep(ns);
	MC_IN(c, p_cuStreamSynchronize(s));
}
static CUresult mc_streamDestroy(CUcontext c, CUstream s) { MC_IN(c, p_cuStreamDestroy(s)); }
static CUresult mc_ipcGetRaw(CUipcMemHandle *h, CUdeviceptr p) { return p_cuIpcGetMemHandle(h, p); }
static CUresult mc_ipcGetIn(CUcontext c, CUipcMemHandle *h, CUdeviceptr p) { MC_IN(c, mc_ipcGetRaw(h, p)); }
static CUresult mc_ipcGet(CUcontext c, unsigned char *out, CUdeviceptr p) {
	CUipcMemHandle h;
	memset(&h, 0, sizeof h);
	CUresult r = mc_ipcGetIn(c, &h, p);
	if (r == 0) memcpy(out, h.reserved, sizeof h.reserved);
	return r;
}
static CUresult mc_ipcOpen(CUcontext c, CUdeviceptr *p, const unsigned char *in) {
	CUipcMemHandle h;
	memcpy(h.reserved, in, sizeof h.reserved);
	MC_IN(c, p_cuIpcOpenMemHandle(p, h, MC_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
}
static CUresult mc_ipcClose(CUcontext c, CUdeviceptr p) { MC_IN(c, p_cuIpcCloseMemHandle(p)); }

// mc_dmabuf exports [p, p+n) as a dma-buf fd (CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
// is 1); CUDA_ERROR_NOT_SUPPORTED (801) where the driver has no such call.
static CUresult mc_dmabufRaw(int *fd, CUdeviceptr p, size_t n) {
	if (p_cuMemGetHandleForAddressRange == NULL)
		return 801;
	return p_cuMemGetHandleForAddressRange(fd, p, n, 1, 0);
}
static CUresult mc_dmabuf(CUcontext c, int *fd, CUdeviceptr p, size_t n) { MC_IN(c, mc_dmabufRaw(fd, p, n)); }

// mc_ptrAttrs reads the memory type of p and, for device memory, whether it
// is managed. Both outputs are zeroed 8-byte words so either attribute width
// (enum, unsigned int or bool) reads back the same.
static CUresult mc_ptrAttrs(CUdeviceptr p, unsigned long long *memType, unsigned long long *managed) {
	*memType = 0;
	*managed = 0;
	CUresult r = p_cuPointerGetAttribute(memType, MC_POINTER_ATTRIBUTE_MEMORY_TYPE, p);
	if (r == 0 && *memType == MC_MEMORYTYPE_DEVICE)
		r = p_cuPointerGetAttribute(managed, MC_POINTER_ATTRIBUTE_IS_MANAGED, p);
	return r;
}
static CUresult mc_ptrAttrsIn(CUcontext c, CUdeviceptr p, unsigned long long *memType, unsigned long long *managed) {
	MC_IN(c, mc_ptrAttrs(p, memType, managed));
}

// mc_ptrAttrsAnyCtx asks again with the first active primary context made
// current, for threads that have none. *found is 0 when no primary context
// is active anywhere in the process.
static CUresult mc_ptrAttrsAnyCtx(CUdeviceptr p, unsigned long long *memType, unsigned long long *managed, int *found) {
	int n = 0;
	*found = 0;
	CUresult r = p_cuDeviceGetCount(&n);
	if (r != 0) return r;
	for (int i = 0; i < n; i++) {
		CUdevice d;
		unsigned int flags = 0;
		int active = 0;
		CUcontext c = NULL;
		if (p_cuDeviceGet(&d, i) != 0) continue;
		if (p_cuDevicePrimaryCtxGetState(d, &flags, &active) != 0 || !active) continue;
		if (p_cuDevicePrimaryCtxRetain(&c, d) != 0) continue;
		*found = 1;
		r = mc_ptrAttrsIn(c, p, memType, managed);
		p_cuDevicePrimaryCtxRelease(d);
		return r;
	}
	return 0;
}
*/
import "C"

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// Where libcuda.so.1 is looked for when the dynamic loader's own search
// (ld.so.cache, LD_LIBRARY_PATH) does not find it: container runtimes mount
// the driver's libraries into one of these without always telling ldconfig.
var libcudaFallbacks = []string{
	"/usr/local/nvidia/lib64/libcuda.so.1",
	"/usr/lib/x86_64-linux-gnu/libcuda.so.1",
	"/usr/lib64/libcuda.so.1",
	"/usr/lib/aarch64-linux-gnu/libcuda.so.1",
}

// CUDA_ERROR_CONTEXT_IS_DESTROYED: the thread's current context is gone.
const resultContextIsDestroyed = 709

var lib struct {
	once sync.Once
	err  error
	path string
}

// Init loads libcuda.so.1 and calls cuInit, once per process. Later calls
// return the first call's result. Every other function calls it, so calling
// it first is only needed to learn early why CUDA is unavailable.
func Init() error {
	lib.once.Do(func() { lib.err = load() })
	return lib.err
}

func load() error {
	var paths []string
	if p := os.Getenv(LibraryEnv); p != "" {
		paths = []string{p}
	} else {
		paths = []string{"libcuda.so.1"}
		for _, p := range libcudaFallbacks {
			if _, err := os.Stat(p); err == nil {
				paths = append(paths, p)
			}
		}
	}
	var msgs []string
	for _, p := range paths {
		cp := C.CString(p)
		msg := C.mc_open(cp)
		C.free(unsafe.Pointer(cp))
		if msg == nil {
			lib.path = p
			break
		}
		msgs = append(msgs, "dlopen "+C.GoString(msg))
	}
	if lib.path == "" {
		return fmt.Errorf("%w: %s", ErrUnavailable, strings.Join(msgs, "; "))
	}
	if msg := C.mc_resolve(); msg != nil {
		return fmt.Errorf("%w: %s: %s", ErrUnavailable, lib.path, C.GoString(msg))
	}
	if r := C.mc_init(); r != 0 {
		return fmt.Errorf("%w: %s: %w", ErrUnavailable, lib.path, newResult("cuInit", r))
	}
	return nil
}

func newResult(fn string, r C.CUresult) *Result {
	return &Result{
		Func:    fn,
		Code:    int(r),
		Name:    C.GoString(C.mc_errname(r)),
		Message: C.GoString(C.mc_errstr(r)),
	}
}

// Available reports whether the driver is loaded and initialized (it calls
// Init). When false, every function returns an error wrapping ErrUnavailable.
func Available() bool { return Init() == nil }

// Library returns the path libcuda was loaded from, or "" if it was not.
func Library() string {
	if Init() != nil {
		return ""
	}
	return lib.path
}

// DriverVersion returns the CUDA version the driver supports, as
// 1000*major + 10*minor (13000 for CUDA 13.0).
func DriverVersion() (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	var v C.int
	if r := C.mc_driverVersion(&v); r != 0 {
		return 0, fmt.Errorf("cuda: driver version: %w", newResult("cuDriverGetVersion", r))
	}
	return int(v), nil
}

// DeviceCount returns the number of CUDA devices visible to this process.
func DeviceCount() (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	var n C.int
	if r := C.mc_deviceCount(&n); r != 0 {
		return 0, fmt.Errorf("cuda: device count: %w", newResult("cuDeviceGetCount", r))
	}
	return int(n), nil
}

// Devices describes every visible device, in ordinal order. It creates no
// context and allocates no device memory.
func Devices() ([]Device, error) {
	n, err := DeviceCount()
	if err != nil {
		return nil, err
	}
	devs := make([]Device, 0, n)
	for i := range n {
		d, err := deviceInfo(i)
		if err != nil {
			return nil, err
		}
		devs = append(devs, d)
	}
	return devs, nil
}

func deviceInfo(ordinal int) (Device, error) {
	var dev C.CUdevice
	if r := C.mc_deviceGet(&dev, C.int(ordinal)); r != 0 {
		return Device{}, fmt.Errorf("cuda: device %d: %w", ordinal, newResult("cuDeviceGet", r))
	}
	var name [256]C.char
	if r := C.mc_deviceName(&name[0], C.int(len(name)), dev); r != 0 {
		return Device{}, fmt.Errorf("cuda: device %d name: %w", ordinal, newResult("cuDeviceGetName", r))
	}
	var uuid [16]byte
	if r := C.mc_deviceUuid((*C.uchar)(unsafe.Pointer(&uuid[0])), dev); r != 0 {
		return Device{}, fmt.Errorf("cuda: device %d uuid: %w", ordinal, newResult("cuDeviceGetUuid_v2", r))
	}
	var bus [64]C.char
	if r := C.mc_deviceBusId(&bus[0], C.int(len(bus)), dev); r != 0 {
		return Device{}, fmt.Errorf("cuda: device %d PCI bus id: %w", ordinal, newResult("cuDeviceGetPCIBusId", r))
	}
	var mem C.size_t
	if r := C.mc_deviceTotalMem(&mem, dev); r != 0 {
		return Device{}, fmt.Errorf("cuda: device %d memory: %w", ordinal, newResult("cuDeviceTotalMem_v2", r))
	}
	return Device{
		Ordinal:     ordinal,
		Name:        C.GoString(&name[0]),
		UUID:        formatUUID(uuid),
		PCIBusID:    normalizeBusID(C.GoString(&bus[0])),
		MemoryBytes: uint64(mem),
	}, nil
}

// Context is a retained reference to a device's primary context, the one
// the CUDA runtime (and so PyTorch) uses too: memory allocated and IPC
// handles opened through it are shared with them.
//
// Every method makes the context current for the length of its one driver
// call, on the calling thread, and puts back what was current before; no
// method needs the caller to lock its OS thread. Methods are safe for
// concurrent use. Release must not race with other calls on the same
// Context (like closing a file while reading it).
type Context struct {
	ordinal  int
	dev      C.CUdevice
	h        C.CUcontext
	released atomic.Bool
}

// Retain takes a reference on the primary context of device ordinal,
// creating the context if no one holds it yet (that costs some hundred
// milliseconds and a few hundred MiB of device memory, once per process).
// Pair it with Release.
func Retain(ordinal int) (*Context, error) {
	n, err := DeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("cuda: retain device %d of %d: %w", ordinal, n, ErrInvalid)
	}
	var dev C.CUdevice
	if r := C.mc_deviceGet(&dev, C.int(ordinal)); r != 0 {
		return nil, fmt.Errorf("cuda: retain device %d: %w", ordinal, newResult("cuDeviceGet", r))
	}
	var h C.CUcontext
	if r := C.mc_primaryRetain(&h, dev); r != 0 {
		return nil, fmt.Errorf("cuda: retain device %d: %w", ordinal, newResult("cuDevicePrimaryCtxRetain", r))
	}
	return &Context{ordinal: ordinal, dev: dev, h: h}, nil
}

// check answers why c cannot be used, or nil.
func (c *Context) check() error {
	if c == nil || c.h == nil {
		if err := Init(); err != nil {
			return err
		}
		return fmt.Errorf("cuda: nil context: %w", ErrInvalid)
	}
	if c.released.Load() {
		return fmt.Errorf("cuda: device %d context: %w", c.ordinal, ErrClosed)
	}
	return nil
}

// Ordinal returns the device ordinal of the context (-1 for nil).
func (c *Context) Ordinal() int {
	if c == nil {
		return -1
	}
	return c.ordinal
}

// Release drops the reference taken by Retain. When the last reference in
// the process goes (the runtime holds its own while it uses the device),
// the driver destroys the context with every allocation, stream, IPC
// mapping and registration made in it: close and free them first. A
// second Release does nothing.
func (c *Context) Release() error {
	if c == nil || c.h == nil {
		return c.check()
	}
	if c.released.Swap(true) {
		return nil
	}
	if r := C.mc_primaryRelease(c.dev); r != 0 {
		return fmt.Errorf("cuda: release device %d: %w", c.ordinal, newResult("cuDevicePrimaryCtxRelease_v2", r))
	}
	return nil
}

// MakeCurrent binds the context to the calling OS thread, for code outside
// this package that calls the driver on the same thread. It means something
// only to a goroutine that has called runtime.LockOSThread and stays
// locked: otherwise the goroutine may run on another thread next. This
// package's own methods never need it.
func (c *Context) MakeCurrent() error {
	if err := c.check(); err != nil {
		return err
	}
	if r := C.mc_setCurrent(c.h); r != 0 {
		return fmt.Errorf("cuda: make device %d context current: %w", c.ordinal, newResult("cuCtxSetCurrent", r))
	}
	return nil
}

// HostRegister page-locks mem and maps it for DMA (cuMemHostRegister), so
// copies between it and any device run at PCIe line rate and async copies
// are really asynchronous. Use HostRegisterPortable so every context sees
// it as pinned.
//
// mem must come from mmap (a pinned.Region, a mapped memfd), never the Go
// heap or stack: the driver keeps its address after the call, and the Go
// runtime may free or move such memory. It must stay mapped until
// HostUnregister. Registering pages already registered fails with
// ResultHostMemoryAlreadyRegistered; register each mapping once, whole.
func (c *Context) HostRegister(mem []byte, flags HostRegisterFlags) error {
	if err := c.check(); err != nil {
		return err
	}
	if len(mem) == 0 {
		return fmt.Errorf("cuda: host register 0 B: %w", ErrInvalid)
	}
	p := unsafe.Pointer(unsafe.SliceData(mem))
	if r := C.mc_hostRegister(c.h, p, C.size_t(len(mem)), C.uint(flags)); r != 0 {
		return fmt.Errorf("cuda: host register %d B at %p flags %#x: %w", len(mem), p, uint32(flags), newResult("cuMemHostRegister_v2", r))
	}
	return nil
}

// HostUnregister undoes HostRegister; mem must start where the registered
// range started. Copies using the memory must have finished.
func (c *Context) HostUnregister(mem []byte) error {
	if err := c.check(); err != nil {
		return err
	}
	if len(mem) == 0 {
		return fmt.Errorf("cuda: host unregister 0 B: %w", ErrInvalid)
	}
	p := unsafe.Pointer(unsafe.SliceData(mem))
	if r := C.mc_hostUnregister(c.h, p); r != 0 {
		return fmt.Errorf("cuda: host unregister %d B at %p: %w", len(mem), p, newResult("cuMemHostUnregister", r))
	}
	return nil
}

// MemAlloc allocates n bytes of device memory (cuMemAlloc). The caller
// owns it and frees it with MemFree before Release.
func (c *Context) MemAlloc(n uint64) (DevicePtr, error) {
	if err := c.check(); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, fmt.Errorf("cuda: alloc 0 B: %w", ErrInvalid)
	}
	var p C.CUdeviceptr
	if r := C.mc_memAlloc(c.h, &p, C.size_t(n)); r != 0 {
		return 0, fmt.Errorf("cuda: alloc %d B on device %d: %w", n, c.ordinal, newResult("cuMemAlloc_v2", r))
	}
	return DevicePtr(p), nil
}

// MemFree frees memory from MemAlloc.
func (c *Context) MemFree(p DevicePtr) error {
	if err := c.check(); err != nil {
		return err
	}
	if r := C.mc_memFree(c.h, C.CUdeviceptr(p)); r != 0 {
		return fmt.Errorf("cuda: free %#x on device %d: %w", uint64(p), c.ordinal, newResult("cuMemFree_v2", r))
	}
	return nil
}

// AddressRange returns the allocation that contains p: its base and size.
func (c *Context) AddressRange(p DevicePtr) (base DevicePtr, size uint64, err error) {
	if err := c.check(); err != nil {
		return 0, 0, err
	}
	var b C.CUdeviceptr
	var n C.size_t
	if r := C.mc_addressRange(c.h, &b, &n, C.CUdeviceptr(p)); r != 0 {
		return 0, 0, fmt.Errorf("cuda: address range of %#x: %w", uint64(p), newResult("cuMemGetAddressRange_v2", r))
	}
	return DevicePtr(b), uint64(n), nil
}

// IpcGetHandle exports the allocation containing p (which must be the base
// of a cuMemAlloc/cudaMalloc allocation) for other processes to open.
func (c *Context) IpcGetHandle(p DevicePtr) ([IpcHandleSize]byte, error) {
	var h [IpcHandleSize]byte
	if err := c.check(); err != nil {
		return h, err
	}
	if r := C.mc_ipcGet(c.h, (*C.uchar)(unsafe.Pointer(&h[0])), C.CUdeviceptr(p)); r != 0 {
		return h, fmt.Errorf("cuda: ipc handle of %#x: %w", uint64(p), newResult("cuIpcGetMemHandle", r))
	}
	return h, nil
}

// IpcOpen maps another process's allocation, exported with IpcGetHandle
// (or cudaIpcGetMemHandle), into this context and returns its base here.
// The driver refuses handles exported by this same process. The mapping
// stays valid after the exporter frees or exits only until IpcClose; close
// every mapping once, and before Release.
func (c *Context) IpcOpen(handle [IpcHandleSize]byte) (DevicePtr, error) {
	if err := c.check(); err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	if r := C.mc_ipcOpen(c.h, &p, (*C.uchar)(unsafe.Pointer(&handle[0]))); r != 0 {
		return 0, fmt.Errorf("cuda: ipc open on device %d: %w", c.ordinal, newResult("cuIpcOpenMemHandle_v2", r))
	}
	return DevicePtr(p), nil
}

// IpcClose unmaps memory opened with IpcOpen (p is what IpcOpen returned).
func (c *Context) IpcClose(p DevicePtr) error {
	if err := c.check(); err != nil {
		return err
	}
	if r := C.mc_ipcClose(c.h, C.CUdeviceptr(p)); r != 0 {
		return fmt.Errorf("cuda: ipc close %#x: %w", uint64(p), newResult("cuIpcCloseMemHandle", r))
	}
	return nil
}

// ExportDmabuf exports n bytes of device memory at p (page-aligned, in
// one allocation or IPC mapping) as a dma-buf file descriptor, which an
// RDMA device can register (GPUDirect RDMA); the caller closes it. Drivers
// before CUDA 11.7, and GPUs or kernel modules without dma-buf support,
// answer with an error (CUDA_ERROR_NOT_SUPPORTED).
func (c *Context) ExportDmabuf(p DevicePtr, n uint64) (int, error) {
	if err := c.check(); err != nil {
		return -1, err
	}
	var fd C.int = -1
	if r := C.mc_dmabuf(c.h, &fd, C.CUdeviceptr(p), C.size_t(n)); r != 0 {
		return -1, fmt.Errorf("cuda: dma-buf of %#x+%d: %w", uint64(p), n, newResult("cuMemGetHandleForAddressRange", r))
	}
	return int(fd), nil
}

// CopyHtoD copies src to device memory at dst and returns when done. src
// may be any memory, pageable included (the driver stages pageable memory
// through its own pinned buffers, at a fraction of the line rate).
func (c *Context) CopyHtoD(dst DevicePtr, src []byte) error {
	if err := c.check(); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	if r := C.mc_copyHtoD(c.h, C.CUdeviceptr(dst), unsafe.Pointer(unsafe.SliceData(src)), C.size_t(len(src))); r != 0 {
		return fmt.Errorf("cuda: copy %d B host to device %#x: %w", len(src), uint64(dst), newResult("cuMemcpyHtoD_v2", r))
	}
	return nil
}

// CopyDtoH copies len(dst) bytes from device memory at src into dst and
// returns when done. dst may be any memory.
func (c *Context) CopyDtoH(dst []byte, src DevicePtr) error {
	if err := c.check(); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	if r := C.mc_copyDtoH(c.h, unsafe.Pointer(unsafe.SliceData(dst)), C.CUdeviceptr(src), C.size_t(len(dst))); r != 0 {
		return fmt.Errorf("cuda: copy %d B device %#x to host: %w", len(dst), uint64(src), newResult("cuMemcpyDtoH_v2", r))
	}
	return nil
}

// Stream is a CUDA stream of one context, created non-blocking (it does
// not wait on the legacy default stream). Work on one stream runs in
// order; use one stream per concurrent pipeline. Safe for concurrent use
// except Close, which must not race with other calls.
type Stream struct {
	ctx    *Context
	h      C.CUstream
	closed atomic.Bool
}

// NewStream creates a stream in c. Close it before releasing c.
func (c *Context) NewStream() (*Stream, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	var h C.CUstream
	if r := C.mc_streamCreate(c.h, &h); r != 0 {
		return nil, fmt.Errorf("cuda: new stream on device %d: %w", c.ordinal, newResult("cuStreamCreate", r))
	}
	return &Stream{ctx: c, h: h}, nil
}

func (s *Stream) check() error {
	if s == nil || s.ctx == nil {
		if err := Init(); err != nil {
			return err
		}
		return fmt.Errorf("cuda: nil stream: %w", ErrInvalid)
	}
	if s.closed.Load() {
		return fmt.Errorf("cuda: stream on device %d: %w", s.ctx.ordinal, ErrClosed)
	}
	return s.ctx.check()
}

// Context returns the context the stream belongs to.
func (s *Stream) Context() *Context {
	if s == nil {
		return nil
	}
	return s.ctx
}

// Sync waits until all work queued on the stream has finished, and
// reports the first asynchronous error of that work.
func (s *Stream) Sync() error {
	if err := s.check(); err != nil {
		return err
	}
	if r := C.mc_streamSync(s.ctx.h, s.h); r != 0 {
		return fmt.Errorf("cuda: sync stream on device %d: %w", s.ctx.ordinal, newResult("cuStreamSynchronize", r))
	}
	return nil
}

// SyncAfter is Sync after sleeping for d: a wait expected to take longer
// than d spends d without a CPU, where Sync alone keeps one polling for
// all of it (a sleep the kernel times to about a microsecond, where a
// blocking-sync event costs tens in its wake-up). A d of 0 or less is
// Sync.
func (s *Stream) SyncAfter(d time.Duration) error {
	if err := s.check(); err != nil {
		return err
	}
	if r := C.mc_streamSyncAfter(s.ctx.h, s.h, C.longlong(max(d, 0))); r != 0 {
		return fmt.Errorf("cuda: sync stream on device %d: %w", s.ctx.ordinal, newResult("cuStreamSynchronize", r))
	}
	return nil
}

// Close destroys the stream. Queued work still completes; memory it uses
// must stay valid until then (Sync first). A second Close does nothing.
func (s *Stream) Close() error {
	if s == nil || s.ctx == nil {
		return s.check()
	}
	if s.closed.Swap(true) {
		return nil
	}
	if err := s.ctx.check(); err != nil {
		return err
	}
	if r := C.mc_streamDestroy(s.ctx.h, s.h); r != 0 {
		return fmt.Errorf("cuda: close stream on device %d: %w", s.ctx.ordinal, newResult("cuStreamDestroy_v2", r))
	}
	return nil
}

// CopyHtoDAsync queues a copy of src to device memory at dst on s and
// returns at once. src must be registered (HostRegister) memory: the copy
// reads it after this call returns, so it must stay mapped and unchanged
// until s.Sync. (From pageable memory the driver copies synchronously
// instead, at pageable speed.)
func CopyHtoDAsync(dst DevicePtr, src []byte, s *Stream) error {
	if err := s.check(); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	if r := C.mc_copyHtoDAsync(s.ctx.h, C.CUdeviceptr(dst), unsafe.Pointer(unsafe.SliceData(src)), C.size_t(len(src)), s.h); r != 0 {
		return fmt.Errorf("cuda: copy %d B host to device %#x async: %w", len(src), uint64(dst), newResult("cuMemcpyHtoDAsync_v2", r))
	}
	return nil
}

// CopyDtoHAsync queues a copy of len(dst) bytes from device memory at src
// into dst on s and returns at once. dst must be registered memory that
// stays mapped, and is not read, until s.Sync.
func CopyDtoHAsync(dst []byte, src DevicePtr, s *Stream) error {
	if err := s.check(); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	if r := C.mc_copyDtoHAsync(s.ctx.h, unsafe.Pointer(unsafe.SliceData(dst)), C.CUdeviceptr(src), C.size_t(len(dst)), s.h); r != 0 {
		return fmt.Errorf("cuda: copy %d B device %#x to host async: %w", len(dst), uint64(src), newResult("cuMemcpyDtoHAsync_v2", r))
	}
	return nil
}

// PointerIsDevice reports whether addr, an address in this process, points
// into device memory (CU_POINTER_ATTRIBUTE_MEMORY_TYPE is DEVICE and the
// memory is not managed). Host memory, registered or not, and managed
// memory (which the CPU can read) answer false. Use it to refuse device
// pointers handed to host-memory paths. If no context is current on the
// calling thread it asks through the first active primary context; with
// none active in the process there is no device memory to find.
func PointerIsDevice(addr uintptr) (bool, error) {
	if err := Init(); err != nil {
		return false, err
	}
	var memType, managed C.ulonglong
	r := C.mc_ptrAttrs(C.CUdeviceptr(addr), &memType, &managed)
	if r == ResultInvalidContext || r == resultContextIsDestroyed {
		// No usable context current on this thread.
		var found C.int
		r = C.mc_ptrAttrsAnyCtx(C.CUdeviceptr(addr), &memType, &managed, &found)
		if r == 0 && found == 0 {
			return false, nil
		}
	}
	switch r {
	case 0:
		return memType == C.MC_MEMORYTYPE_DEVICE && managed == 0, nil
	case ResultInvalidValue:
		// Memory CUDA does not know: ordinary host memory.
		return false, nil
	}
	return false, fmt.Errorf("cuda: pointer attributes of %#x: %w", addr, newResult("cuPointerGetAttribute", r))
}
