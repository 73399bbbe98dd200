package fs

import (
	"context"
	"strings"
	"sync"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// dirHandle is an open directory: a listing read a page at a time, and
// the buffers registered on it for batch ioctls.
type dirHandle struct {
	n     *node
	regs  regTable
	async asyncTable
	mu    sync.Mutex
	// The listing: "." and ".." (dots of them given), then the store's
	// pages (Store.ListPage): the entries of the page not given yet, and
	// where the next page starts (done: none). A handle holds one page,
	// whatever the size of its directory.
	dots int
	page []store.DirEntry
	next string
	done bool
	uid  uint32 // who opened it (FS.opens)
	// released: Releasedir ran (FS.dirs counts the handle until then).
	released bool
	// obj is the directory as it was opened (nil for one the store only
	// implies): fstat of the descriptor answers with it once the
	// directory is gone.
	obj *store.Object
}

// dirPage is how many entries a directory handle reads from the store at
// once: what it holds between reads, names of up to 255 bytes each.
const dirPage = 32

// maxPageTries bounds how often a handle reads a page again because its
// directory was renamed meanwhile (readPage): about 50 ms of pauses, for a
// rename that does not end or a directory removed.
const maxPageTries = 16

var (
	_ gofs.NodeOpendirHandler = (*node)(nil)
	_ gofs.FileReaddirenter   = (*dirHandle)(nil)
	_ gofs.FileSeekdirer      = (*dirHandle)(nil)
	_ gofs.FileReleasedirer   = (*dirHandle)(nil)
)

// OpendirHandle implements gofs.NodeOpendirHandler.
func (n *node) OpendirHandle(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	uid, _ := caller(ctx)
	h, errno := newDirHandle(n, uid)
	if errno != 0 {
		return nil, 0, errno
	}
	h.obj, _ = n.object(ctx)
	return h, 0, 0
}

// newDirHandle returns an open directory of n for user uid. It counts as
// one of uid's open files (FS.opens: ENFILE past the mount's bound or the
// user's share of it), until Releasedir.
func newDirHandle(n *node, uid uint32) (*dirHandle, syscall.Errno) {
	if n.fs.opens.take(uid) != nil {
		return nil, syscall.ENFILE
	}
	h := &dirHandle{n: n, uid: uid}
	h.regs.fs = n.fs
	h.async.counts = &n.fs.asyncHeld
	n.fs.dirs.Add(1)
	return h, 0
}

// Readdirent implements gofs.FileReaddirenter.
func (h *dirHandle) Readdirent(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.nextEntry(ctx)
}

// nextEntry returns the listing's next entry, nil at its end. Caller
// holds h.mu.
func (h *dirHandle) nextEntry(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	switch h.dots {
	case 0:
		h.dots++
		return &fuse.DirEntry{Name: ".", Mode: syscall.S_IFDIR, Ino: h.n.StableAttr().Ino}, 0
	case 1:
		h.dots++
		ino := h.n.StableAttr().Ino
		if _, p := h.n.Parent(); p != nil {
			ino = p.StableAttr().Ino
		}
		return &fuse.DirEntry{Name: "..", Mode: syscall.S_IFDIR, Ino: ino}, 0
	}
	if len(h.page) == 0 && !h.done {
		if errno := h.readPage(ctx); errno != 0 {
			return nil, errno
		}
	}
	if len(h.page) == 0 {
		return nil, 0
	}
	e := h.page[0]
	h.page[0] = store.DirEntry{}
	h.page = h.page[1:]
	return &fuse.DirEntry{Name: e.Name, Mode: fileType(e.Kind), Ino: e.Ino}, 0
}

// readPage reads the listing's next page from the store. Caller holds
// h.mu.
//
// The directory's key is its node's place in the tree, which the kernel
// moves after a rename returns, while the store has the directory at its
// new key from the rename's commit on: a page read in between would list
// its old key (nothing, or another directory moved there). So a page
// counts only if the key held the handle's directory, the same version,
// before and after the page was read (a rename makes a new version); else
// it is read again, after a pause that lets the rename finish.
func (h *dirHandle) readPage(ctx context.Context) (errno syscall.Errno) {
	start := time.Now()
	var err error
	var key string
	defer func() { h.n.fs.opDone(ctx, "readdir", key, 0, start, errno, err) }()
	st, ino := h.n.fs.st, h.n.StableAttr().Ino
	same := func(a, b *store.Object) bool { return a.Ino == b.Ino && a.Version == b.Version }
	var page []store.DirEntry
	var next string
	for try, pause := 0, 50*time.Microsecond; ; try, pause = try+1, min(2*pause, 5*time.Millisecond) {
		if try > 0 {
			time.Sleep(pause)
		}
		var ok bool
		if key, ok = h.n.key(); !ok {
			return syscall.ENOENT
		}
		var before, after *store.Object
		if before, err = st.Stat(ctx, key); err == nil {
			page, next, err = st.ListPage(ctx, key, h.next, dirPage)
		}
		if err == nil {
			after, err = st.Stat(ctx, key)
		}
		// An implicit directory (no version) has no identity to check.
		if err == nil && (before.Version == 0 || before.Ino == ino && same(before, after)) {
			break
		}
		if try == maxPageTries {
			if err == nil {
				err = store.ErrNotFound // the directory never came back to a key
			}
			return toErrno(err) // the next read asks for the same page
		}
	}
	for i := range page {
		// Names only: a name is a part of its object's key, which would
		// keep the whole key (and the page's objects) alive.
		page[i] = store.DirEntry{Name: strings.Clone(page[i].Name), Kind: page[i].Kind, Ino: page[i].Ino}
	}
	h.page, h.next, h.done = page, next, next == ""
	return 0
}

// Seekdir implements gofs.FileSeekdirer: the listing from its start,
// past off entries (offsets count entries, ".." and "." included).
func (h *dirHandle) Seekdir(ctx context.Context, off uint64) syscall.Errno {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dots, h.page, h.next, h.done = 0, nil, "", false
	for ; off > 0; off-- {
		e, errno := h.nextEntry(ctx)
		if errno != 0 {
			return errno
		}
		if e == nil {
			break
		}
	}
	return 0
}

// Releasedir implements gofs.FileReleasedirer.
func (h *dirHandle) Releasedir(ctx context.Context, releaseFlags uint32) {
	h.mu.Lock()
	h.page = nil
	if !h.released {
		h.released = true
		h.n.fs.dirs.Add(-1)
		h.n.fs.opens.put(h.uid)
	}
	h.mu.Unlock()
	h.async.close()
	h.regs.closeAll()
}
