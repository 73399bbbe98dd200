package fs

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// handle is one open file description.
//
// A read-only handle holds a Reader: it reads the version that was current
// at open, even if the file is replaced or removed meanwhile. One opened
// while writers share the file (its shared draft: writers without
// O_TRUNC) reads their draft instead, as it grows, and once the last of
// them is gone the version they published (follow, live), as readers of
// a file written in place do on tmpfs: git's index-pack reads the pack its
// other half is still writing. So does one opened before them, when their
// draft starts from the version it reads (node.mu.readers): tail -f sees
// what >> appends. A writable
// handle opened with O_TRUNC writes a new version of its own (priv): two
// processes that rewrite one file at once each publish a whole file, the
// last close winning, never a mix of both. Other writable handles join the
// node's shared draft, so writes through different descriptors of one file
// see each other, as in-place updates and appends need.
type handle struct {
	n      *node
	uid    uint32        // who opened it (FS.opens)
	reader *store.Reader // read-only handles
	// follow: a read-only handle opened while the file had writers; it
	// reads their draft while there is one, then live (n.liveDraft,
	// handle.refresh).
	follow atomic.Bool
	live   atomic.Pointer[store.Reader]
	// liveMu is held for reading while a read takes a hold on the reader
	// it reads (readerNow), or reads another node's bytes through it, and
	// for writing while refresh replaces live: the reader it replaces is
	// closed only once no read is taking it. Taken before n.mu.
	liveMu sync.RWMutex
	bound  *store.Draft // the shared draft it follows, once it read one (node.mu)
	// boundFrom is the bytes it read when it bound to bound, which the
	// draft continued at its move boundGen (Draft.Continues): its reads
	// of the draft ask for that move (Draft.ReadAtGen).
	boundFrom store.BytesID
	boundGen  uint64
	writable  bool
	priv      *store.Draft // O_TRUNC handles: their own new version
	append    bool         // O_APPEND: every write goes to the end
	// abandoned: the process writing priv was killed before it closed
	// it; release discards priv unless a later write took it up again.
	abandoned atomic.Bool
	// published: priv was published at least once (a shell's > publishes
	// the truncated file when the shell closes its descriptor, before
	// the program it runs writes): the old version is gone, so what a
	// killed writer wrote is published, not abandoned.
	published atomic.Bool
	obj       *store.Object // the object at open time
	metaGen   uint64        // O_TRUNC handles: n.metaGen at open
	regs      regTable      // buffers registered on this open file
	mu        sync.Mutex
	released  bool
}

func (h *handle) fuseFlags() uint32 {
	// Direct I/O: the store is already memory, so the page cache would
	// only hold a second copy; reads are served from segment memory and
	// mmap still works (DIRECT_IO_ALLOW_MMAP).
	return fuse.FOPEN_DIRECT_IO | fuse.FOPEN_PARALLEL_DIRECT_WRITES
}

// open makes a handle. o is the object when the caller just made it. The
// node must still be the file at key: a file that was removed, evicted or
// replaced since the kernel looked it up answers ErrStale, and the kernel
// looks the path up again (open, stat and the other path calls retry once
// on ESTALE), so an open either reaches a live file or fails. Never
// ENOENT: the kernel does not tell an OPEN that it has O_CREAT, and the
// walk again creates the file for one that has.
func (n *node) open(ctx context.Context, key string, o *store.Object, flags uint32) (*handle, error) {
	if n.IsDir() {
		return nil, store.ErrIsDir
	}
	uid, _ := caller(ctx)
	if err := n.fs.opens.take(uid); err != nil {
		return nil, err
	}
	return n.openCounted(ctx, uid, key, o, flags)
}

// openCounted is open for user uid, whose count (FS.opens) the caller
// took: given back if the open fails.
func (n *node) openCounted(ctx context.Context, uid uint32, key string, o *store.Object, flags uint32) (*handle, error) {
	h, err := n.openHandle(ctx, key, o, flags)
	if err != nil {
		n.fs.opens.put(uid)
		return nil, err
	}
	h.uid = uid
	return h, nil
}

