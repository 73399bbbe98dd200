package fs

import (
	"slices"
	"sync"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// closers decides which close(2) of a writable file publishes it.
//
// The kernel sends FLUSH for every close of every descriptor of an open
// file, also those a child inherited: a process that forks a helper while
// it writes (subprocess, system(3)) would otherwise see the helper's exit
// or exec publish half of its file. The rule:
//
//   - a close publishes when the closing process changed the file through
//     that open file (write, ftruncate: the kernel names the closer's and
//     the writer's descriptor table, FUSE's lock owner), or is the process
//     that opened it (the opening thread or another of its process);
//   - fsync always publishes;
//   - the last close of the open file (RELEASE) publishes whatever is
//     left, whoever closed it.
//
// A close by a process that only inherited the descriptor publishes
// nothing. The table sits in front of go-fuse's node bridge because the
// node API does not pass lock owners on.
type closers struct {
	fuse.RawFileSystem
	mu struct {
		sync.Mutex
		m map[uint64]*writerSet // writable open files, by file handle
	}
}

// writerSet is who may publish one writable open file at close.
type writerSet struct {
	opener uint32   // thread that opened it
	opened int64    // when (bootTicks): a later thread of that id is another
	owners []uint64 // lock owners that changed it; few per file
}

func newClosers(raw fuse.RawFileSystem) *closers {
	c := &closers{RawFileSystem: raw}
	c.mu.m = make(map[uint64]*writerSet)
	return c
}

func (c *closers) opened(flags uint32, caller uint32, fh uint64) {
	if flags&syscall.O_ACCMODE == syscall.O_RDONLY {
		return
	}
	c.mu.Lock()
	c.mu.m[fh] = &writerSet{opener: caller, opened: bootTicks()}
	c.mu.Unlock()
}

func (c *closers) changed(fh, owner uint64) {
	c.mu.Lock()
	if w := c.mu.m[fh]; w != nil && !slices.Contains(w.owners, owner) {
		w.owners = append(w.owners, owner)
	}
	c.mu.Unlock()
}

// publishes reports whether a FLUSH of fh by owner (thread pid) commits.
// Handles it does not know (read-only ones) pass through. A close by
// another thread of the opener's process publishes too: a file changed
// only through a mapping has no owner (the kernel's writeback names
// none), and a Go program or a thread pool closes where it likes; such
// closes published only at RELEASE, after close(2) had returned (25 of
// 300 reads right after the close saw the old content). The opener is
// known by its thread id and that thread's start, by the open's tick:
// its id, free again once it exits, can name a thread of a forked child
// (a review made one that published its parent's half-written file).
// A start in the open's own tick counts as the opener's: the first file
// of a program is often opened that soon (1 in 300 reads saw the old
// content when it did not), and an id comes back that fast only to root
// (startedBy). Once seen, the owner (the process's descriptor table)
// publishes without a look.
func (c *closers) publishes(fh, owner uint64, pid uint32) bool {
	c.mu.Lock()
	w := c.mu.m[fh]
	if w == nil || slices.Contains(w.owners, owner) {
		c.mu.Unlock()
		return true
	}
	opener, opened := w.opener, w.opened
	c.mu.Unlock()
	if (pid != opener && !sameProcess(pid, opener)) || !startedBy(opener, opened) {
		return false
	}
	c.changed(fh, owner)
	return true
}

// Open implements fuse.RawFileSystem.
func (c *closers) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := c.RawFileSystem.Open(cancel, in, out)
	if st.Ok() {
		c.opened(in.Flags, in.Pid, out.Fh)
	}
	return st
}

// Create implements fuse.RawFileSystem.
func (c *closers) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	st := c.RawFileSystem.Create(cancel, in, name, out)
	if st.Ok() {
		c.opened(in.Flags, in.Pid, out.Fh)
	}
	return st
}

// Write implements fuse.RawFileSystem.
func (c *closers) Write(cancel <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	if in.WriteFlags&fuse.WRITE_LOCKOWNER != 0 {
		c.changed(in.Fh, in.LockOwner)
	}
	return c.RawFileSystem.Write(cancel, in, data)
}

// Writev implements fuse.RawFileSystem: go-fuse sends writes here first.
func (c *closers) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	if in.WriteFlags&fuse.WRITE_LOCKOWNER != 0 {
		c.changed(in.Fh, in.LockOwner)
	}
	return c.RawFileSystem.Writev(cancel, in, data)
}

// SetAttr implements fuse.RawFileSystem: ftruncate names its owner.
func (c *closers) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	const want = fuse.FATTR_FH | fuse.FATTR_LOCKOWNER | fuse.FATTR_SIZE
	if in.Valid&want == want {
		c.changed(in.Fh, in.LockOwner)
	}
	return c.RawFileSystem.SetAttr(cancel, in, out)
}

// Flush implements fuse.RawFileSystem.
func (c *closers) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	if !c.publishes(in.Fh, in.LockOwner, in.Pid) {
		return fuse.OK
	}
	return c.RawFileSystem.Flush(cancel, in)
}

// Release implements fuse.RawFileSystem. The entry goes first: go-fuse
// may hand the same handle number to the next open once it returns.
func (c *closers) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	c.mu.Lock()
	delete(c.mu.m, in.Fh)
	c.mu.Unlock()
	c.RawFileSystem.Release(cancel, in)
}
