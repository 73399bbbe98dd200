package fs

import (
	"context"
	"errors"
	"sync"
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

	// mu guards the shared draft of this file: every writable handle of
	// the inode edits the same draft, as writes through different file
	// descriptors of one file must see each other.
	mu struct {
		sync.Mutex
		draft   *store.Draft
		writers int
	}
}

var (
	_ gofs.NodeLookuper      = (*node)(nil)
	_ gofs.NodeGetattrer     = (*node)(nil)
	_ gofs.NodeSetattrer     = (*node)(nil)
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
	_ gofs.NodeReaddirer     = (*node)(nil)
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
)

// key returns the node's key; ok is false for a node that is no longer
// reachable from the root (unlinked or replaced while open).
func (n *node) key() (string, bool) {
	var parts []string
	cur := &n.Inode
	root := n.Root()
	for cur != root {
		name, parent := cur.Parent()
		if parent == nil {
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

func (n *node) childKey(name string) (string, error) {
	if err := store.ValidateName(name); err != nil {
		return "", err
	}
	dir, ok := n.key()
	if !ok {
		return "", store.ErrNotFound
	}
	k := store.Join(dir, name)
	if len(k) > store.MaxKeyLen {
		return "", store.ErrNameTooLong
	}
	return k, nil
}

func (n *node) newChild(ctx context.Context, o *store.Object) *gofs.Inode {
	mode := uint32(syscall.S_IFREG)
	if o.Kind == store.KindDir {
		mode = syscall.S_IFDIR
	}
	return n.NewInode(ctx, &node{fs: n.fs}, gofs.StableAttr{Mode: mode, Ino: o.Ino})
}

// fillAttr converts an object to kernel attributes.
func (f *FS) fillAttr(o *store.Object, size uint64, a *fuse.Attr) {
	a.Ino = o.Ino
	a.Size = size
	a.Blocks = (size + 511) / 512
	a.Blksize = 1 << 20
	if o.Kind == store.KindDir {
		a.Mode = syscall.S_IFDIR | o.Mode&0o7777
		a.Nlink = 2
		a.Size = 4096
		a.Blocks = 8
	} else {
		a.Mode = syscall.S_IFREG | o.Mode&0o7777
		a.Nlink = 1
	}
	a.Uid, a.Gid = o.Uid, o.Gid
	mt := time.Unix(0, o.Mtime)
	ct := time.Unix(0, o.Ctime)
	a.SetTimes(&mt, &mt, &ct)
}

func (f *FS) entryOut(o *store.Object, size uint64, out *fuse.EntryOut) {
	f.fillAttr(o, size, &out.Attr)
	out.SetEntryTimeout(f.opts.EntryTimeout)
	out.SetAttrTimeout(f.opts.AttrTimeout)
}

// sizeOf returns the size a local process should see: the draft's while
// one is open here.
func (n *node) sizeOf(o *store.Object) uint64 {
	n.mu.Lock()
	d := n.mu.draft
	n.mu.Unlock()
	if d != nil {
		return d.Size()
	}
	return o.Size
}

func caller(ctx context.Context) (uid, gid uint32) {
	if c, ok := fuse.FromContext(ctx); ok {
		return c.Uid, c.Gid
	}
	return 0, 0
}

// Lookup implements gofs.NodeLookuper.
func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (ch *gofs.Inode, errno syscall.Errno) {
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, "lookup", key, 0, start, errno, err) }()
	if key, err = n.childKey(name); err != nil {
		return nil, toErrno(err)
	}
	o, err := n.fs.st.Stat(ctx, key)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			out.SetEntryTimeout(n.fs.opts.NegativeTimeout)
			err = nil
			return nil, syscall.ENOENT
		}
		return nil, toErrno(err)
	}
	ch = n.newChild(ctx, o)
	n.fs.entryOut(o, ch.Operations().(*node).sizeOf(o), out)
	return ch, 0
}