func (n *node) openHandle(ctx context.Context, key string, o *store.Object, flags uint32) (*handle, error) {
	ino := n.StableAttr().Ino
	acc := flags & syscall.O_ACCMODE
	if acc == syscall.O_RDONLY {
		// Whether it follows writers that share the file is decided by
		// the bytes it opened (watchLocked), with no shared draft being
		// opened or closed meanwhile (lockSettled): a draft that began,
		// ended or moved while the version was looked up (changes) has it
		// look again.
		for tries := 0; ; tries++ {
			n.lockSettled()
			changes := n.mu.changes
			n.mu.Unlock()
			r, err := n.fs.st.OpenReader(ctx, key)
			if errors.Is(err, store.ErrNotFound) {
				err = store.ErrStale
			}
			if err == nil && r.Object().Ino != ino {
				r.Close()
				err = store.ErrStale
			}
			if err != nil {
				return nil, err
			}
			n.lockSettled()
			if n.mu.changes != changes && tries < 3 {
				n.mu.Unlock()
				r.Close()
				continue
			}
			h := &handle{n: n, reader: r, obj: r.Object()}
			h.regs.fs = n.fs
			n.mu.opened = h.obj
			n.watchLocked(h, r.BytesID())
			n.mu.Unlock()
			return h, nil
		}
	}
	h := &handle{n: n, writable: true, append: flags&syscall.O_APPEND != 0}
	h.regs.fs = n.fs
	if flags&syscall.O_TRUNC != 0 {
		n.killSUID(ctx) // the kernel leaves an atomic O_TRUNC to us
		d, err := n.fs.st.OpenDraft(ctx, key, ino, true)
		if err != nil {
			return nil, err
		}
		d.Place(n.fs.st.PlacementFor(ctx, key))
		h.priv = d
		h.metaGen = n.metaGen.Load()
		n.mu.Lock()
		n.mu.private[h] = struct{}{}
		n.mu.Unlock()
	} else if err := n.joinShared(ctx, key); err != nil {
		return nil, err
	}
	made := o != nil // by the caller, just now: its time is the open's
	if o == nil {
		o, _ = n.fs.st.Stat(ctx, key)
	}
	if h.priv != nil && !made && o != nil && o.Ino == ino && o.Size == 0 && n.sizeOf(o) == 0 {
		// An O_TRUNC open of an empty file changes no bytes, and its
		// close publishes nothing: marked modified now, as on tmpfs.
		now := time.Now().UnixNano()
		if t, err := n.fs.st.Update(ctx, key, ino, func(o *store.Object) error {
			o.Mtime = now
			return nil
		}); err == nil {
			o = t
		}
	}
	h.obj = o
	if o != nil {
		n.mu.Lock()
		n.mu.opened = o
		n.mu.Unlock()
	}
	return h, nil
}

// openGhost opens the version a rename replaced (see node.mu.ghost), nil
// without one. Writes through it go where writes to a replaced file go on
// any POSIX file system: nowhere, once the last descriptor closes.
func (n *node) openGhost(uid uint32, flags uint32) *handle {
	g := n.ghostReader()
	if g == nil {
		return nil
	}
	if n.fs.opens.take(uid) != nil {
		g.Close()
		return nil
	}
	h := &handle{n: n, obj: g.Object(), uid: uid}
	h.regs.fs = n.fs
	if flags&syscall.O_ACCMODE == syscall.O_RDONLY {
		h.reader = g
		return h
	}
	h.writable = true
	h.append = flags&syscall.O_APPEND != 0
	h.priv = n.fs.st.NewDraft(g.Object().Ino, g, flags&syscall.O_TRUNC != 0)
	n.mu.Lock()
	n.mu.private[h] = struct{}{}
	n.mu.Unlock()
	return h
}

