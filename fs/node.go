package fs

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// node is one file or directory. Its key is its path from the root, found
// by walking the kernel-visible tree, so renames move it for free.
type node struct {
	gofs.Inode
	fs *FS
	// moving is the rename in flight that moves n, from before the store
	// moves its key until go-fuse's tree has n at its new name
	// (renames.go); nil otherwise.
	moving atomic.Pointer[moveWait]

	// mu guards the drafts of this file: the shared one, which every
	// writable handle opened without O_TRUNC edits (writes through
	// different descriptors of one file must see each other), and the
	// private ones of O_TRUNC handles (handle.go). It is never held
	// across a commit, a copy or an index lookup.
	mu struct {
		sync.Mutex
		draft   *store.Draft
		writers int
		// closing is closed when the last writer's release has published
		// the shared draft; opening when the first writer has opened it.
		// A new writer waits for either.
		closing, opening chan struct{}
		private          map[*handle]struct{}
		// ghost is the last version of a file that a rename through this
		// mount replaced, kept until the kernel forgets the inode: the
		// kernel may have looked the old file up just before, and an open
		// it sends for it then gets that version, as on a local file
		// system, instead of failing.
		ghost *store.Reader
		// followers counts the read-only handles that follow the shared
		// draft (handle.follow); orphan is a shared draft whose file went
		// (unlinked, renamed over) while followers read it: kept for them,
		// as an unlinked file's bytes stay for whoever has it open, and
		// closed with the last of them.
		followers int
		orphan    *store.Draft
		// readers is the read-only handles that do not follow a draft
		// (handle.follow), by the version they read: when writers that
		// share the file start a draft from that version, they follow it
		// (followReadersLocked), as a descriptor opened before an
		// appender sees its appends on tmpfs (tail -f).
		readers map[*handle]struct{}
		// changes counts the shared drafts' starts, ends and moves (a
		// read-only open that saw one looks the version up again).
		changes uint64
		// gone is the file's attributes as a chmod, chown or utime
		// through a descriptor (or a path walk that raced the removal)
		// set them after the file left its name (unlinked, renamed
		// over): what fstat of its descriptors shows from then on, as on
		// tmpfs, where such a call changes the nameless file.
		gone *store.Object
		// opened is the version a descriptor of the file last opened:
		// the attributes gone starts from when a call comes without one.
		opened *store.Object
		// bound holds, for each shared draft that followers read (each
		// reads one: handle.bound), their count and what the draft left
		// once closed (the version its writers published, or the one
		// they began from) for them to read on, not whatever version is
		// current by then: a later draft's, or an O_TRUNC writer's
		// published meanwhile, would follow the first part of a read with
		// another version's bytes. Let go with the last of its followers.
		bound map[boundKey]*boundDraft
	}
	// putMu makes each PUT ioctl through this file's drafts one version
	// change: truncate, write and publish (dataio.go).
	putMu sync.Mutex
	// rebaseMu makes rebaseShared's leaving of the draft's bytes to its
	// followers and its move onto the new version one step among those
	// of other publishes. Taken before FS.renaming (versionNow).
	rebaseMu sync.Mutex
	// metaGen counts setxattr/removexattr of user.mooncake.meta through
	// this file. A rewrite (an O_TRUNC open, a truncation) drops the meta
	// when it publishes unless one was set since it began: the meta
	// described the old bytes, but cp -a sets the new one mid-rewrite.
	metaGen atomic.Uint64
	// sharedRewrite is metaGen+1 when the shared draft was truncated (0:
	// not): its publish then drops the meta as an O_TRUNC one does.
	sharedRewrite atomic.Uint64
}

var (
	_ gofs.NodeLookuper      = (*node)(nil)
	_ gofs.NodeGetattrer     = (*node)(nil)
	_ gofs.NodeSetattrer     = (*node)(nil)
	_ gofs.NodeLseeker       = (*node)(nil)
	_ gofs.NodeCreater       = (*node)(nil)
	_ gofs.NodeOpener        = (*node)(nil)
	_ gofs.NodeReader        = (*node)(nil)
	_ gofs.NodeWriter        = (*node)(nil)
	_ gofs.NodeFlusher       = (*node)(nil)
	_ gofs.NodeFsyncer       = (*node)(nil)
	_ gofs.NodeReleaser      = (*node)(nil)
	_ gofs.NodeUnlinker      = (*node)(nil)
	_ gofs.NodeRmdirer       = (*node)(nil)
	_ gofs.NodeMkdirer       = (*node)(nil)
	_ gofs.NodeRenamer       = (*node)(nil)
	_ gofs.NodeStatfser      = (*node)(nil)
	_ gofs.NodeAllocater     = (*node)(nil)
	_ gofs.NodeSymlinker     = (*node)(nil)
	_ gofs.NodeLinker        = (*node)(nil)
	_ gofs.NodeMknoder       = (*node)(nil)
	_ gofs.NodeGetxattrer    = (*node)(nil)
	_ gofs.NodeSetxattrer    = (*node)(nil)
	_ gofs.NodeListxattrer   = (*node)(nil)
	_ gofs.NodeRemovexattrer = (*node)(nil)
	_ gofs.NodeIoctler       = (*node)(nil)
	_ gofs.NodeOnForgetter   = (*node)(nil)
)