// Getattr implements gofs.NodeGetattrer.
func (n *node) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) (errno syscall.Errno) {
	start := time.Now()
	var err error
	key, ok := n.key()
	defer func() { n.fs.opDone(ctx, "getattr", key, 0, start, errno, err) }()
	var o *store.Object
	if h, isH := fh.(*handle); isH && h.reader != nil {
		o = h.reader.Object()
	} else if ok {
		if o, err = n.fs.st.Stat(ctx, key); err != nil {
			o = nil
		}
	}
	if o == nil {
		// Unlinked but still open: answer from what the handle knows.
		if h, isH := fh.(*handle); isH && h.obj != nil {
			o, err = h.obj, nil
		} else if err == nil {
			err = store.ErrNotFound
		}
	}
	if o == nil {
		return toErrno(err)
	}
	n.fs.fillAttr(o, n.sizeOf(o), &out.Attr)
	out.SetTimeout(n.fs.opts.AttrTimeout)
	return 0
}

// Setattr implements gofs.NodeSetattrer: size through the draft, the rest
// as a metadata update.
func (n *node) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) (errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key, ok := n.key()
	defer func() { n.fs.opDone(ctx, "setattr", key, 0, start, errno, err) }()
	if !ok {
		return syscall.ENOENT
	}
	if size, has := in.GetSize(); has {
		if n.IsDir() {
			return syscall.EISDIR
		}
		if err = n.truncate(ctx, key, size); err != nil {
			return toErrno(err)
		}
	}
	mode, hasMode := in.GetMode()
	uid, hasUID := in.GetUID()
	gid, hasGID := in.GetGID()
	mtime, hasMtime := in.GetMTime()
	if hasMtime {
		// An open writer commits at close: keep the time for that commit.
		n.mu.Lock()
		if d := n.mu.draft; d != nil {
			d.SetMtime(mtime.UnixNano())
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
				o.Mtime = mtime.UnixNano()
			}
			return nil
		})
		if err != nil {
			return toErrno(err)
		}
	}
	o, err := n.fs.st.Stat(ctx, key)
	if err != nil {
		return toErrno(err)
	}
	n.fs.fillAttr(o, n.sizeOf(o), &out.Attr)
	out.SetTimeout(n.fs.opts.AttrTimeout)
	return 0
}

// truncate changes the size. With writers open, the shared draft changes
// and becomes visible when they close; otherwise it commits at once.
func (n *node) truncate(ctx context.Context, key string, size uint64) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if d := n.mu.draft; d != nil {
		return d.Truncate(ctx, size)
	}
	d, err := n.openDraftLocked(ctx, key, size == 0)
	if err != nil {
		return err
	}
	defer func() {
		n.mu.draft = nil
		d.Close()
	}()
	if err := d.Truncate(ctx, size); err != nil {
		return err
	}
	_, err = d.Commit(ctx, store.CommitOptions{Key: key, IfIno: n.StableAttr().Ino})
	return err
}

// openDraftLocked starts the shared draft from the current version.
func (n *node) openDraftLocked(ctx context.Context, key string, trunc bool) (*store.Draft, error) {
	ino := n.StableAttr().Ino
	var base *store.Reader
	if !trunc {
		r, err := n.fs.st.OpenReader(ctx, key)
		if err != nil && !errors.Is(err, store.ErrNotFound) {
			return nil, err
		}
		if r != nil && r.Object().Ino != ino {
			r.Close()
			return nil, store.ErrStale
		}
		base = r
	}
	d := n.fs.st.NewDraft(ino, base, trunc)
	d.Place(n.fs.st.PlacementFor(ctx, key))
	n.mu.draft = d
	return d, nil
}

// commitLocked publishes the shared draft if it changed. A file that was
// unlinked or replaced while open loses its writes, as on any POSIX file
// system.
func (n *node) commitLocked(ctx context.Context) error {
	d := n.mu.draft
	if d == nil || !d.Dirty() {
		return nil
	}
	key, ok := n.key()
	if !ok {
		return nil
	}
	_, err := d.Commit(ctx, store.CommitOptions{Key: key, IfIno: n.StableAttr().Ino})
	if errors.Is(err, store.ErrStale) {
		return nil
	}
	return err
}

func (n *node) template(ctx context.Context, mode uint32) *store.Object {
	uid, gid := caller(ctx)
	return &store.Object{Mode: mode & 0o7777, Uid: uid, Gid: gid}
}