// joinShared adds a writer to the node's shared draft, starting it from
// the current version if there is none. A last writer's release that is
// still publishing is waited for: its commit comes before this draft's
// base. The draft is opened without n.mu (its lookup may wait for the
// index); writers that come meanwhile wait for it (opening) and join it.
func (n *node) joinShared(ctx context.Context, key string) error {
	n.lockSettled()
	if n.mu.draft != nil {
		n.mu.writers++
		n.mu.Unlock()
		return nil
	}
	opening := make(chan struct{})
	n.mu.opening = opening
	n.mu.Unlock()
	d, err := n.fs.st.OpenDraft(ctx, key, n.StableAttr().Ino, false)
	if err == nil {
		d.Place(n.fs.st.PlacementFor(ctx, key))
	}
	n.mu.Lock()
	n.mu.opening = nil
	if err == nil {
		n.mu.draft = d
		n.mu.writers++
		n.mu.changes++
		n.followReadersLocked(d)
	}
	n.mu.Unlock()
	close(opening)
	return err
}

// watchLocked registers h, a read-only handle that follows no draft and
// reads the bytes id, among the readers that follow the shared draft once
// one starts from them; if the one open continues them already (began
// from them, or published them), h follows it now. The caller holds n.mu.
func (n *node) watchLocked(h *handle, id store.BytesID) {
	if d := n.mu.draft; d != nil && n.mu.closing == nil {
		if gen, ok := d.Continues(id); ok {
			n.followLocked(h, d, gen, id)
			return
		}
	}
	if n.mu.readers == nil {
		n.mu.readers = map[*handle]struct{}{}
	}
	n.mu.readers[h] = struct{}{}
}

// followReadersLocked makes the registered readers of the version d, a
// new shared draft, starts from follow it: they read the writers' bytes
// from now on, as readers opened while they write do. The caller holds
// n.mu.
func (n *node) followReadersLocked(d *store.Draft) {
	for h := range n.mu.readers {
		id := h.readerNow().BytesID()
		if gen, ok := d.Continues(id); ok {
			delete(n.mu.readers, h)
			n.followLocked(h, d, gen, id)
		}
	}
}

// followLocked makes h, a read-only handle that reads the bytes id d
// continues (at its move gen), a follower of d, bound to it: once d is
// gone it reads what d left, never a version that replaced the file
// meanwhile (an O_TRUNC writer's). The caller holds n.mu.
func (n *node) followLocked(h *handle, d *store.Draft, gen uint64, id store.BytesID) {
	n.bindLocked(h, d, gen, id)
	h.follow.Store(true)
	n.mu.followers++
}

// leaveShared drops a writer of the shared draft; the last one publishes
// it and closes it. Writers that join meanwhile wait (lockSettled), so
// their draft starts from what this one publishes.
func (n *node) leaveShared(ctx context.Context) error {
	n.mu.Lock()
	n.mu.writers--
	if n.mu.writers > 0 {
		n.mu.Unlock()
		return nil
	}
	d := n.mu.draft
	closing := make(chan struct{})
	n.mu.closing = closing
	n.mu.Unlock()
	err := n.publish(ctx, d, nil)
	if !n.retire(ctx, d) {
		n.refreshBound(d)
	}
	n.mu.Lock()
	n.mu.draft, n.mu.closing = nil, nil
	n.mu.changes++
	n.mu.Unlock()
	close(closing)
	return err
}

// refreshBound moves the handles that read d, a shared draft just
// settled, on to what it left (handle.refresh) before other writers can
// share the file again: a draft that then starts from that version is
// theirs to follow (watchLocked), where a handle left to refresh at its
// next read would have stayed on it and missed the later writers' bytes
// (tail -f of a log that >> appends to).
func (n *node) refreshBound(d *store.Draft) {
	n.mu.Lock()
	var hs []*handle
	for k, b := range n.mu.bound {
		if k.d == d {
			for h := range b.handles {
				hs = append(hs, h)
			}
		}
	}
	n.mu.Unlock()
	for _, h := range hs {
		h.refresh(d)
	}
}

