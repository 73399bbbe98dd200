package fs

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"

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
	mu   sync.Mutex
	ctxs map[int]*cuda.Context
}

// context returns the context of the GPU with raw UUID id (all zero: GPU 0).
func (f *FS) gpuContext(id [16]byte) (*cuda.Context, error) {
	if err := cuda.Init(); err != nil {
		return nil, err
	}
	ordinal := 0
	if id != ([16]byte{}) {
		devs, err := cuda.Devices()
		if err != nil {
			return nil, err
		}
		want := hex.EncodeToString(id[:])
		ordinal = -1
		for _, d := range devs {
			if strings.ReplaceAll(strings.TrimPrefix(d.UUID, "GPU-"), "-", "") == want {
				ordinal = d.Ordinal
			}
		}
		if ordinal < 0 {
			return nil, fmt.Errorf("uuid %s: %w", want, errNoGPU)
		}
	}
	g := &f.gpus
	g.mu.Lock()
	defer g.mu.Unlock()
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
}

// maxIPC bounds the IPC handles one open file keeps open.
const maxIPC = 64

// ipcCache keeps the IPC handles opened for one open file: opening one
// costs far more than a copy, so a client that moves many tensors of one
// allocation pays once. They are closed when the file is released.
type ipcCache struct {
	mu    sync.Mutex
	m     map[[64]byte]*ipcMapping
	order [][64]byte
}

func (c *ipcCache) open(ctx *cuda.Context, h [64]byte) (*ipcMapping, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m, ok := c.m[h]; ok && m.ctx == ctx {
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
	if c.m == nil {
		c.m = map[[64]byte]*ipcMapping{}
	}
	if len(c.order) >= maxIPC {
		old := c.order[0]
		c.order = c.order[1:]
		if m := c.m[old]; m != nil {
			_ = m.ctx.IpcClose(m.base)
		}
		delete(c.m, old)
	}
	m := &ipcMapping{ctx: ctx, base: base, size: size}
	c.m[h] = m
	c.order = append(c.order, h)
	return m, nil
}

func (c *ipcCache) closeAll() []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for _, m := range c.m {
		if err := m.ctx.IpcClose(m.base); err != nil {
			errs = append(errs, err)
		}
	}
	c.m, c.order = nil, nil
	return errs
}

// cudaBuffer resolves [off, off+n) of the allocation behind handle h.
func (f *FS) cudaBuffer(cache *ipcCache, dev [16]byte, h [64]byte, off, n uint64) (transfer.Buffer, error) {
	ctx, err := f.gpuContext(dev)
	if err != nil {
		return transfer.Buffer{}, err
	}
	m, err := cache.open(ctx, h)
	if err != nil {
		return transfer.Buffer{}, err
	}
	if off > m.size || n > m.size-off {
		return transfer.Buffer{}, fmt.Errorf("%d B at %d of a %d B allocation: %w", n, off, m.size, errDevRange)
	}
	return transfer.CUDABuffer(ctx, m.base+cuda.DevicePtr(off), n), nil
}

// ioctlCUDA serves PUT_CUDA and GET_CUDA on a file handle.
func (n *node) ioctlCUDA(ctx context.Context, h *handle, key string, put bool, in, out []byte) error {
	var a ioctl.CUDAArg
	if err := a.Unmarshal(in); err != nil {
		return err
	}
	buf, err := n.fs.cudaBuffer(&h.ipc, a.Device, a.Handle, a.DevOff, a.Len)
	if err != nil {
		return err
	}
	a.Result, a.Version, err = n.moveData(ctx, h, key, put, buf, a.ObjOff, a.Flags)
	if err != nil {
		return err
	}
	copy(out, a.Marshal())
	return nil
}
