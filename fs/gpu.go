package fs

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

var (
	errNoGPU    = errors.New("fs: no such GPU")
	errDevRange = errors.New("fs: range outside the GPU allocation")
)

// gpus holds one retained primary context per GPU that a request named.
type gpus struct {
	mu     sync.Mutex
	ctxs   map[int]*cuda.Context
	byUUID map[[16]byte]int // device UUID -> CUDA ordinal, looked up once
}

// context returns the context of the GPU with raw UUID id (all zero: GPU 0).
func (f *FS) gpuContext(id [16]byte) (*cuda.Context, error) {
	if err := cuda.Init(); err != nil {
		return nil, err
	}
	g := &f.gpus
	g.mu.Lock()
	defer g.mu.Unlock()
	ordinal := 0
	if id != ([16]byte{}) {
		o, ok := g.byUUID[id]
		if !ok {
			devs, err := cuda.Devices()
			if err != nil {
				return nil, err
			}
			o = -1
			want := hex.EncodeToString(id[:])
			for _, d := range devs {
				if strings.ReplaceAll(strings.TrimPrefix(d.UUID, "GPU-"), "-", "") == want {
					o = d.Ordinal
				}
			}
			if o < 0 {
				return nil, fmt.Errorf("uuid %s: %w", want, errNoGPU)
			}
			if g.byUUID == nil {
				g.byUUID = map[[16]byte]int{}
			}
			g.byUUID[id] = o
		}
		ordinal = o
	}
	if c, ok := g.ctxs[ordinal]; ok {
		return c, nil
	}
	c, err := cuda.Retain(ordinal)
	if err != nil {
		return nil, err
	}
	if g.ctxs == nil {
		g.ctxs = map[int]*cuda.Context{}
	}
	g.ctxs[ordinal] = c
	return c, nil
}

func (f *FS) closeGPUs() {
	g := &f.gpus
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, c := range g.ctxs {
		if err := c.Release(); err != nil {
			f.log.WithError(err).Warn("release CUDA context")
		}
	}
	g.ctxs = nil
}

// ipcMapping is an opened CUDA IPC handle: the whole allocation.
type ipcMapping struct {
	ctx  *cuda.Context
	base cuda.DevicePtr
	size uint64
	key  ipcKey
	refs int    // guarded by ipcTable.mu
	rdma func() // releases its RDMA registration; nil when none
}

type ipcKey struct {
	ctx    *cuda.Context
	handle [64]byte
}

// ipcTable is the daemon-wide set of opened IPC handles. The driver maps
// one handle once per context, and small tensors of one process share an
// allocation, so every open file that names the handle shares one mapping,
// closed when the last of them lets go.
type ipcTable struct {
	mu sync.Mutex
	m  map[ipcKey]*ipcMapping
	// register is Options.RegisterDevice; failed is set once the driver
	// could not export a dma-buf, after which nothing more is tried.
	register func(fd int, dev, n uint64) (func(), error)
	failed   bool
	logged   bool
	// dmabufLogged is set once a client's dma-buf failed to register.
	dmabufLogged bool
	// log reports the first failure of each kind; noExport: the driver
	// exported no dma-buf of an opened mapping.
	log func(noExport bool, err error)
}

func (t *ipcTable) acquire(ctx *cuda.Context, h [64]byte) (*ipcMapping, error) {
	k := ipcKey{ctx, h}
	t.mu.Lock()
	defer t.mu.Unlock()
	if m, ok := t.m[k]; ok {
		m.refs++
		return m, nil
	}
	p, err := ctx.IpcOpen(h)
	if err != nil {
		return nil, err
	}
	base, size, err := ctx.AddressRange(p)
	if err != nil {
		_ = ctx.IpcClose(p)
		return nil, err
	}
	if t.m == nil {
		t.m = map[ipcKey]*ipcMapping{}
	}
	m := &ipcMapping{ctx: ctx, base: base, size: size, key: k, refs: 1}
	if t.register != nil && !t.failed {
		m.rdma = t.registerRDMA(ctx, base, size)
	}
	t.m[k] = m
	return m, nil
}