// retire closes the shared draft once its last writer is done with it,
// published or not; one whose file went (unlinked, replaced) while
// readers follow it is kept for them instead (node.mu.orphan), as an
// unlinked file's bytes stay for whoever has it open. It says whether it
// kept d.
func (n *node) retire(ctx context.Context, d *store.Draft) bool {
	n.mu.Lock()
	followed, orphaned := n.mu.followers > 0, n.mu.orphan != nil
	n.mu.Unlock()
	// Only a followed draft costs a look at the index. A follower that
	// comes after this look reads the draft until it is closed, then
	// what was published (readLive).
	if followed {
		// One draft is kept whole at a time (orphan); any other that
		// followers read leaves them what it settled on.
		if !orphaned {
			if !n.stillThere(ctx) {
				n.mu.Lock()
				kept := n.mu.followers > 0 && n.mu.orphan == nil
				if kept {
					n.mu.orphan = d
				}
				n.mu.Unlock()
				if kept {
					return true
				}
			}
		}
		n.settle(d)
	}
	d.Close()
	return false
}

// stillThere says whether the node's file still has a name: its version
// now (versionNow) or, in a cluster, where another node's rename moves
// nothing in this tree, any name the index has for the inode (keyOfIno).
func (n *node) stillThere(ctx context.Context) bool {
	if r := n.versionNow(ctx); r != nil {
		r.Close()
		return true
	}
	if n.fs.opts.Cluster {
		_, found := n.fs.keyOfIno(ctx, n.StableAttr().Ino)
		return found
	}
	return false
}

// versionNow opens the node's file as it is now: at the name the tree
// gives it, or, when that finds another file or none, again with no
// rename in flight (namesSettled). Nil when the file has no name (or, in
// a cluster, another node moved it).
func (n *node) versionNow(ctx context.Context) *store.Reader {
	open := func() *store.Reader {
		key, ok := n.key()
		if !ok {
			return nil
		}
		r, err := n.fs.st.OpenReader(ctx, key)
		if err != nil {
			return nil
		}
		if r.Object().Ino != n.StableAttr().Ino {
			r.Close()
			return nil
		}
		return r
	}
	if r := open(); r != nil {
		return r
	}
	var r *store.Reader
	n.fs.namesSettled(func() { r = open() })
	return r
}

// boundKey is a shared draft and its move (Draft.Gen) when the followers
// of one boundDraft bound to it: a draft that RebaseOnto moved onto other
// bytes has followers of each.
type boundKey struct {
	d   *store.Draft
	gen uint64
}

// boundDraft is a shared draft's followers (node.mu.bound): how many, and
// what it left them once closed (nil while open, or when it left none).
type boundDraft struct {
	followers int
	left      *store.Reader
	handles   map[*handle]struct{} // the followers (refreshBound)
}

// settle keeps what d, a shared draft about to close, leaves for the
// followers that read it; none when it has changes of its own (a publish
// failed) or is empty.
func (n *node) settle(d *store.Draft) {
	n.leave(d, d.Gen(), d.BaseReader())
}

// leave keeps r for the followers of d that bound to it at its move gen,
// to read once they leave it (unbindLocked), in place of what it kept for
// them before, if anything (a nil r keeps that); r is closed if none did.
func (n *node) leave(d *store.Draft, gen uint64, r *store.Reader) {
	n.mu.Lock()
	if b := n.mu.bound[boundKey{d, gen}]; b != nil && r != nil {
		b.left, r = r, b.left
	}
	n.mu.Unlock()
	if r != nil {
		r.Close()
	}
}

// unbindLocked ends h's following of the draft it read (refresh,
// release): with take, it returns a lease of its own on what that draft
// left, if kept. The last of the draft's followers lets that go: done,
// for the caller to close once it lets go of n.mu, which it holds.
func (n *node) unbindLocked(h *handle, take bool) (r, done *store.Reader) {
	k := boundKey{h.bound, h.boundGen}
	if b := n.mu.bound[k]; b != nil {
		if take && b.left != nil {
			r = b.left.Dup()
		}
		delete(b.handles, h)
		if b.followers--; b.followers == 0 {
			delete(n.mu.bound, k)
			done = b.left
		}
	}
	h.bound, h.boundFrom, h.boundGen = nil, store.BytesID{}, 0
	return r, done
}