// OnForget implements gofs.NodeOnForgetter: the kernel has dropped the
// inode, so nobody can open the replaced version any more.
func (n *node) OnForget() { n.setGhost(nil) }

// setGhost keeps r (nil: none) as the version this replaced node opens.
func (n *node) setGhost(r *store.Reader) {
	n.mu.Lock()
	old := n.mu.ghost
	n.mu.ghost = r
	n.mu.Unlock()
	if old != nil {
		old.Close()
	}
}

// ghostReader returns a new lease on the ghost version, nil without one.
func (n *node) ghostReader() *store.Reader {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mu.ghost == nil {
		return nil
	}
	return n.mu.ghost.Dup()
}

// namelessObject is what n's attributes are once its key no longer holds
// its inode (unlinked, or replaced by a rename, while open or while the
// kernel's walk reached it), nil when nothing is known: with left (n has
// no name at all), as a call through a descriptor set them since
// (node.mu.gone); else the version the descriptor fh has; else the one a
// rename through this mount replaced (the ghost); else, with left, the
// version a descriptor last opened (node.mu.opened).
func (n *node) namelessObject(fh gofs.FileHandle, left bool) *store.Object {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.namelessLocked(fh, left)
}

// namelessLocked is namelessObject with n.mu held.
func (n *node) namelessLocked(fh gofs.FileHandle, left bool) *store.Object {
	if left && n.mu.gone != nil {
		return n.mu.gone
	}
	if h, isH := fh.(*handle); isH && h.obj != nil {
		return h.obj
	}
	if dh, isD := fh.(*dirHandle); isD && dh.obj != nil {
		return dh.obj
	}
	if n.mu.ghost != nil {
		return n.mu.ghost.Object()
	}
	if left {
		return n.mu.opened
	}
	return nil
}

// changeNameless changes the attributes of n, which has no name left
// (unlinked or renamed over), as a call through a descriptor (or a path
// walk that raced the removal) asks: a copy of what namelessObject knows
// of it, changed by change and kept for its descriptors (node.mu.gone),
// its ctime now; all under n.mu, so that two such calls both stick. With
// nothing known, or when change fails, nothing changes: ErrStale (the
// kernel looks the path up again) or change's error.
func (n *node) changeNameless(fh gofs.FileHandle, change func(o *store.Object) error) (*store.Object, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	base := n.namelessLocked(fh, true)
	if base == nil {
		return nil, store.ErrStale
	}
	o := base.Clone()
	if err := change(o); err != nil {
		return nil, err
	}
	o.Ctime = time.Now().UnixNano()
	n.mu.gone = o
	return o, nil
}

// key returns the node's key; ok is false for a node that is no longer
// reachable from the root (unlinked or replaced while open), and for one
// whose way up is longer than any key, which only a loop of directories
// makes: the walk stops there rather than grow without end (the kernel
// then looks the path up again, from the root).
func (n *node) key() (string, bool) {
	var parts []string
	cur := &n.Inode
	root := n.Root()
	size := 0
	for cur != root {
		name, parent := cur.Parent()
		if parent == nil {
			return "", false
		}
		if size += len(name) + 1; size > store.MaxKeyLen+1 {
			return "", false
		}
		parts = append(parts, name)
		cur = parent
	}
	k := ""
	for i := len(parts) - 1; i >= 0; i-- {
		k = store.Join(k, parts[i])
	}
	return k, true
}

// liveObject returns the version of n that the index holds now: key's
// (n.key's, ok false once n left the tree), while key still holds n's
// inode; nil and no error once n was unlinked or replaced.
func (n *node) liveObject(ctx context.Context, key string, ok bool) (*store.Object, error) {
	if !ok {
		return nil, nil
	}
	o, err := n.fs.st.Stat(ctx, key)
	switch {
	case errors.Is(err, store.ErrNotFound):
		return nil, nil
	case err != nil:
		return nil, err
	case o.Ino != n.StableAttr().Ino:
		return nil, nil
	}
	return o, nil
}

func (n *node) childKey(name string) (string, error) {
	if err := store.ValidateName(name); err != nil {
		return "", err
	}
	dir, ok := n.key()
	if !ok {
		// The directory the kernel walked through was removed or
		// replaced: ESTALE makes it walk the path again.
		return "", store.ErrStale
	}
	k := store.Join(dir, name)
	if len(k) > store.MaxKeyLen {
		return "", store.ErrNameTooLong
	}
	return k, nil
}