// registerRDMA registers a new mapping with the RDMA device through its
// dma-buf; nil when that fails. A driver that cannot export dma-bufs is
// not asked again; the first failure of either kind is logged.
func (t *ipcTable) registerRDMA(ctx *cuda.Context, base cuda.DevicePtr, size uint64) func() {
	fd, err := ctx.ExportDmabuf(base, size)
	noExport := err != nil
	t.failed = noExport
	var release func()
	if err == nil {
		release, err = t.register(fd, uint64(base), size)
		_ = unix.Close(fd)
	}
	if err != nil {
		if !t.logged && t.log != nil {
			t.logged = true
			t.log(noExport, err)
		}
		return nil
	}
	return release
}

// registerDmabuf registers mapping m with the RDMA devices through
// dmabuf, the client's export of the same allocation, unless it is
// registered already or there is no RDMA: the registration is the
// mapping's, used by every transfer of its memory and released with its
// last reference. A failure is logged once; the mapping's remote
// transfers are then staged.
func (t *ipcTable) registerDmabuf(m *ipcMapping, dmabuf int) {
	t.mu.Lock()
	done := t.register == nil || m.rdma != nil
	t.mu.Unlock()
	if done {
		return
	}
	// Outside the lock: registering GiBs of GPU memory takes a while.
	release, err := t.register(dmabuf, uint64(m.base), m.size)
	t.mu.Lock()
	defer t.mu.Unlock()
	if err != nil {
		if !t.dmabufLogged && t.log != nil {
			t.dmabufLogged = true
			t.log(false, err)
		}
		return
	}
	if m.rdma != nil {
		release() // another registration's came first
		return
	}
	m.rdma = release
}

func (t *ipcTable) release(m *ipcMapping) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if m.refs--; m.refs > 0 {
		return nil
	}
	delete(t.m, m.key)
	if m.rdma != nil {
		m.rdma()
	}
	return m.ctx.IpcClose(m.base)
}

// maxIPC bounds the IPC handles kept open for one client process (an
// engine's KV blocks come from hundreds of caching-allocator segments);
// maxIPCTotal those kept for all of them: past it, a handle is opened
// for its call alone.
const (
	maxIPC      = 1024
	maxIPCTotal = 16384
)

// ref takes one more reference on m.
func (t *ipcTable) ref(m *ipcMapping) {
	t.mu.Lock()
	m.refs++
	t.mu.Unlock()
}

// ipcCache keeps the IPC handles one client process used (proc.go):
// opening one costs far more than a copy, so a process that moves many
// tensors of one allocation, through any number of files, pays once. The
// cache holds one reference on each mapping; past maxIPC the least
// recently used goes, and so does one unused for ipcIdle (an allocation
// the process freed would otherwise stay imported here until it exits),
// and all of them when the process exits.
type ipcCache struct {
	mu     sync.Mutex
	m      map[ipcKey]*ipcEntry // by context and handle, as ipcTable
	closed bool                 // the process is gone: nothing more is kept
}

type ipcEntry struct {
	m    *ipcMapping
	used time.Time
}

// ipcIdle is how long a cached handle stays unused before it is closed;
// the reaper looks every ipcSweep.
const (
	ipcIdle  = time.Minute
	ipcSweep = 10 * time.Second
)

// ipcOpen returns the mapping of handle h, opened once per process, with a
// reference of the caller's own, which it drops with f.ipc.release when
// its copies are done: a mapping that the cache lets go meanwhile stays
// open for them.
func (f *FS) ipcOpen(c *ipcCache, ctx *cuda.Context, h [64]byte) (*ipcMapping, error) {
	k := ipcKey{ctx, h}
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if e, ok := c.m[k]; ok {
		f.ipc.ref(e.m)
		e.used = now
		return e.m, nil
	}
	m, err := f.ipc.acquire(ctx, h)
	if err != nil || c.closed || (len(c.m) < maxIPC && f.ipcCached.Load() >= maxIPCTotal) {
		return m, err
	}
	f.ipc.ref(m) // the cache's
	f.ipcCached.Add(1)
	if c.m == nil {
		c.m = map[ipcKey]*ipcEntry{}
	}
	if len(c.m) >= maxIPC {
		var oldest ipcKey
		var at time.Time
		for key, e := range c.m {
			if at.IsZero() || e.used.Before(at) {
				oldest, at = key, e.used
			}
		}
		f.dropIPCLocked(c, oldest)
	}
	c.m[k] = &ipcEntry{m: m, used: now}
	return m, nil
}

// dropIPCLocked lets go of the cache's reference on key's mapping.
func (f *FS) dropIPCLocked(c *ipcCache, key ipcKey) {
	e := c.m[key]
	if e == nil {
		return
	}
	delete(c.m, key)
	f.ipcCached.Add(-1)
	if err := f.ipc.release(e.m); err != nil {
		f.log.WithError(err).Warn("close CUDA IPC handle")
	}
}

