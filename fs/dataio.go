package fs

import (
	"context"
	"errors"
	"fmt"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Errors of the data-path ioctls.
var (
	errNotWritable = errors.New("fs: put on a file not open for writing")
	errBufRange    = errors.New("fs: range outside the registered buffer")
	errNotDirFd    = errors.New("fs: batch needs a directory")
	errBadBatch    = errors.New("fs: malformed batch")
)

// regBuffer returns [off, off+n) of registration id as a transfer buffer
// for a request of thread tid, held until the caller calls
// r.inflight.Done. checked is a registration of process memory that the
// same request already found tid may use (nil: none): the thread stays
// blocked in the request, so the answer holds for all of it.
func regBuffer(t *regTable, tid int, id, off, n uint64, checked *registration) (buf transfer.Buffer, r *registration, err error) {
	r, err = t.get(id)
	if err != nil {
		return transfer.Buffer{}, nil, err
	}
	if buf, err = r.buffer(tid, off, n, checked); err != nil {
		r.inflight.Done()
		return transfer.Buffer{}, nil, err
	}
	return buf, r, nil
}

// buffer is regBuffer of r, which the caller holds.
func (r *registration) buffer(tid int, off, n uint64, checked *registration) (transfer.Buffer, error) {
	if size := r.size(); off > size || n > size-off {
		return transfer.Buffer{}, fmt.Errorf("%d B at %d of a %d B buffer: %w", n, off, size, errBufRange)
	}
	if r.vmTgid != 0 {
		// Memory of the process that registered it, reached through the
		// caller's thread: only its own threads may use it, and while one
		// is blocked in this request the process and its memory stay.
		if r != checked && (tid == 0 || !inGroup(r.vmTgid, tid)) {
			return transfer.Buffer{}, fmt.Errorf("buffer of process %d used by thread %d: %w", r.vmTgid, tid, errNotOwner)
		}
		return transfer.VMBuffer(tid, r.vmAddr+off, n), nil
	}
	if r.gpu != nil {
		return transfer.CUDAAllocBuffer(r.gpu.ctx, r.gpu.base, r.gpuOff+off, n), nil
	}
	return transfer.Buffer{Kind: transfer.Registered, Mem: r.mem[off : off+n]}, nil
}

// checkPut refuses put flags the ABI does not know and an object offset
// without FlagUpdate.
func checkPut(flags uint32, objOff uint64) error {
	if err := ioctl.ValidatePut(flags); err != nil {
		return err
	}
	if flags&ioctl.FlagUpdate == 0 && objOff != 0 {
		return fmt.Errorf("put at object offset %d without FlagUpdate: %w", objOff, store.ErrInvalid)
	}
	return nil
}

// putObject writes buf as key's new content (or, with FlagUpdate, into a
// copy of its content at objOff) and commits it: the whole put is one
// atomic version change. It acts on the version cur the caller checked
// (its permissions, FlagExcl), nil when it found no file: a key changed
// meanwhile (a rename over it, say) fails with ErrConflict and is not
// touched. tmpl gives a new file's owner, mode and inode; its owner is the
// caller, whose put over a file clears its set-ID bits as write(2) does.
func (f *FS) putObject(ctx context.Context, key string, cur, tmpl *store.Object, bufs []transfer.Buffer, objOff uint64, flags uint32, xattrs map[string][]byte) (*store.Object, error) {
	if err := checkPut(flags, objOff); err != nil {
		return nil, err
	}
	if flags&ioctl.FlagExcl != 0 && cur != nil {
		return nil, fmt.Errorf("put %q: %w", key, store.ErrExists)
	}
	opts := store.CommitOptions{Key: key, Template: tmpl, Exclusive: cur == nil, SetXattrs: xattrs, Last: true,
		KillSUID: tmpl != nil && tmpl.Uid != 0} // tmpl's owner is the caller
	var d *store.Draft
	switch {
	case cur != nil && flags&ioctl.FlagUpdate == 0:
		// A whole new content: nothing of the old one is read.
		opts.IfVersion = cur.Version
		d = f.st.NewDraft(cur.Ino, nil, true)
	case cur != nil:
		opts.IfVersion = cur.Version
		base, err := f.st.OpenReader(ctx, key)
		if errors.Is(err, store.ErrNotFound) {
			return nil, fmt.Errorf("put %q: removed since checked: %w", key, store.ErrConflict)
		}
		if err != nil {
			return nil, err
		}
		if base.Object().Version != cur.Version {
			base.Close()
			return nil, fmt.Errorf("put %q: changed since checked: %w", key, store.ErrConflict)
		}
		d = f.st.NewDraft(cur.Ino, base, false)
	default:
		d = f.st.NewDraft(tmpl.Ino, nil, true)
	}
	defer d.Close()
	d.Place(f.st.PlacementFor(ctx, key))
	if flags&ioctl.FlagUpdate == 0 {
		var n uint64
		for _, b := range bufs {
			n += b.Size()
		}
		d.Expect(n)
	}
	if errs := f.st.WriteMany(ctx, []store.DraftWrite{{Draft: d, Bufs: bufs, Off: objOff}}); errs != nil {
		return nil, errs[0]
	}
	o, err := d.Commit(ctx, opts)
	if errors.Is(err, store.ErrExists) && flags&ioctl.FlagExcl == 0 {
		// Created since checked: its permissions were not.
		err = fmt.Errorf("put %q: created since checked (%v): %w", key, err, store.ErrConflict)
	}
	return o, err
}

// getObject reads up to buf's size at objOff of key's current version (or
// of r, when the caller holds one).
func (f *FS) getObject(ctx context.Context, key string, r *store.Reader, buf transfer.Buffer, objOff uint64) (uint64, uint64, error) {
	if r == nil {
		var err error
		if r, err = f.st.OpenReader(ctx, key); err != nil {
			return 0, 0, err
		}
		defer r.Close()
	}
	n, err := r.ReadTo(ctx, buf, objOff)
	return n, r.Object().Version, err
}

// invalidation is what the kernel must forget about a key after a put by
// name: the inode's attributes if it is known, its name if it names
// another inode (a file evicted or removed since the kernel looked it
// up), else a negative dentry in its parent if the daemon answered one
// (negative.go).
type invalidation struct {
	in      *gofs.Inode
	name    string // entry of in to forget; "" for in's content
	content bool
}

// invalidation finds what the kernel may hold about dir/rel, whose file
// is now inode ino, without telling it: the caller applies it once its
// commit is done, and only when there is one (applyAll).
func (n *node) invalidation(rel string, ino uint64) (invalidation, bool) {
	inv, ok, neg := n.knownInvalidation(rel, ino)
	if neg {
		ok = n.fs.neg.cached(inv.in.StableAttr().Ino, inv.name)
	}
	if !ok {
		return invalidation{}, false
	}
	return inv, true
}

// knownInvalidation is invalidation from the inodes the kernel knows:
// for a name it knows no inode of, it returns neg and the entry to
// forget if the daemon answered ENOENT for it (negatives.cached, or
// cachedMany for a batch's names).
func (n *node) knownInvalidation(rel string, ino uint64) (inv invalidation, ok, neg bool) {
	parent, name, ch, _ := walkKnown(&n.Inode, rel)
	switch {
	case ch == nil:
		// The kernel may hold the name as missing: a key, or a
		// directory a put made (FlagParents), is there now.
		return invalidation{in: parent, name: name}, false, true
	case ch.StableAttr().Ino != ino:
		// A name for a file gone: forgotten, the next walk finds this
		// one (an open of the old node would answer ESTALE).
		return invalidation{in: parent, name: name}, true, false
	}
	return invalidation{in: ch, content: true}, true, false
}

// apply tells the kernel. A known file's shared draft (a descriptor
// holding it read-write) moves onto the put's version first, when it has
// no changes of its own (node.rebaseShared): its readers follow that
// draft, and an append would publish it over the put.
func (inv invalidation) apply(ctx context.Context) {
	if inv.content {
		if nd, ok := inv.in.Operations().(*node); ok {
			nd.rebaseShared(ctx)
		}
		inv.in.NotifyContent(0, 0)
	} else {
		inv.in.NotifyEntry(inv.name)
	}
}

// applyAll applies invs before the put by name that made them replies:
// its request is on the directory, not on the keys' inodes, so the
// kernel holds nothing of theirs for it. Applied after the reply, a
// caller that mapped a key right after its put had the late invalidation
// drop pages the daemon was writing (a get into the mapping lost them),
// and its fstat saw the old size.
func applyAll(ctx context.Context, invs []invalidation) {
	for _, inv := range invs {
		inv.apply(ctx)
	}
}

// maxPutRetries bounds how often a batch put of one key looks again at a
// key that changed between its check and its commit.
const maxPutRetries = 8

// ioctlData serves the data-path commands: it fills out and returns the
// ioctl's value (a submitted call's number) and its error.
func (n *node) ioctlData(ctx context.Context, fh any, cmd uint32, in, out []byte) (int32, error) {
	switch cmd {
	case ioctl.CmdBatchPutV, ioctl.CmdBatchGetV, ioctl.CmdBatchWait:
		dh, ok := fh.(*dirHandle)
		if !ok {
			if _, file := fh.(*handle); file {
				return 0, errNotDirFd
			}
			return 0, syscall.EBADF
		}
		if cmd == ioctl.CmdBatchWait {
			// The handle's calls, whatever became of its directory: one
			// removed or moved away must not keep them from their waiter
			// (who could then never know the daemon is done with its
			// memory) nor hold the handle's slots.
			return 0, dh.async.wait(in, out)
		}
		key, ok := n.key()
		if !ok {
			return 0, goneErr(true)
		}
		return n.vbatch(ctx, dh, key, cmd == ioctl.CmdBatchPutV, in, out)
	}
	return 0, n.ioctlFixed(ctx, fh, cmd, in, out)
}

// goneErr is the error of a key call through the handle of a file or
// directory (dir) that was removed or replaced: a directory's is ENOENT,
// as openat(2) with its descriptor says; a file's ErrStale, as its
// writes say (putThrough).
func goneErr(dir bool) error {
	if dir {
		return fmt.Errorf("the handle's directory was removed: %w", store.ErrNotFound)
	}
	return store.ErrStale
}

// ioctlFixed serves the data-path commands whose value is 0.
func (n *node) ioctlFixed(ctx context.Context, fh any, cmd uint32, in, out []byte) error {
	var regs *regTable
	var h *handle
	var dh *dirHandle
	switch x := fh.(type) {
	case *handle:
		h, regs = x, &x.regs
	case *dirHandle:
		dh, regs = x, &x.regs
	default:
		return syscall.EBADF
	}
	switch cmd {
	case ioctl.CmdRegisterBuffer:
		var a ioctl.RegisterArg
		if err := a.Unmarshal(in); err != nil {
			return err
		}
		if err := n.fs.register(ctx, regs, &a); err != nil {
			return err
		}
		copy(out, a.Marshal())
		return nil
	case ioctl.CmdUnregisterBuffer:
		var a ioctl.UnregisterArg
		if err := a.Unmarshal(in); err != nil {
			return err
		}
		return regs.remove(a.ID)
	}
	key, ok := n.key()
	if !ok {
		return goneErr(dh != nil)
	}
	switch cmd {
	case ioctl.CmdBatchPut, ioctl.CmdBatchGet:
		if dh == nil {
			return errNotDirFd
		}
		return n.batch(ctx, dh, key, cmd == ioctl.CmdBatchPut, in, out)
	case ioctl.CmdBatchPutTable, ioctl.CmdBatchGetTable:
		if dh == nil {
			return errNotDirFd
		}
		return n.batchTable(ctx, dh, key, cmd == ioctl.CmdBatchPutTable, in, out)
	case ioctl.CmdPutKey, ioctl.CmdGetKey:
		if dh == nil {
			return errNotDirFd
		}
		return n.keyCmd(ctx, dh, key, cmd == ioctl.CmdPutKey, false, in, out)
	case ioctl.CmdPutKeyInline, ioctl.CmdGetKeyInline:
		if dh == nil {
			return errNotDirFd
		}
		return n.keyCmd(ctx, dh, key, cmd == ioctl.CmdPutKeyInline, true, in, out)
	}
	if h == nil {
		return store.ErrIsDir
	}
	switch cmd {
	case ioctl.CmdPutBuf, ioctl.CmdGetBuf:
		var a ioctl.BufArg
		if err := a.Unmarshal(in); err != nil {
			return err
		}
		// The caller's thread: only registrations by address need it.
		tid := 0
		if c, ok := fuse.FromContext(ctx); ok {
			tid = int(c.Pid)
		}
		buf, r, err := regBuffer(regs, tid, a.ID, a.BufOff, a.Len, nil)
		if err != nil {
			return err
		}
		defer r.inflight.Done()
		a.Result, a.Version, err = n.moveData(ctx, h, key, cmd == ioctl.CmdPutBuf, buf, a.ObjOff, a.Flags)
		if err != nil {
			return err
		}
		copy(out, a.Marshal())
		return nil
	case ioctl.CmdPutVM, ioctl.CmdGetVM:
		var a ioctl.VMArg
		if err := a.Unmarshal(in); err != nil {
			return err
		}
		// The caller is blocked in this ioctl, so its thread id names it
		// for the whole call; it can only reach its own memory.
		c, ok := fuse.FromContext(ctx)
		if !ok || c.Pid == 0 {
			return errNotOwner
		}
		buf := transfer.VMBuffer(int(c.Pid), a.Addr, a.Len)
		var err error
		a.Result, a.Version, err = n.moveData(ctx, h, key, cmd == ioctl.CmdPutVM, buf, a.ObjOff, a.Flags)
		if err != nil {
			return err
		}
		copy(out, a.Marshal())
		return nil
	case ioctl.CmdPutCUDA, ioctl.CmdGetCUDA:
		return n.ioctlCUDA(ctx, h, key, cmd == ioctl.CmdPutCUDA, in, out)
	case ioctl.CmdStat:
		var a ioctl.StatArg
		err := a.Unmarshal(in)
		if err != nil {
			return err
		}
		// The version GETs through this handle would read: the one held
		// by a read-only handle, else the current one.
		var o *store.Object
		if h.reader != nil {
			o = h.reader.Object()
		} else if o, err = n.fs.st.Stat(ctx, key); err != nil {
			return err
		}
		a = ioctl.StatArg{Header: a.Header, ObjSize: o.Size, Version: o.Version, Ino: o.Ino, MtimeNs: o.Mtime,
			Mode: o.Mode, Replicas: uint32(len(o.Replicas))}
		if o.Pinned {
			a.Pinned = 1
		}
		if len(o.Replicas) > 0 {
			a.Extents = uint32(len(o.Replicas[0].Extents))
		}
		copy(a.Location[:len(a.Location)-1], location(o))
		copy(out, a.Marshal())
		return nil
	}
	return syscall.ENOTTY
}

// moveData runs one put or get through handle h.
func (n *node) moveData(ctx context.Context, h *handle, key string, put bool, buf transfer.Buffer, objOff uint64, flags uint32) (uint64, uint64, error) {
	if !put {
		if flags != 0 {
			return 0, 0, fmt.Errorf("get flags %#x: %w", flags, ioctl.ErrFlags)
		}
		return n.fs.getObject(ctx, key, h.reader, buf, objOff)
	}
	if !h.writable {
		return 0, 0, errNotWritable
	}
	o, err := n.putThrough(ctx, h, key, buf, objOff, flags)
	if err != nil {
		return 0, 0, err
	}
	// Before the reply, as a put by name (applyAll): after it, a stat
	// right after the put saw the old size (36 of 300). An ioctl holds
	// no lock of the inode in the kernel, and the copy is done: the
	// invalidation waits for no request of this one.
	n.NotifyContent(0, 0)
	return buf.Size(), o.Version, nil
}

// putThrough runs a PUT ioctl through writable handle h by the rules of
// write(2) and close(2): its bytes become the content of the handle's
// draft (with FlagUpdate, a write into it), and the draft is published
// as a close publishes it, only while the key still holds this file. A
// put through a file that was unlinked or replaced fails with ErrStale and
// creates nothing; a later close never publishes older writes over it.
// A put without FlagUpdate that fails changes nothing; a failed update
// fails the draft, as a failed write does.
func (n *node) putThrough(ctx context.Context, h *handle, key string, buf transfer.Buffer, objOff uint64, flags uint32) (*store.Object, error) {
	if err := checkPut(flags, objOff); err != nil {
		return nil, err
	}
	if flags&ioctl.FlagParents != 0 {
		return nil, fmt.Errorf("put through an open file with FlagParents: %w", store.ErrInvalid)
	}
	d := h.draft()
	if d == nil {
		return nil, errNotWritable
	}
	n.putMu.Lock()
	defer n.putMu.Unlock()
	ino := n.StableAttr().Ino
	uid, _ := caller(ctx)
	opts := store.CommitOptions{Key: key, IfIno: ino, KillSUID: uid != 0}
	if putMeta(flags, nil) {
		// New bytes: the meta of the old ones no longer describes them.
		opts.SetXattrs = dropMeta
	}
	if flags&ioctl.FlagExcl != 0 {
		// Only into the empty file at the version seen at open.
		cur, err := n.fs.st.Stat(ctx, key)
		if err != nil {
			return nil, err
		}
		if cur.Ino != ino {
			return nil, fmt.Errorf("put %q (inode %d): replaced: %w", key, ino, store.ErrStale)
		}
		if cur.Size != 0 || h.obj == nil || cur.Version != h.obj.Version || d.Size() != 0 {
			return nil, fmt.Errorf("put %q: %w", key, store.ErrExists)
		}
		opts.IfVersion = cur.Version
	}
	var o *store.Object
	var err error
	if flags&ioctl.FlagUpdate == 0 {
		// A whole new content: written aside, so a put that fails
		// changes nothing, then committed as the handle's draft's next
		// version (what it held before is replaced).
		src := n.fs.st.NewDraft(ino, nil, true)
		defer src.Close()
		src.Place(n.fs.st.PlacementFor(ctx, key))
		src.Expect(buf.Size())
		if _, err := src.WriteFrom(ctx, buf, 0); err != nil {
			return nil, err
		}
		o, err = n.commitFollowing(ctx, &opts, func() (*store.Object, error) { return d.CommitInto(ctx, src, opts) })
	} else {
		// An update edits the content as it stands, pending writes
		// included: a write into the draft, as pwrite(2) then fsync(2).
		// The handle's draft is read by others while it is written:
		// process memory is staged (WriteStaged).
		if _, err := d.WriteStaged(ctx, buf, objOff); err != nil {
			return nil, err
		}
		o, err = n.commitFollowing(ctx, &opts, func() (*store.Object, error) { return d.Commit(ctx, opts) })
	}
	if errors.Is(err, store.ErrConflict) && flags&ioctl.FlagExcl != 0 {
		return nil, fmt.Errorf("put %q: another writer won: %w", key, store.ErrExists)
	}
	return o, err
}

// maxFollows bounds how often one commit follows its file to a new name
// another node gave it.
const maxFollows = 8

// commitFollowing runs commit at opts.Key, the file's name when its
// write began, and once more at its name now when the commit found
// another inode there, or none (ErrStale), because a rename moved the
// file meanwhile: a file's writes follow it to its new name, as
// write(2)'s do. The second try runs with no rename in flight and none
// starting until it is done (namesSettled), so the name it commits at is
// the file's in the store: a file renamed back and forth while its
// writer publishes is found, never taken for gone. In a cluster, where
// another node's rename moves no inode in this kernel's tree, a commit
// that still finds nothing there follows the index (keyOfIno), up to
// maxFollows times. One unlinked or replaced keeps ErrStale. opts.Key
// is the name committed at.
func (n *node) commitFollowing(ctx context.Context, opts *store.CommitOptions, commit func() (*store.Object, error)) (*store.Object, error) {
	o, err := commit()
	if hook := n.fs.hooks.commitStale; hook != nil && errors.Is(err, store.ErrStale) {
		hook(opts.Key)
	}
	for i := 0; errors.Is(err, store.ErrStale) && i < maxFollows; i++ {
		found := false
		if i == 0 {
			n.fs.namesSettled(func() {
				var now string
				if now, found = n.key(); found {
					opts.Key = now
					o, err = commit()
				}
			})
		} else {
			// Another node moved it: the index's scan and the commit
			// there run with renames free to go on (a local one shows on
			// the next look).
			var now string
			if now, found = n.fs.keyOfIno(ctx, n.StableAttr().Ino); found {
				opts.Key = now
				o, err = commit()
			}
		}
		if !found || !n.fs.opts.Cluster {
			break
		}
	}
	return o, err
}

// scanPage is how many objects keyOfIno reads from the index at a time.
const scanPage = 4096

// keyOfIno finds the file with inode ino in the index, for a writer
// whose file another node renamed (its name here still the old one),
// done only when a commit found its file gone from its name: one look
// where the index keeps files by inode number (store.InoFinder, the
// cluster's), else a walk of the whole index, a page at a time. A file
// unlinked everywhere is not found.
func (f *FS) keyOfIno(ctx context.Context, ino uint64) (string, bool) {
	if fi, ok := f.st.Index().(store.InoFinder); ok {
		key, found, err := fi.FindIno(ctx, ino)
		return key, found && err == nil
	}
	from := ""
	for {
		objs, err := f.st.Index().Scan(ctx, "", from, scanPage)
		if err != nil {
			return "", false
		}
		for _, o := range objs {
			if o.Ino == ino && o.Kind == store.KindFile && !store.IsInternal(o.Key) {
				return o.Key, true
			}
		}
		if len(objs) < scanPage {
			return "", false
		}
		from = objs[len(objs)-1].Key + "\x00"
	}
}

// mayPut checks that the caller may write key (its current version cur,
// nil when there is none: then its parent directory).
func (n *node) mayPut(ctx context.Context, p *callerProc, key string, cur *store.Object) error {
	switch {
	case cur != nil && cur.Kind == store.KindDir:
		return store.ErrIsDir
	case cur != nil && !allowed(p, cur, mayWrite):
		return syscall.EACCES
	case cur == nil:
		parent, err := n.fs.st.Stat(ctx, store.Parent(key))
		if err != nil {
			return err
		}
		return mayCreate(p, parent)
	}
	return nil
}

// mayCreate checks that the caller may make an entry in directory dir.
func mayCreate(p *callerProc, dir *store.Object) error {
	if !allowed(p, dir, mayWrite|mayExec) {
		return syscall.EACCES
	}
	return nil
}
