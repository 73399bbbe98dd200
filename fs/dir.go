package fs

import (
	"context"
	"sync"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// dirHandle is an open directory: a listing made at the first read, and
// the buffers registered on it for batch ioctls.
type dirHandle struct {
	n     *node
	regs  regTable
	async asyncTable
	mu    sync.Mutex
	ds    gofs.DirStream
	// released: Releasedir ran (FS.dirs counts the handle until then).
	released bool
}

var (
	_ gofs.NodeOpendirHandler = (*node)(nil)
	_ gofs.FileReaddirenter   = (*dirHandle)(nil)
	_ gofs.FileSeekdirer      = (*dirHandle)(nil)
	_ gofs.FileReleasedirer   = (*dirHandle)(nil)
)

// OpendirHandle implements gofs.NodeOpendirHandler.
func (n *node) OpendirHandle(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	return newDirHandle(n), 0, 0
}

// newDirHandle returns an open directory of n.
func newDirHandle(n *node) *dirHandle {
	h := &dirHandle{n: n}
	h.regs.fs = n.fs
	h.async.counts = &n.fs.asyncHeld
	n.fs.dirs.Add(1)
	return h
}

func (h *dirHandle) stream(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	if h.ds == nil {
		ds, errno := h.n.Readdir(ctx)
		if errno != 0 {
			return nil, errno
		}
		h.ds = ds
	}
	return h.ds, 0
}

// Readdirent implements gofs.FileReaddirenter.
func (h *dirHandle) Readdirent(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	h.mu.Lock()
	defer h.mu.Unlock()
	ds, errno := h.stream(ctx)
	if errno != 0 || !ds.HasNext() {
		return nil, errno
	}
	e, errno := ds.Next()
	return &e, errno
}

// Seekdir implements gofs.FileSeekdirer; seeking to 0 lists afresh.
func (h *dirHandle) Seekdir(ctx context.Context, off uint64) syscall.Errno {
	h.mu.Lock()
	defer h.mu.Unlock()
	if off == 0 && h.ds != nil {
		h.ds.Close()
		h.ds = nil
	}
	ds, errno := h.stream(ctx)
	if errno != 0 {
		return errno
	}
	if sd, ok := ds.(gofs.FileSeekdirer); ok {
		return sd.Seekdir(ctx, off)
	}
	return syscall.ENOTSUP
}

// Releasedir implements gofs.FileReleasedirer.
func (h *dirHandle) Releasedir(ctx context.Context, releaseFlags uint32) {
	h.mu.Lock()
	if h.ds != nil {
		h.ds.Close()
		h.ds = nil
	}
	if !h.released {
		h.released = true
		h.n.fs.dirs.Add(-1)
	}
	h.mu.Unlock()
	h.async.close()
	h.regs.closeAll()
}