func (n *node) newChild(ctx context.Context, o *store.Object) *gofs.Inode {
	// The node go-fuse already has for the file, when the kernel looks a
	// name up again while it still holds the inode (the entry timed out,
	// a file kept open): go-fuse would use it anyway and drop a new one,
	// and its drafts are what the file's size and an open's writes go by.
	if c := n.GetChild(store.Base(o.Key)); c != nil && c.StableAttr().Ino == o.Ino && c.StableAttr().Mode == fileType(o.Kind) {
		return c
	}
	return n.NewInode(ctx, n.fs.newNode(), gofs.StableAttr{Mode: fileType(o.Kind), Ino: o.Ino})
}

// object returns the store's object at n's key when it is still n's file
// (same inode); nil, with the lookup's error if it failed, when the key
// is gone, names another file, or n has no key.
func (n *node) object(ctx context.Context) (*store.Object, error) {
	key, ok := n.key()
	if !ok {
		return nil, nil
	}
	o, err := n.fs.st.Stat(ctx, key)
	if err != nil || o.Ino != n.StableAttr().Ino {
		return nil, err
	}
	return o, nil
}

// fileType is the file type bits (S_IFMT) of a key of kind k.
func fileType(k store.Kind) uint32 {
	if k == store.KindDir {
		return syscall.S_IFDIR
	}
	return syscall.S_IFREG
}

func (f *FS) newNode() *node {
	n := &node{fs: f}
	n.mu.private = make(map[*handle]struct{})
	return n
}

// fillAttr converts an object to kernel attributes.
func (f *FS) fillAttr(o *store.Object, size uint64, a *fuse.Attr) {
	a.Ino = o.Ino
	a.Size = size
	a.Blocks = (size + 4095) / 4096 * 8 // whole pages, as tmpfs counts (du)
	a.Blksize = blksize(size)
	a.Mode = fileType(o.Kind) | o.Mode&0o7777
	a.Nlink = 1
	if o.Kind == store.KindDir {
		// Not 2: a directory's links are 2 and one per subdirectory,
		// which the index does not count; tools that skip a directory
		// once its subdirectories are seen (File::Find, fts's leaf
		// optimization) missed files under one with subdirectories.
		// 1 says "not counted", as btrfs has it. Nor does a directory
		// take pages: du counts none for it, as on tmpfs.
		a.Size = 4096
		a.Blocks = 0
	}
	a.Uid, a.Gid = o.Uid, o.Gid
	mns, cns := o.Mtime, o.Ctime
	if o.Kind == store.KindDir {
		// An entry made or removed since the record was written.
		t := f.st.DirChanged(o)
		mns, cns = max(mns, t), max(cns, t)
	}
	mt, ct := time.Unix(0, mns), time.Unix(0, cns)
	a.SetTimes(&mt, &mt, &ct)
}

// blksize is the I/O size stat suggests for a file of size bytes: 1 MiB
// for an empty file (about to be written: writers size their buffers by
// it) and a large one, else the file's size rounded up to a power of two,
// at least 128 KiB. Reads are direct: the kernel pins the reader's whole
// buffer for each, and cat, Python and others read st_blksize at a time,
// so a 1 MiB read of a small file cost about 60 us more than one of
// 128 KiB on the dev VM (500 more into a buffer not yet touched).
func blksize(size uint64) uint32 {
	const lo, hi = 128 << 10, 1 << 20
	if size == 0 || size >= hi {
		return hi
	}
	b := uint64(lo)
	for b < size {
		b <<= 1
	}
	return uint32(b)
}

func (f *FS) entryOut(o *store.Object, size uint64, out *fuse.EntryOut) {
	f.fillAttr(o, size, &out.Attr)
	out.SetEntryTimeout(f.opts.EntryTimeout)
	out.SetAttrTimeout(f.opts.AttrTimeout)
}

// sizeOf returns the size the kernel should keep for the inode: the
// largest of its drafts' while writers are open here, else the version's.
// The kernel keeps one size per inode, and the writers' own calls depend
// on it (mmap past it faults with SIGBUS), so while a file is being
// written here stat shows the size being written, and readers still read
// the last published version.
//
// A draft that failed (a write was refused: it can never publish) does
// not count: its size is of bytes nobody will see.
func (n *node) sizeOf(o *store.Object) uint64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	size, drafts := uint64(0), 0
	if d := n.mu.draft; d != nil && d.Err() == nil {
		size, drafts = d.Size(), 1
	} else if d := n.mu.orphan; d != nil {
		size, drafts = d.Size(), 1
	}
	for h := range n.mu.private {
		if h.priv.Err() == nil {
			size, drafts = max(size, h.priv.Size()), drafts+1
		}
	}
	if drafts == 0 {
		return o.Size
	}
	return size
}