// Create implements gofs.NodeCreater.
func (n *node) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (ch *gofs.Inode, fh gofs.FileHandle, fuseFlags uint32, errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, "create", key, 0, start, errno, err) }()
	if key, err = n.childKey(name); err != nil {
		return nil, nil, 0, toErrno(err)
	}
	o, err := n.fs.st.Create(ctx, key, n.template(ctx, mode), flags&syscall.O_EXCL != 0)
	if err != nil {
		return nil, nil, 0, toErrno(err)
	}
	ch = n.newChild(ctx, o)
	cn := ch.Operations().(*node)
	h, err := cn.open(ctx, key, o, flags)
	if err != nil {
		return nil, nil, 0, toErrno(err)
	}
	n.fs.entryOut(o, cn.sizeOf(o), out)
	return ch, h, h.fuseFlags(), 0
}

// Open implements gofs.NodeOpener.
func (n *node) Open(ctx context.Context, flags uint32) (fh gofs.FileHandle, fuseFlags uint32, errno syscall.Errno) {
	start := time.Now()
	var err error
	key, ok := n.key()
	defer func() { n.fs.opDone(ctx, "open", key, 0, start, errno, err) }()
	if !ok {
		return nil, 0, syscall.ENOENT
	}
	h, err := n.open(ctx, key, nil, flags)
	if err != nil {
		return nil, 0, toErrno(err)
	}
	return h, h.fuseFlags(), 0
}

// Unlink implements gofs.NodeUnlinker.
func (n *node) Unlink(ctx context.Context, name string) (errno syscall.Errno) {
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
func (n *node) Rmdir(ctx context.Context, name string) (errno syscall.Errno) {
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
func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (ch *gofs.Inode, errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key := name
	defer func() { n.fs.opDone(ctx, "mkdir", key, 0, start, errno, err) }()
	if key, err = n.childKey(name); err != nil {
		return nil, toErrno(err)
	}
	o, err := n.fs.st.Mkdir(ctx, key, n.template(ctx, mode))
	if err != nil {
		return nil, toErrno(err)
	}
	ch = n.newChild(ctx, o)
	n.fs.entryOut(o, 0, out)
	return ch, 0
}

// Rename implements gofs.NodeRenamer.
func (n *node) Rename(ctx context.Context, name string, newParent gofs.InodeEmbedder, newName string, flags uint32) (errno syscall.Errno) {
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
	err = n.fs.st.Rename(ctx, key, to, f)
	return toErrno(err)
}

// Readdir implements gofs.NodeReaddirer.
func (n *node) Readdir(ctx context.Context) (ds gofs.DirStream, errno syscall.Errno) {
	start := time.Now()
	var err error
	key, ok := n.key()
	defer func() { n.fs.opDone(ctx, "readdir", key, 0, start, errno, err) }()
	if !ok {
		return nil, syscall.ENOENT
	}
	ents, err := n.fs.st.List(ctx, key)
	if err != nil {
		return nil, toErrno(err)
	}
	list := make([]fuse.DirEntry, 0, len(ents)+2)
	list = append(list, fuse.DirEntry{Name: ".", Mode: syscall.S_IFDIR, Ino: n.StableAttr().Ino})
	parentIno := n.StableAttr().Ino
	if _, p := n.Parent(); p != nil {
		parentIno = p.StableAttr().Ino
	}
	list = append(list, fuse.DirEntry{Name: "..", Mode: syscall.S_IFDIR, Ino: parentIno})
	for _, e := range ents {
		mode := uint32(syscall.S_IFREG)
		if e.Kind == store.KindDir {
			mode = syscall.S_IFDIR
		}
		list = append(list, fuse.DirEntry{Name: e.Name, Mode: mode, Ino: e.Ino})
	}
	return gofs.NewListDirStream(list), 0
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
	n.mu.Lock()
	d := n.mu.draft
	n.mu.Unlock()
	if d == nil {
		return syscall.EBADF
	}
	if end := off + size; end > d.Size() {
		err = d.Truncate(ctx, end)
	}
	return toErrno(err)
}

// Symlink, Link and Mknod: the store keeps files and directories only.
func (n *node) Symlink(context.Context, string, string, *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EOPNOTSUPP
}

func (n *node) Link(context.Context, gofs.InodeEmbedder, string, *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EOPNOTSUPP
}

func (n *node) Mknod(context.Context, string, uint32, uint32, *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	return nil, syscall.EOPNOTSUPP
}