// lockSettled locks n.mu once no last writer's release is publishing the
// shared draft: what the caller does to it then comes before that publish
// or after it, never between the publish and the draft's close. A first
// writer still opening the shared draft is waited for too.
func (n *node) lockSettled() {
	for {
		n.mu.Lock()
		ch := n.mu.closing
		if ch == nil {
			ch = n.mu.opening
		}
		if ch == nil {
			return
		}
		n.mu.Unlock()
		<-ch
	}
}

// dropFollowerLocked uncounts a follower that stopped following
// (refresh) or closed; the last one takes an orphaned draft, returned for
// the caller to close once it lets go of n.mu, which it holds.
func (n *node) dropFollowerLocked() *store.Draft {
	n.mu.followers--
	var d *store.Draft
	if n.mu.followers == 0 {
		d, n.mu.orphan = n.mu.orphan, nil
	}
	return d
}

// liveDraft returns the draft follower h reads: the shared one, or the
// one its file left behind (orphan), the first it reads binding it
// (h.bound); nil once that one is gone (a later one is not its to read),
// or once h no longer follows (a refresh of another read's came first:
// follow changes under n.mu). It also returns the draft h is bound to,
// nil for none, for refresh to check that nothing changed since.
func (n *node) liveDraft(h *handle) (d *store.Draft, gen uint64, from store.BytesID, bound *store.Draft) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !h.follow.Load() {
		return nil, 0, store.BytesID{}, h.bound
	}
	d = n.mu.draft
	if d == nil || d.Err() != nil {
		d = n.mu.orphan
	}
	if d == nil || d != h.bound {
		return nil, 0, store.BytesID{}, h.bound
	}
	return d, h.boundGen, h.boundFrom, d
}

// bindLocked makes h a follower of d's (h.bound), bound at the bytes id
// it read, which d continued at its move gen. The caller holds n.mu.
func (n *node) bindLocked(h *handle, d *store.Draft, gen uint64, id store.BytesID) {
	h.bound, h.boundFrom, h.boundGen = d, id, gen
	k := boundKey{d, gen}
	b := n.mu.bound[k]
	if b == nil {
		b = n.newBoundLocked(k)
	}
	b.followers++
	b.handles[h] = struct{}{}
}

// newBoundLocked adds k's followers, none yet. The caller holds n.mu.
func (n *node) newBoundLocked(k boundKey) *boundDraft {
	if n.mu.bound == nil {
		n.mu.bound = map[boundKey]*boundDraft{}
	}
	b := &boundDraft{handles: map[*handle]struct{}{}}
	n.mu.bound[k] = b
	return b
}

// readLive reads for a following handle: from the writers' draft while
// there is one and it changed the handle's bytes (ok), else, once, it
// opens the version they published (refresh) and says to read that
// (!ok); while the draft still holds the handle's bytes, it says to read
// those (!ok, no refresh).
func (h *handle) readLive(ctx context.Context, dest []byte, off uint64) (int, bool, error) {
	d, gen, from, bound := h.n.liveDraft(h)
	if d != nil {
		if d.Holds(from) {
			// Its writers changed nothing yet: the handle's own reader
			// holds the same bytes, read without a copy.
			return 0, false, nil
		}
		got, err := d.ReadAtGen(ctx, dest, off, gen)
		if !errors.Is(err, store.ErrClosed) && !errors.Is(err, store.ErrMoved) {
			return got, true, err
		}
		// Published and closed since it was picked, or moved onto a
		// rewrite: read what it left.
	}
	h.refresh(bound)
	return 0, false, nil
}