func caller(ctx context.Context) (uid, gid uint32) {
	if c, ok := fuse.FromContext(ctx); ok {
		return c.Uid, c.Gid
	}
	return 0, 0
}

// Lookup implements gofs.NodeLookuper.
func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (ch *gofs.Inode, errno syscall.Errno) {
	errno = n.afterRenames(func() syscall.Errno { ch, errno = n.lookup(ctx, name, out); return errno })
	return ch, errno
}

func (n *node) lookup(ctx context.Context, name string, out *fuse.EntryOut) (ch *gofs.Inode, errno syscall.Errno) {
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, "lookup", key, 0, start, errno, err) }()
	if key, err = n.childKey(name); err != nil {
		return nil, toErrno(err)
	}
	n.fs.neg.looking(n.StableAttr().Ino, name, n.fs.opts.NegativeTimeout)
	o, err := n.fs.st.Stat(ctx, key)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			// The bridge answers a negative entry for NegativeTimeout
			// (the mount's option) only while out's timeout is 0: one
			// set here made the answer a plain ENOENT, which the kernel
			// does not keep, so every lookup of a missing name came here.
			err = nil
			return nil, syscall.ENOENT
		}
		return nil, toErrno(err)
	}
	n.fs.neg.found(n.StableAttr().Ino, name)
	if hook := n.fs.hooks.lookedUp; hook != nil {
		hook(name)
	}
	ch = n.newChild(ctx, o)
	n.fs.entryOut(o, ch.Operations().(*node).sizeOf(o), out)
	return ch, 0
}

// Getattr implements gofs.NodeGetattrer.
func (n *node) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) (errno syscall.Errno) {
	start := time.Now()
	var err error
	m := n.fs.moves.mark()
	key, ok := n.key()
	defer func() { n.fs.opDone(ctx, "getattr", key, 0, start, errno, err) }()
	// The file as it is now, even for a reader's fstat: the kernel keeps
	// one set of attributes per inode, for every caller and for its
	// permission checks, and go-fuse passes some open handle of the
	// node when the kernel passes none (a stat by path). A reader's
	// version (the one it reads) is not the file's: answered here, a
	// file kept open let others in after a chmod, and cp of a file
	// rewritten since stopped at the old size.
	var o *store.Object
	o, err = n.liveObject(ctx, key, ok)
	for try := 1; o == nil && err == nil && ok && try < maxMoveTries && n.waitMoves(m); try++ {
		// Not at its name, but a rename may have moved it there (or a
		// directory above): it is not gone (renames.go).
		m = n.fs.moves.mark()
		key, ok = n.key()
		o, err = n.liveObject(ctx, key, ok)
	}
	gone := o == nil
	if gone {
		// Unlinked or replaced but still open (a file or a directory,
		// as fstat of a descriptor sees it): answer from what is known
		// of it, with no link left, as tmpfs does. With nothing known,
		// ESTALE: the kernel looks the path up again and finds what is
		// there now.
		if o = n.namelessObject(fh, !ok); o != nil {
			err = nil
		} else if err == nil {
			err = store.ErrStale
		}
	}
	if o == nil {
		return toErrno(err)
	}
	n.fs.fillAttr(o, n.sizeOf(o), &out.Attr)
	if gone {
		out.Attr.Nlink = 0
	}
	out.SetTimeout(n.fs.opts.AttrTimeout)
	return 0
}

// Setattr implements gofs.NodeSetattrer: size through the draft, the rest
// as a metadata update.
func (n *node) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	return n.afterRenames(func() syscall.Errno { return n.setattr(ctx, fh, in, out) })
}