// ipcCloseAll drops the cache's references; it keeps nothing after.
func (f *FS) ipcCloseAll(c *ipcCache) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for key := range c.m {
		f.dropIPCLocked(c, key)
	}
	c.m, c.closed = nil, true
}

// sweepIPC closes the cached handles of every process unused for ipcIdle.
func (f *FS) sweepIPC() {
	t := &f.procs
	t.mu.Lock()
	procs := make([]*clientProc, 0, len(t.byTgid))
	for _, cp := range t.byTgid {
		procs = append(procs, cp)
	}
	t.mu.Unlock()
	cutoff := time.Now().Add(-ipcIdle)
	for _, cp := range procs {
		c := &cp.ipc
		c.mu.Lock()
		for key, e := range c.m {
			if e.used.Before(cutoff) {
				f.dropIPCLocked(c, key)
			}
		}
		c.mu.Unlock()
	}
}

// gpuMapping returns the allocation ref names, opened once per process
// p, with a reference for the caller (releaseMapping drops it).
func (f *FS) gpuMapping(p *callerProc, ref ioctl.GPURef) (*ipcMapping, error) {
	ms, errs := f.gpuMappings(p, []ioctl.GPURef{ref})
	return ms[0], errs[0]
}

// gpuMappings is gpuMapping of each of refs, p's state looked up once:
// a call's table names up to ioctl.MaxGPURefs allocations.
func (f *FS) gpuMappings(p *callerProc, refs []ioctl.GPURef) ([]*ipcMapping, []error) {
	ms, errs := make([]*ipcMapping, len(refs)), make([]error, len(refs))
	var cp *clientProc
	var procErr error
	for i, ref := range refs {
		ctx, err := f.gpuContext(ref.Device)
		if err != nil {
			errs[i] = err
			continue
		}
		if cp == nil && procErr == nil {
			cp, procErr = f.proc(p)
		}
		if procErr != nil {
			// No process state (its /proc is unreadable, say): open the
			// handle for this call alone.
			ms[i], errs[i] = f.ipc.acquire(ctx, ref.Handle)
			continue
		}
		ms[i], errs[i] = f.ipcOpen(&cp.ipc, ctx, ref.Handle)
	}
	return ms, errs
}

func (f *FS) releaseMapping(m *ipcMapping) {
	if err := f.ipc.release(m); err != nil {
		f.log.WithError(err).Warn("close CUDA IPC handle")
	}
}

// mappedRange is [off, off+n) of mapping m.
func mappedRange(m *ipcMapping, off, n uint64) (transfer.Buffer, error) {
	if off > m.size || n > m.size-off {
		return transfer.Buffer{}, fmt.Errorf("%d B at %d of a %d B allocation: %w", n, off, m.size, errDevRange)
	}
	return transfer.CUDAAllocBuffer(m.ctx, m.base, off, n), nil
}

// cudaBuffer resolves [off, off+n) of the allocation ref names, for the
// process p; done drops the mapping's reference taken for the copy.
func (f *FS) cudaBuffer(p *callerProc, ref ioctl.GPURef, off, n uint64) (transfer.Buffer, func(), error) {
	m, err := f.gpuMapping(p, ref)
	if err != nil {
		return transfer.Buffer{}, nil, err
	}
	b, err := mappedRange(m, off, n)
	if err != nil {
		f.releaseMapping(m)
		return transfer.Buffer{}, nil, err
	}
	return b, func() { f.releaseMapping(m) }, nil
}

// ioctlCUDA serves PUT_CUDA and GET_CUDA on a file handle.
func (n *node) ioctlCUDA(ctx context.Context, h *handle, key string, put bool, in, out []byte) error {
	var a ioctl.CUDAArg
	if err := a.Unmarshal(in); err != nil {
		return err
	}
	p, err := procOf(ctx)
	if err != nil {
		return err
	}
	buf, done, err := n.fs.cudaBuffer(p, ioctl.GPURef{Handle: a.Handle, Device: a.Device}, a.DevOff, a.Len)
	if err != nil {
		return err
	}
	defer done()
	a.Result, a.Version, err = n.moveData(ctx, h, key, put, buf, a.ObjOff, a.Flags)
	if err != nil {
		return err
	}
	copy(out, a.Marshal())
	return nil
}