// refresh ends following: the handle reads what the draft it followed
// left (node.mu.bound) from now on (kept in live; the version at open
// stays held for the ioctls, which read versions), else its own bytes,
// and follows the next draft that starts from them (watchLocked). It does
// nothing unless h still follows, bound to bound, as its caller found it:
// a draft it was made to follow since is not one it is done with.
func (h *handle) refresh(bound *store.Draft) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := h.n
	// The file's version now, for when the draft left nothing kept but
	// its last commit is that version: looked up first (n.mu is never
	// held across a lookup), and only then (a draft's kept bytes stay
	// while a follower is bound to it).
	n.mu.Lock()
	b := n.mu.bound[boundKey{h.bound, h.boundGen}]
	kept := b != nil && b.left != nil
	n.mu.Unlock()
	var cur *store.Reader
	if bound != nil && !kept {
		cur = n.versionNow(context.Background())
	}
	// One step under n.mu, where follow changes: no read binds h to a
	// draft between its unbinding and the end of its following
	// (liveDraft). live is set before follow is cleared: a read that
	// finds follow false reads live. (liveMu first: a read of another
	// node's bytes holds it, never n.mu, across the network.)
	h.liveMu.Lock()
	n.mu.Lock()
	if !h.follow.Load() || h.released || h.bound != bound {
		n.mu.Unlock()
		h.liveMu.Unlock()
		if cur != nil {
			cur.Close()
		}
		return
	}
	// What the draft left, else the version now if the draft published
	// it and never moved since h bound to it, else (its changes were
	// lost, or its bytes were the empty file's) the handle's own bytes:
	// never a version a rewrite made.
	if cur != nil {
		if last, gen := bound.Last(); last != cur.BytesID() || gen != h.boundGen {
			cur.Close()
			cur = nil
		}
	}
	r, done := n.unbindLocked(h, true)
	if r == nil {
		r, cur = cur, nil
	}
	var old *store.Reader
	if r != nil {
		old = h.live.Swap(r) // a handle that followed writers before
	}
	h.follow.Store(false)
	orphan := n.dropFollowerLocked()
	n.watchLocked(h, h.readerNow().BytesID()) // the next writers'
	n.mu.Unlock()
	h.liveMu.Unlock()
	for _, r := range []*store.Reader{cur, done, old} {
		if r != nil {
			r.Close()
		}
	}
	if orphan != nil {
		orphan.Close()
	}
}

// holdReader returns the reader POSIX reads through h use and a hold on
// its bytes (store.Reader.Hold), taken so that refresh cannot close it
// first.
func (h *handle) holdReader() (*store.Reader, func()) {
	h.liveMu.RLock()
	defer h.liveMu.RUnlock()
	r := h.readerNow()
	if r == nil {
		return nil, nil
	}
	return r, r.Hold()
}

// readerNow is the reader POSIX reads through h use.
func (h *handle) readerNow() *store.Reader {
	if r := h.live.Load(); r != nil {
		return r
	}
	return h.reader
}