func (n *node) setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) (errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key, ok := n.key()
	defer func() { n.fs.opDone(ctx, "setattr", key, 0, start, errno, err) }()
	h, _ := fh.(*handle)
	if !ok {
		// A file unlinked or renamed over while open (or while a path
		// walk reached it): the call changes the nameless file, as on
		// tmpfs. A truncation changes the draft, which goes nowhere, as
		// its writes do; the attributes are kept for its descriptors'
		// fstat (node.mu.gone).
		if n.namelessObject(fh, true) == nil {
			return syscall.ESTALE // the kernel looks the path up again
		}
		if size, has := in.GetSize(); has {
			if h == nil || !h.writable {
				// A truncate by path that met the file leaving: the kernel
				// looks the path up again.
				return syscall.ESTALE
			}
			if d := h.draft(); d != nil {
				err = d.Truncate(ctx, size)
			}
		}
		if err != nil {
			return toErrno(err)
		}
		var o *store.Object
		o, err = n.changeNameless(fh, func(o *store.Object) error {
			if mode, has := in.GetMode(); has {
				o.Mode = mode & 0o7777
			}
			if uid, has := in.GetUID(); has {
				o.Uid = uid
			}
			if gid, has := in.GetGID(); has {
				o.Gid = gid
			}
			if mt, has := in.GetMTime(); has {
				o.Mtime = unixNanos(mt)
			}
			return nil
		})
		if err != nil {
			return toErrno(err)
		}
		n.fs.fillAttr(o, n.sizeOf(o), &out.Attr)
		out.Attr.Nlink = 0
		out.SetTimeout(n.fs.opts.AttrTimeout)
		return 0
	}
	// A truncation to the size the file has changes no bytes, so no new
	// version carries its time: the file is marked modified here, as on
	// tmpfs (make's stamp files are truncated that way, ": > stamp").
	unchanged := false
	if size, has := in.GetSize(); has {
		if n.IsDir() {
			return syscall.EISDIR
		}
		if o, serr := n.fs.st.Stat(ctx, key); serr == nil && o.Ino == n.StableAttr().Ino && n.sizeOf(o) == size {
			unchanged = true
		}
		if err = n.truncate(ctx, h, key, size); err != nil {
			return toErrno(err)
		}
	}
	mode, hasMode := in.GetMode()
	uid, hasUID := in.GetUID()
	gid, hasGID := in.GetGID()
	mt, hasMtime := in.GetMTime()
	mtime := unixNanos(mt)
	if hasMtime {
		// An open writer commits at close: keep the time for that commit.
		if h != nil && h.writable {
			if d := h.draft(); d != nil {
				d.SetMtime(mtime)
			}
		}
		n.lockSettled()
		if d := n.mu.draft; d != nil {
			d.SetMtime(mtime)
		}
		for ph := range n.mu.private {
			// Another's O_TRUNC writer (a time set by path, touch -d):
			// its close publishes the file too.
			ph.priv.SetMtime(mtime)
		}
		n.mu.Unlock()
	}
	if hasMode || hasUID || hasGID || hasMtime {
		_, err = n.fs.st.Update(ctx, key, n.StableAttr().Ino, func(o *store.Object) error {
			if hasMode {
				o.Mode = mode & 0o7777
			}
			if hasUID {
				o.Uid = uid
			}
			if hasGID {
				o.Gid = gid
			}
			if hasMtime {
				o.Mtime = mtime
			}
			return nil
		})
		if err != nil {
			return toErrno(err)
		}
		if hasMtime && n.IsDir() {
			// Set by its owner (tar, rsync), even to the value it had:
			// shown as set until the next entry change.
			n.fs.st.DirTimesSet(key)
		}
	}
	if unchanged && !hasMtime {
		// The truncation is done: a file replaced since keeps its times.
		now := time.Now().UnixNano()
		_, _ = n.fs.st.Update(ctx, key, n.StableAttr().Ino, func(o *store.Object) error {
			o.Mtime = now // and the ctime, as every update
			return nil
		})
	}
	o, err := n.fs.st.Stat(ctx, key)
	if err != nil {
		return toErrno(err)
	}
	n.fs.fillAttr(o, n.sizeOf(o), &out.Attr)
	out.SetTimeout(n.fs.opts.AttrTimeout)
	return 0
}

// Lseek implements gofs.NodeLseeker: SEEK_DATA and SEEK_HOLE (the kernel
// answers the other whences) as on tmpfs for a file without holes: data
// everywhere before the end, the one hole at it, and neither at or past
// the end (ENXIO), where go-fuse's default found a hole at the end.
func (n *node) Lseek(ctx context.Context, f gofs.FileHandle, off uint64, whence uint32) (uint64, syscall.Errno) {
	var a fuse.AttrOut
	if errno := n.Getattr(ctx, f, &a); errno != 0 {
		return 0, errno
	}
	switch {
	case whence != unix.SEEK_DATA && whence != unix.SEEK_HOLE:
		return 0, syscall.EINVAL
	case off >= a.Size:
		return 0, syscall.ENXIO
	case whence == unix.SEEK_DATA:
		return off, 0
	}
	return a.Size, 0
}

// Times are kept as int64 nanoseconds since 1970, about 1677 to 2262.
var minTime, maxTime = time.Unix(0, math.MinInt64), time.Unix(0, math.MaxInt64)

// unixNanos is t in nanoseconds since 1970, clamped to the range kept, as
// the kernel clamps a time set on a file system with a narrower one than
// the caller's: a time past it (touch -d 2300-01-01, tar of such a file)
// wrapped around to 1715.
func unixNanos(t time.Time) int64 {
	switch {
	case t.Before(minTime):
		return math.MinInt64
	case t.After(maxTime):
		return math.MaxInt64
	}
	return t.UnixNano()
}

