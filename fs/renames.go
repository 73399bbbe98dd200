package fs

import (
	"sync"
	"sync/atomic"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// renames sits in front of go-fuse's node bridge and holds FS.renaming
// (a read share) through each rename: from before node.Rename moves the
// key in the store until the bridge, after it returns, moves the inode
// in its tree. In between, node.key still says the old name, which the
// store no longer has; settledKey waits that out, and so does a call
// that failed meanwhile on a node under the moving one (afterRenames).
//
// It also keeps lookups and renames of one directory apart (dirs): a
// lookup reads the store, and the bridge then enters what it found in
// its tree. The kernel sends lookups that revalidate a cached name
// without the directory's lock, so a whole rename could run in between,
// and the tree then gave the moved file its old name back (a file as its
// newest name, a directory for good), which node.key answers until the
// next rename: a writer's close then committed at a name the store no
// longer had and its bytes were dropped as a removed file's.
type renames struct {
	fuse.RawFileSystem
	mu    *sync.RWMutex
	moves *moves
	dirs  *dirLocks
	hooks *testHooks
}

// dirLocks are read-held by a lookup in a directory, from before it
// reads the store until the bridge entered its answer in the tree, and
// held by a rename for its old and new directories: one lock a directory
// in use, by node ID, so that a long rename (of a directory of many
// entries) holds off lookups in its own directories only. (Renames in
// one directory, or across two, are serialized by the kernel anyway, and
// so are the lookups it makes with the directory's lock held.)
type dirLocks struct {
	shards [64]struct {
		mu sync.Mutex
		m  map[uint64]*dirLock
	}
}

// dirLock is one directory's lock and how many calls hold or wait for it.
type dirLock struct {
	sync.RWMutex
	refs int
}

// get returns directory id's lock, counted in until put.
func (l *dirLocks) get(id uint64) *dirLock {
	sh := &l.shards[id%uint64(len(l.shards))]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	d := sh.m[id]
	if d == nil {
		if sh.m == nil {
			sh.m = map[uint64]*dirLock{}
		}
		d = &dirLock{}
		sh.m[id] = d
	}
	d.refs++
	return d
}

// put counts a call out of directory id's lock d, which goes once none
// is in.
func (l *dirLocks) put(id uint64, d *dirLock) {
	sh := &l.shards[id%uint64(len(l.shards))]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if d.refs--; d.refs == 0 {
		delete(sh.m, id)
	}
}

// Lookup implements fuse.RawFileSystem.
func (r renames) Lookup(cancel <-chan struct{}, header *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	d := r.dirs.get(header.NodeId)
	defer r.dirs.put(header.NodeId, d)
	d.RLock()
	defer d.RUnlock()
	return r.RawFileSystem.Lookup(cancel, header, name, out)
}

// Rename implements fuse.RawFileSystem.
func (r renames) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	req := r.moves.begin(cancel)
	defer r.moves.end(cancel, req)
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.hooks.renameWaits != nil {
		r.hooks.renameWaits()
	}
	// The two directories' locks, the lower node ID's first (one when
	// they are the same).
	lo, hi := min(in.NodeId, in.Newdir), max(in.NodeId, in.Newdir)
	dl := r.dirs.get(lo)
	defer r.dirs.put(lo, dl)
	dl.Lock()
	defer dl.Unlock()
	if hi != lo {
		dh := r.dirs.get(hi)
		defer r.dirs.put(hi, dh)
		dh.Lock()
		defer dh.Unlock()
	}
	return r.RawFileSystem.Rename(cancel, in, oldName, newName)
}

// moves follows the renames in flight, for the calls whose node one of
// them moves: such a call computes its key from go-fuse's tree (node.key),
// which moves the node only after the store did, so in between the call
// looks for the node at its old name and finds nothing (ENOENT, ESTALE;
// a dirfd-relative stat, an open by a directory descriptor or the
// working directory). The call then waits for the rename and goes again
// (afterRenames), as on tmpfs, where a rename moves a name at once.
type moves struct {
	// started and done count the renames begun and ended: a call that
	// failed knows whether one ran since it began, whatever it moved.
	started, done atomic.Uint64
	mu            sync.Mutex
	byReq         map[<-chan struct{}]*moveReq // in flight, by request
}

// moveReq is one rename request in flight: the marks of its try now.
// Only the request's own goroutine touches it.
type moveReq struct {
	cur *moveWait
}

// moveWait is the marks of one try of a rename: the nodes it moves
// (node.moving points here) and what closes once they are gone, when
// go-fuse's tree has the nodes at their new names or the try failed in
// the store. A rename holds marks only from just before its store
// rename until then, and never waits for another meanwhile, so waits
// for marks never go round in a circle.
type moveWait struct {
	done  chan struct{}
	nodes []*node
}

// moveMark is what a call knows of the renames when it began.
type moveMark struct {
	started, done uint64
}

