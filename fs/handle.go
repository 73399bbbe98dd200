package fs

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// handle is one open file description.
//
// A read-only handle holds a Reader: it reads the version that was current
// at open, even if the file is replaced or removed meanwhile. A writable
// handle joins the node's shared draft; reads through it see its writes.
type handle struct {
	n        *node
	reader   *store.Reader // read-only handles
	writable bool
	obj      *store.Object // the object at open time
	regs     regTable      // buffers registered on this open file
	ipc      ipcCache      // CUDA IPC handles opened for this open file
	mu       sync.Mutex
	released bool
}

func (h *handle) fuseFlags() uint32 {
	// Direct I/O: the store is already memory, so the page cache would
	// only hold a second copy; reads are served from segment memory and
	// mmap still works (DIRECT_IO_ALLOW_MMAP).
	return fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES
}

// open makes a handle. o is the object when the caller just made it.
func (n *node) open(ctx context.Context, key string, o *store.Object, flags uint32) (*handle, error) {
	if n.IsDir() {
		return nil, store.ErrIsDir
	}
	acc := flags & syscall.O_ACCMODE
	if acc == syscall.O_RDONLY {
		r, err := n.fs.st.OpenReader(ctx, key)
		if err != nil {
			return nil, err
		}
		if r.Object().Ino != n.StableAttr().Ino {
			r.Close()
			return nil, store.ErrStale
		}
		h := &handle{n: n, reader: r, obj: r.Object()}
		h.regs.fs = n.fs
		return h, nil
	}
	trunc := flags&syscall.O_TRUNC != 0
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mu.draft == nil {
		if _, err := n.openDraftLocked(ctx, key, trunc); err != nil {
			return nil, err
		}
	} else if trunc {
		if err := n.mu.draft.Truncate(ctx, 0); err != nil {
			return nil, err
		}
	}
	n.mu.writers++
	if o == nil {
		o, _ = n.fs.st.Stat(ctx, key)
	}
	h := &handle{n: n, writable: true, obj: o}
	h.regs.fs = n.fs
	return h, nil
}

func (h *handle) draft() *store.Draft {
	h.n.mu.Lock()
	defer h.n.mu.Unlock()
	return h.n.mu.draft
}

// readResult replies with views of segment memory: go-fuse writes them to
// the kernel with writev, so the daemon copies nothing. It holds the
// version until Done. It is never empty: go-fuse skips Done for empty
// replies.
type readResult struct {
	slices  [][]byte
	size    int
	release func()
}

var _ fuse.ReadResult = (*readResult)(nil)

func (r *readResult) Size() int { return r.size }

func (r *readResult) Bytes(buf []byte) ([]byte, fuse.Status) {
	if len(r.slices) == 1 {
		return r.slices[0], fuse.OK
	}
	out := buf[:0]
	for _, s := range r.slices {
		out = append(out, s...)
	}
	return out, fuse.OK
}

func (r *readResult) Slices() ([][]byte, fuse.Status) { return r.slices, fuse.OK }

func (r *readResult) Done() {
	if r.release != nil {
		r.release()
		r.release = nil
	}
}

// Read implements gofs.NodeReader.
func (n *node) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (res fuse.ReadResult, errno syscall.Errno) {
	start := time.Now()
	var err error
	got := 0
	defer func() { n.fs.opDone(ctx, "read", "", got, start, errno, err) }()
	h, ok := fh.(*handle)
	if !ok || off < 0 {
		return nil, syscall.EBADF
	}
	if h.reader != nil {
		release := h.reader.Hold()
		slices, err := h.reader.Slices(uint64(off), uint64(len(dest)))
		if errors.Is(err, store.ErrRemote) {
			// The bytes live on another node: fetch them into dest.
			release()
			got, err = h.reader.ReadAt(ctx, dest, uint64(off))
			if err != nil {
				return nil, toErrno(err)
			}
			return fuse.ReadResultData(dest[:got]), 0
		}
		if err != nil {
			release()
			return nil, toErrno(err)
		}
		for _, s := range slices {
			got += len(s)
		}
		if got == 0 {
			// go-fuse never calls Done on an empty reply.
			release()
			return fuse.ReadResultData(nil), 0
		}
		if n.fs.splice && got >= spliceMin {
			if r, err := newSplicedResult(slices, got, release); err == nil {
				return r, 0
			}
		}
		return &readResult{slices: slices, size: got, release: release}, 0
	}
	d := h.draft()
	if d == nil {
		return nil, syscall.EBADF
	}
	got, err = d.ReadAt(ctx, dest, uint64(off))
	if err != nil {
		return nil, toErrno(err)
	}
	return fuse.ReadResultData(dest[:got]), 0
}

// Write implements gofs.NodeWriter.
func (n *node) Write(ctx context.Context, fh gofs.FileHandle, data []byte, off int64) (written uint32, errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	got := 0
	defer func() { n.fs.opDone(ctx, "write", "", got, start, errno, err) }()
	h, ok := fh.(*handle)
	if !ok || !h.writable || off < 0 {
		return 0, syscall.EBADF
	}
	d := h.draft()
	if d == nil {
		return 0, syscall.EBADF
	}
	got, err = d.WriteAt(ctx, data, uint64(off))
	if err != nil {
		return 0, toErrno(err)
	}
	return uint32(got), 0
}

// Flush implements gofs.NodeFlusher: close(2) of a writable descriptor
// commits, so the content is visible when close returns.
func (n *node) Flush(ctx context.Context, fh gofs.FileHandle) (errno syscall.Errno) {
	ctx = detached(ctx)
	h, ok := fh.(*handle)
	if !ok || !h.writable {
		return 0
	}
	start := time.Now()
	var err error
	defer func() { n.fs.opDone(ctx, "flush", "", 0, start, errno, err) }()
	n.mu.Lock()
	err = n.commitLocked(ctx)
	n.mu.Unlock()
	return toErrno(err)
}

// Fsync implements gofs.NodeFsyncer: commit now.
func (n *node) Fsync(ctx context.Context, fh gofs.FileHandle, flags uint32) (errno syscall.Errno) {
	ctx = detached(ctx)
	return n.Flush(ctx, fh)
}

// Release implements gofs.NodeReleaser.
func (n *node) Release(ctx context.Context, fh gofs.FileHandle) (errno syscall.Errno) {
	ctx = detached(ctx)
	h, ok := fh.(*handle)
	if !ok {
		return 0
	}
	h.mu.Lock()
	done := h.released
	h.released = true
	h.mu.Unlock()
	if done {
		return 0
	}
	h.regs.closeAll()
	n.fs.ipcCloseAll(&h.ipc)
	if h.reader != nil {
		h.reader.Close()
		return 0
	}
	start := time.Now()
	var err error
	defer func() { n.fs.opDone(ctx, "release", "", 0, start, errno, err) }()
	n.mu.Lock()
	defer n.mu.Unlock()
	n.mu.writers--
	if n.mu.writers > 0 {
		return 0
	}
	// Release is asynchronous to close(2): flush already committed what
	// it could, this commits writes that came after (mmap write-back).
	err = n.commitLocked(context.Background())
	n.mu.draft.Close()
	n.mu.draft = nil
	return toErrno(err)
}