// truncate changes the size: through a writable handle, its draft; with
// writers open, the shared draft (visible when they close); otherwise a
// commit at once.
func (n *node) truncate(ctx context.Context, h *handle, key string, size uint64) error {
	if h != nil && h.writable {
		if d := h.draft(); d != nil {
			if d != h.priv {
				n.sharedRewrite.CompareAndSwap(0, n.metaGen.Load()+1)
			}
			return d.Truncate(ctx, size)
		}
	}
	n.lockSettled()
	if shared := n.mu.draft; shared != nil {
		// As a writer of its own, so the last writer's release does not
		// publish before the truncation is in the draft; n.mu is not held
		// across it (it may reserve and zero-fill on another node).
		n.mu.writers++
		n.mu.Unlock()
		n.sharedRewrite.CompareAndSwap(0, n.metaGen.Load()+1)
		err := shared.Truncate(ctx, size)
		if err == nil {
			// A truncate(2) by path is done when it returns, as on
			// tmpfs: published now, as an fsync would, not when the
			// holders close (a holder that never writes would keep it
			// from readers, and a rewrite meanwhile would go under it).
			err = n.publish(ctx, shared, nil)
		}
		if lerr := n.leaveShared(ctx); err == nil {
			err = lerr
		}
		return err
	}
	n.mu.Unlock()
	d, err := n.fs.st.OpenDraft(ctx, key, n.StableAttr().Ino, size == 0)
	if err != nil {
		return err
	}
	defer d.Close()
	d.Place(n.fs.st.PlacementFor(ctx, key))
	if err := d.Truncate(ctx, size); err != nil {
		return err
	}
	_, err = d.Commit(ctx, store.CommitOptions{Key: key, IfIno: n.StableAttr().Ino, SetXattrs: dropMeta})
	return err
}

// template is a new entry of n made by the caller: its owner, and mode
// (after the kernel's umask, and with a setgid bit the caller may not set
// already stripped: the kernel does that, knowing the caller's groups).
// In a setgid directory, as on any Linux file system, the entry takes the
// directory's group, and a directory the setgid bit too.
func (n *node) template(ctx context.Context, mode uint32, dir bool) *store.Object {
	uid, gid := caller(ctx)
	mode &= 0o7777
	if key, ok := n.key(); ok {
		if p, err := n.fs.st.Stat(ctx, key); err == nil && p.Mode&syscall.S_ISGID != 0 {
			if dir {
				mode |= syscall.S_ISGID
			}
			gid = p.Gid
		}
	}
	return &store.Object{Mode: mode, Uid: uid, Gid: gid}
}

// Create implements gofs.NodeCreater.
func (n *node) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (ch *gofs.Inode, fh gofs.FileHandle, fuseFlags uint32, errno syscall.Errno) {
	errno = n.afterRenamesUntil(func() (syscall.Errno, bool) {
		var made bool
		ch, fh, fuseFlags, made, errno = n.create(ctx, name, flags, mode, out)
		return errno, made // a file made is not made again
	})
	return ch, fh, fuseFlags, errno
}

// create serves Create once; made says whether it made the file (even if
// it then failed to open it).
func (n *node) create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (ch *gofs.Inode, fh gofs.FileHandle, fuseFlags uint32, made bool, errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, "create", key, 0, start, errno, err) }()
	if key, err = n.childKey(name); err != nil {
		return nil, nil, 0, false, toErrno(err)
	}
	// The caller's open is counted first: past its share nothing is made.
	uid, _ := caller(ctx)
	if err = n.fs.opens.take(uid); err != nil {
		return nil, nil, 0, false, toErrno(err)
	}
	o, err := n.fs.st.Create(ctx, key, n.template(ctx, mode, false), flags&syscall.O_EXCL != 0)
	if err != nil {
		n.fs.opens.put(uid)
		return nil, nil, 0, false, toErrno(err)
	}
	ch = n.newChild(ctx, o)
	cn := ch.Operations().(*node)
	// The file is made: a rename of a directory above that moves it
	// before it is opened is followed, rather than the create failing
	// (and failing again as one of an existing file).
	var h *handle
	if errno = n.afterRenames(func() syscall.Errno {
		at, kerr := n.childKey(name)
		if kerr != nil {
			return toErrno(kerr)
		}
		h, err = cn.openHandle(ctx, at, o, flags)
		return toErrno(err)
	}); errno != 0 {
		n.fs.opens.put(uid)
		return nil, nil, 0, true, errno
	}
	h.uid = uid
	n.fs.entryOut(o, cn.sizeOf(o), out)
	return ch, h, h.fuseFlags(), true, 0
}