// draft returns the draft writes through h go to.
func (h *handle) draft() *store.Draft {
	if h.priv != nil {
		return h.priv
	}
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
	if h.reader != nil && h.follow.Load() {
		var live bool
		if got, live, err = h.readLive(ctx, dest, uint64(off)); live {
			if err != nil {
				return nil, toErrno(err)
			}
			return fuse.ReadResultData(dest[:got]), 0
		}
	}
	if r, release := h.holdReader(); r != nil {
		var slices [][]byte
		slices, err = r.Slices(uint64(off), uint64(len(dest)))
		if errors.Is(err, store.ErrRemote) {
			// The bytes live on another node: fetch them into dest,
			// with r kept open.
			h.liveMu.RLock()
			got, err = h.readerNow().ReadAt(ctx, dest, uint64(off))
			h.liveMu.RUnlock()
			release()
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
	h.abandoned.Store(false)
	n.killSUID(ctx)
	if h.append {
		// The kernel picks an append's offset from its own idea of the
		// size; the draft's end is the one that counts.
		var n64 uint64
		_, n64, err = d.AppendFrom(ctx, transfer.HostBuffer(data))
		got = int(n64)
	} else {
		got, err = d.WriteAt(ctx, data, uint64(off))
	}
	if err != nil {
		return 0, toErrno(err)
	}
	return uint32(got), 0
}

// killSUID clears the file's set-user-ID bit, and its set-group-ID bit
// where the group may execute, when the caller is not root: as the kernel
// does at a write or truncation without CAP_FSETID, which it leaves to
// the daemon for the mount's direct writes and atomic O_TRUNC opens. At
// once, on the published version, as a chmod: a chmod between the write
// and the close keeps what it sets.
func (n *node) killSUID(ctx context.Context) {
	if uid, _ := caller(ctx); uid == 0 {
		return
	}
	key, ok := n.key()
	if !ok {
		return
	}
	ino := n.StableAttr().Ino
	if o, err := n.fs.st.Stat(ctx, key); err != nil || o.Ino != ino || store.KillSUID(o.Mode) == o.Mode {
		return
	}
	_, err := n.fs.st.Update(ctx, key, ino, func(o *store.Object) error {
		o.Mode = store.KillSUID(o.Mode)
		return nil
	})
	if err == nil {
		n.NotifyContent(-1, 0) // attributes only: no lock of the inode
	}
}

// publish commits d as the node's new version if it changed. A draft with
// a failed write or truncation fails instead, and the previous version
// stays. A file that was unlinked or replaced while open loses its writes,
// as on any POSIX file system.
//
// A rewrite (d is an O_TRUNC handle h's own draft, or the shared draft
// after a truncation) drops user.mooncake.meta, which described the old
// bytes, unless a new one was set through the file since it began.
func (n *node) publish(ctx context.Context, d *store.Draft, h *handle) error {
	if err := d.Err(); err != nil {
		return err
	}
	if !d.Dirty() {
		return nil
	}
	key, ok := n.key()
	if !ok {
		return nil
	}
	opts := store.CommitOptions{Key: key, IfIno: n.StableAttr().Ino}
	gen := n.metaGen.Load()
	var shared uint64
	switch {
	case h != nil && h.priv == d:
		if h.metaGen == gen {
			opts.SetXattrs = dropMeta
		}
	default:
		if shared = n.sharedRewrite.Load(); shared == gen+1 {
			opts.SetXattrs = dropMeta
		}
	}
	_, err := n.commitFollowing(ctx, &opts, func() (*store.Object, error) { return d.Commit(ctx, opts) })
	if err == nil && shared != 0 {
		n.sharedRewrite.CompareAndSwap(shared, 0)
	}
	if err == nil && h != nil && h.priv == d {
		if hook := n.fs.hooks.rewritten; hook != nil {
			hook()
		}
		n.rebaseShared(ctx)
	}
	if errors.Is(err, store.ErrStale) {
		return nil
	}
	return err
}

// rebaseShared moves the shared draft, while it has no changes of its
// own, onto the file's version now (Draft.RebaseOnto), after a writer with a
// draft of its own published or a put by name replaced the file: an
// O_RDWR descriptor kept open without writing (a lock file, a process
// that may write later) would otherwise keep the draft on the version
// before, its readers would see that, and the next writer to join it, or
// an append through it, would publish that older content over the new.
func (n *node) rebaseShared(ctx context.Context) {
	n.lockSettled()
	d := n.mu.draft
	n.mu.Unlock()
	if d == nil || d.Dirty() {
		return
	}
	n.rebaseMu.Lock() // From and BaseReader stay as read until RebaseOnto
	defer n.rebaseMu.Unlock()
	// (The version looked up while held: of two rebases, the later one
	// moves the draft onto the later version.)
	r := n.versionNow(ctx)
	if r == nil {
		return
	}
	// Its followers keep the bytes it began from: the rewrite is another
	// version, not a change of what they read. What it holds now is left
	// for them before it moves (their reads of it fail from then on:
	// Draft.ReadAtFrom), as a closing draft leaves what it published;
	// kept for those that bind to it until it moved too.
	// (Counted among them meanwhile, so that it stays for one that binds
	// now, when the last before it leaves.)
	k := boundKey{d, d.Gen()}
	n.mu.Lock()
	b := n.mu.bound[k]
	if b == nil {
		b = n.newBoundLocked(k)
	}
	b.followers++
	n.mu.Unlock()
	n.leave(d, k.gen, d.BaseReader())
	d.RebaseOnto(r)
	var left *store.Reader
	n.mu.Lock()
	if b.followers--; b.followers == 0 {
		delete(n.mu.bound, k)
		left = b.left
	}
	n.mu.changes++
	n.mu.Unlock()
	if left != nil {
		left.Close()
	}
}

// Flush implements gofs.NodeFlusher: close(2) of a writable descriptor
// publishes, so the content is visible when close returns; closers.go
// says which closes reach here.
func (n *node) Flush(ctx context.Context, fh gofs.FileHandle) (errno syscall.Errno) {
	return n.flush(ctx, fh, "flush")
}

// Fsync implements gofs.NodeFsyncer: commit now.
func (n *node) Fsync(ctx context.Context, fh gofs.FileHandle, flags uint32) (errno syscall.Errno) {
	return n.flush(ctx, fh, "fsync")
}

func (n *node) flush(ctx context.Context, fh gofs.FileHandle, op string) (errno syscall.Errno) {
	ctx = detached(ctx)
	h, ok := fh.(*handle)
	if !ok || !h.writable {
		return 0
	}
	start := time.Now()
	var err error
	defer func() { n.fs.opDone(ctx, op, "", 0, start, errno, err) }()
	d := h.draft()
	if d == nil {
		return 0
	}
	if op == "flush" && h.priv != nil && d.Dirty() && !h.published.Load() && killedCaller(ctx) {
		// The writer of this new version was killed before it closed
		// it: the kernel is closing its files. What it wrote is not a
		// version anybody finished; the old one stays.
		h.abandoned.Store(true)
		return 0
	}
	err = n.publish(ctx, d, h)
	if err == nil && h.priv != nil {
		h.published.Store(true)
	}
	return toErrno(err)
}

// killedCaller reports whether the process behind ctx is exiting on a
// signal (kill -9, an unhandled SIGTERM or SIGINT), so that its FLUSH is
// the kernel closing its files, not a close(2). /proc/TID/stat says so:
// PF_EXITING in its flags and a signal in its exit code, both set before
// the kernel closes the files of a dying task.
func killedCaller(ctx context.Context) bool {
	c, ok := fuse.FromContext(ctx)
	if !ok || c.Pid == 0 {
		return false
	}
	// Flags is field 9, exit_code field 52.
	f := statFields(c.Pid)
	if len(f) < 50 {
		return false
	}
	const pfExiting = 0x4
	flags, err1 := strconv.ParseUint(f[6], 10, 64)
	code, err2 := strconv.ParseInt(f[49], 10, 64)
	return err1 == nil && err2 == nil && flags&pfExiting != 0 && code&0x7f != 0
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
	defer n.fs.opens.put(h.uid)
	h.regs.closeAll()
	if h.reader != nil {
		// Out of the readers and its following in one step under n.mu,
		// where follow changes (refresh no longer does: released).
		var done *store.Reader
		var orphan *store.Draft
		n.mu.Lock()
		delete(n.mu.readers, h)
		if h.follow.Load() {
			_, done = n.unbindLocked(h, false)
			orphan = n.dropFollowerLocked()
			h.follow.Store(false)
		}
		n.mu.Unlock()
		h.reader.Close()
		h.mu.Lock() // a refresh that began before swapped live under it
		if r := h.live.Load(); r != nil {
			r.Close()
		}
		h.mu.Unlock()
		if done != nil {
			done.Close()
		}
		if orphan != nil {
			orphan.Close()
		}
		return 0
	}
	start := time.Now()
	var err error
	defer func() { n.fs.opDone(ctx, "release", "", 0, start, errno, err) }()
	// Release is asynchronous to close(2): a close already published what
	// it could; this publishes what came after (mmap write-back) or what
	// no publishing close saw (the last descriptor was an inherited one).
	if d := h.priv; d != nil {
		if !h.abandoned.Load() {
			err = n.publish(context.Background(), d, h)
		}
		d.Close()
		n.mu.Lock()
		delete(n.mu.private, h)
		n.mu.Unlock()
		return toErrno(err)
	}
	err = n.leaveShared(context.Background())
	return toErrno(err)
}