func newMoves() *moves {
	return &moves{byReq: map[<-chan struct{}]*moveReq{}}
}

// begin counts a rename of request cancel in and registers it for
// node.Rename, which marks the nodes it moves (marking).
func (m *moves) begin(cancel <-chan struct{}) *moveReq {
	r := &moveReq{}
	m.mu.Lock()
	m.byReq[cancel] = r
	m.mu.Unlock()
	m.started.Add(1)
	return r
}

// end counts the rename out once go-fuse moved its nodes in its tree
// (or it failed): its marks go and their waiters go again. It is counted
// first: a call that finds no mark on its way up then sees the count
// moved (waitMoves), never neither.
func (m *moves) end(cancel <-chan struct{}, r *moveReq) {
	m.done.Add(1)
	r.release()
	m.mu.Lock()
	delete(m.byReq, cancel)
	m.mu.Unlock()
}

// marking marks n as moved by the rename of request cancel (nothing when
// the request is not a rename through renames, as in tests of the node
// layer alone, whose FS may have no moves).
func (m *moves) marking(cancel <-chan struct{}, n *node) {
	r := m.request(cancel)
	if r == nil || n == nil {
		return
	}
	if r.cur == nil {
		r.cur = &moveWait{done: make(chan struct{})}
	}
	n.moving.Store(r.cur)
	r.cur.nodes = append(r.cur.nodes, n)
}

// unmark drops the marks of request cancel's try, which moved nothing
// (its store rename failed).
func (m *moves) unmark(cancel <-chan struct{}) {
	if r := m.request(cancel); r != nil {
		r.release()
	}
}

func (m *moves) request(cancel <-chan struct{}) *moveReq {
	if m == nil || cancel == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.byReq[cancel]
}

// release drops r's marks and wakes their waiters.
func (r *moveReq) release() {
	w := r.cur
	if w == nil {
		return
	}
	r.cur = nil
	for _, n := range w.nodes {
		n.moving.CompareAndSwap(w, nil)
	}
	close(w.done)
}

func (m *moves) mark() moveMark {
	if m == nil {
		return moveMark{}
	}
	return moveMark{started: m.started.Load(), done: m.done.Load()}
}

// maxMoveTries bounds how often afterRenames runs a call.
const maxMoveTries = 5

// afterRenames runs call, and again while it fails with ENOENT or ESTALE
// and a rename may have moved n (or a directory above it) under it: it
// waits for a rename that still moves one, and goes again at once when a
// rename began or ended since call began (n's name may have changed by
// then). A call that fails with no rename since it began fails once.
func (n *node) afterRenames(call func() syscall.Errno) syscall.Errno {
	return n.afterRenamesUntil(func() (syscall.Errno, bool) { return call(), false })
}

// afterRenamesUntil is afterRenames for a call that may say its answer is
// final (it changed something before it failed: it is not run again).
func (n *node) afterRenamesUntil(call func() (syscall.Errno, bool)) syscall.Errno {
	for try := 1; ; try++ {
		m := n.fs.moves.mark()
		errno, final := call()
		if final || errno != syscall.ENOENT && errno != syscall.ESTALE || try == maxMoveTries || !n.waitMoves(m) {
			return errno
		}
	}
}

// waitMoves waits for the renames that move n or a directory above it,
// and reports whether a rename began or ended since m (those, or others:
// n may have been moved meanwhile by one that has ended; one that was
// under way at m and has neither marked n's way up nor ended has moved
// nothing of it yet).
func (n *node) waitMoves(m moveMark) bool {
	root := n.Root()
	for cur := &n.Inode; cur != nil && cur != root; {
		if cn := nodeOf(cur); cn != nil {
			if w := cn.moving.Load(); w != nil {
				<-w.done
				return true
			}
		}
		_, cur = cur.Parent()
	}
	mv := n.fs.moves
	return mv != nil && (mv.started.Load() != m.started || mv.done.Load() != m.done)
}

// settledKey is n.key once no rename is between the store and go-fuse's
// tree: for a writer whose commit found its file, or its call's
// directory, gone from the name it had, to learn whether a rename moved
// it (and where) or it really went.
func (n *node) settledKey() (string, bool) {
	n.fs.renaming.Lock()
	n.fs.renaming.Unlock() // (a wait for the renames in flight: nothing to guard)
	return n.key()
}

// namesSettled runs fn with no rename in flight and none starting until
// it returns: go-fuse's tree then has every file of this node where the
// store has it, so node.key is a file's name in the store, for a call
// that found its file gone from its name and must tell a rename from a
// removal.
func (f *FS) namesSettled(fn func()) {
	if f.hooks.settling != nil {
		f.hooks.settling()
	}
	f.renaming.Lock()
	defer f.renaming.Unlock()
	fn()
}

// nodeOf is the node of inode in, nil for one of another kind.
func nodeOf(in *gofs.Inode) *node {
	n, _ := in.Operations().(*node)
	return n
}