// Open implements gofs.NodeOpener.
func (n *node) Open(ctx context.Context, flags uint32) (fh gofs.FileHandle, fuseFlags uint32, errno syscall.Errno) {
	errno = n.afterRenamesUntil(func() (syscall.Errno, bool) {
		var emptied bool
		fh, fuseFlags, emptied, errno = n.openNode(ctx, flags)
		return errno, emptied // a file emptied is not emptied again
	})
	return fh, fuseFlags, errno
}

// openNode serves Open once; emptied says whether it emptied the file
// (O_RDONLY|O_TRUNC), even if it then failed to open it.
func (n *node) openNode(ctx context.Context, flags uint32) (fh gofs.FileHandle, fuseFlags uint32, emptied bool, errno syscall.Errno) {
	start := time.Now()
	var err error
	key, ok := n.key()
	defer func() { n.fs.opDone(ctx, "open", key, 0, start, errno, err) }()
	var h *handle
	switch {
	case !ok:
		// Unlinked or replaced since the kernel looked it up: ESTALE
		// makes the kernel look the path up again.
		err = store.ErrStale
	case flags&syscall.O_ACCMODE == syscall.O_RDONLY && flags&syscall.O_TRUNC != 0 && !n.IsDir():
		h, emptied, err = n.openEmptied(ctx, key, flags)
	default:
		h, err = n.open(ctx, key, nil, flags)
	}
	if errors.Is(err, store.ErrStale) && !emptied && (flags&syscall.O_TRUNC == 0 || flags&syscall.O_ACCMODE != syscall.O_RDONLY) {
		uid, _ := caller(ctx)
		if gh := n.openGhost(uid, flags); gh != nil {
			h, err = gh, nil
		}
	}
	if err != nil {
		return nil, 0, emptied, toErrno(err)
	}
	return h, h.fuseFlags(), emptied, 0
}

// openEmptied serves an O_RDONLY|O_TRUNC open of file n at key: Linux
// empties the file then too (the kernel checked that the caller may
// write it), so it is emptied and published at once, as by truncate(2),
// once the open is counted (past the caller's share of open files
// nothing changes), and opened for reading. emptied says whether it was.
func (n *node) openEmptied(ctx context.Context, key string, flags uint32) (h *handle, emptied bool, err error) {
	uid, _ := caller(ctx)
	if err := n.fs.opens.take(uid); err != nil {
		return nil, false, err
	}
	if err := n.truncate(detached(ctx), nil, key, 0); err != nil {
		n.fs.opens.put(uid)
		return nil, false, err
	}
	n.killSUID(ctx)
	h, err = n.openCounted(ctx, uid, key, nil, flags)
	return h, true, err
}

// Unlink implements gofs.NodeUnlinker.
func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	return n.afterRenames(func() syscall.Errno { return n.unlink(ctx, name) })
}

func (n *node) unlink(ctx context.Context, name string) (errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, "unlink", key, 0, start, errno, err) }()
	if key, err = n.childKey(name); err != nil {
		return toErrno(err)
	}
	err = n.fs.st.Delete(ctx, key, 0)
	return toErrno(err)
}

// Rmdir implements gofs.NodeRmdirer.
func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	return n.afterRenames(func() syscall.Errno { return n.rmdir(ctx, name) })
}

func (n *node) rmdir(ctx context.Context, name string) (errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, "rmdir", key, 0, start, errno, err) }()
	if key, err = n.childKey(name); err != nil {
		return toErrno(err)
	}
	err = n.fs.st.Rmdir(ctx, key)
	return toErrno(err)
}

// Mkdir implements gofs.NodeMkdirer.
func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return n.makeEntry(ctx, "mkdir", name, out, func(ctx context.Context, key string) (*store.Object, error) {
		return n.fs.st.Mkdir(ctx, key, n.template(ctx, mode, true))
	})
}

// makeEntry serves a call that makes entry name of n with mk (mkdir,
// mknod): the new node, with its attributes in out.
func (n *node) makeEntry(ctx context.Context, op, name string, out *fuse.EntryOut, mk func(ctx context.Context, key string) (*store.Object, error)) (ch *gofs.Inode, errno syscall.Errno) {
	errno = n.afterRenames(func() syscall.Errno { ch, errno = n.makeEntryOnce(ctx, op, name, out, mk); return errno })
	return ch, errno
}

func (n *node) makeEntryOnce(ctx context.Context, op, name string, out *fuse.EntryOut, mk func(ctx context.Context, key string) (*store.Object, error)) (ch *gofs.Inode, errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, op, key, 0, start, errno, err) }()
	if key, err = n.childKey(name); err != nil {
		return nil, toErrno(err)
	}
	o, err := mk(ctx, key)
	if err != nil {
		return nil, toErrno(err)
	}
	ch = n.newChild(ctx, o)
	n.fs.entryOut(o, 0, out)
	return ch, 0
}

// Rename implements gofs.NodeRenamer.
func (n *node) Rename(ctx context.Context, name string, newParent gofs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	var req <-chan struct{} // the request, whose rename marks what it moves (renames.go)
	if c, ok := ctx.(*fuse.Context); ok {
		req = c.Cancel
	}
	return n.afterRenames(func() syscall.Errno { return n.rename(ctx, req, name, newParent, newName, flags) })
}

func (n *node) rename(ctx context.Context, req <-chan struct{}, name string, newParent gofs.InodeEmbedder, newName string, flags uint32) (errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, "rename", key, 0, start, errno, err) }()
	np, ok := newParent.(*node)
	if !ok {
		return syscall.EXDEV
	}
	if key, err = n.childKey(name); err != nil {
		return toErrno(err)
	}
	to, err := np.childKey(newName)
	if err != nil {
		return toErrno(err)
	}
	var f uint32
	if flags&unix.RENAME_NOREPLACE != 0 {
		f |= store.RenameNoReplace
	}
	if flags&unix.RENAME_EXCHANGE != 0 {
		f |= store.RenameExchange
	}
	if flags&^uint32(unix.RENAME_NOREPLACE|unix.RENAME_EXCHANGE) != 0 {
		return syscall.EINVAL
	}
	// The file this rename replaces may have been looked up by a process
	// that is about to open it: keep its version for that open.
	var ghost *store.Reader
	var replaced *node
	if ch := np.GetChild(newName); ch != nil && !ch.IsDir() {
		if rn, ok := ch.Operations().(*node); ok {
			if r, err := n.fs.st.OpenReader(ctx, to); err == nil {
				if r.Object().Ino == ch.StableAttr().Ino {
					ghost, replaced = r.Dup(), rn
				}
				r.Close()
			}
		}
	}
	// What moves is marked first: a call on a node under it that finds
	// nothing at the old name until go-fuse's tree has the new one waits
	// for this rename and goes again (node.afterRenames).
	if ch := n.GetChild(name); ch != nil {
		n.fs.moves.marking(req, nodeOf(ch))
	}
	if ch := np.GetChild(newName); ch != nil && flags&unix.RENAME_EXCHANGE != 0 {
		n.fs.moves.marking(req, nodeOf(ch))
	}
	err = n.fs.st.Rename(ctx, key, to, f)
	if err != nil {
		n.fs.moves.unmark(req) // nothing moved
	} else if hook := n.fs.hooks.storeRenamed; hook != nil {
		hook(key, to)
	}
	if ghost != nil {
		if err == nil {
			replaced.setGhost(ghost)
		} else {
			ghost.Close()
		}
	}
	return toErrno(err)
}

// Statfs implements gofs.NodeStatfser: the store's capacity.
func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	st := n.fs.st.Stats()
	const bs = 4096
	out.Bsize = bs
	out.Frsize = bs
	out.Blocks = st.Segments.Size / bs
	out.Bfree = st.Segments.Free / bs
	out.Bavail = st.Segments.Free / bs
	out.Files = uint64(st.Objects) + out.Bfree
	out.Ffree = out.Bfree
	out.NameLen = store.MaxNameLen
	return 0
}

// Allocate implements gofs.NodeAllocater: plain fallocate extends the
// file with zeros; hole punching and the other modes are not supported.
func (n *node) Allocate(ctx context.Context, fh gofs.FileHandle, off uint64, size uint64, mode uint32) (errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key, _ := n.key()
	defer func() { n.fs.opDone(ctx, "fallocate", key, 0, start, errno, err) }()
	if mode != 0 {
		return syscall.EOPNOTSUPP
	}
	h, ok := fh.(*handle)
	if !ok || !h.writable {
		return syscall.EBADF
	}
	d := h.draft()
	if d == nil {
		return syscall.EBADF
	}
	if off+size < off {
		return syscall.EFBIG
	}
	n.killSUID(ctx) // as a write does
	err = d.Grow(ctx, off+size)
	return toErrno(err)
}

// Symlink and Link: the store keeps files and directories only.
func (n *node) Symlink(context.Context, string, string, *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EOPNOTSUPP
}

func (n *node) Link(context.Context, gofs.InodeEmbedder, string, *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EOPNOTSUPP
}

// Mknod implements gofs.NodeMknoder for regular files, which tar makes
// this way when it extracts one with xattrs: an empty file, as an
// exclusive create that opens nothing. Device nodes, FIFOs and sockets:
// the store keeps files and directories only.
func (n *node) Mknod(ctx context.Context, name string, mode uint32, _ uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if mode&syscall.S_IFMT != syscall.S_IFREG {
		return nil, syscall.EOPNOTSUPP
	}
	return n.makeEntry(ctx, "mknod", name, out, func(ctx context.Context, key string) (*store.Object, error) {
		return n.fs.st.Create(ctx, key, n.template(ctx, mode, false), true)
	})
}
