package store

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Draft is a private, writable copy of an object: phase one (reserve) and
// two (transfer) of the write protocol. Nothing in it is visible to others
// until Commit swaps it into the index.
//
// A draft starts from a base version without copying it; the first change
// copies the base into fresh extents (copy on write), except a truncation
// to zero, which copies nothing. Several goroutines may write disjoint
// ranges at once: the copy itself runs without the draft's mutex.
//
// Lock order: appendMu, rw, mu, meta, then Store.mu. mu is held across
// the draft's own reservations, zero-fill and copies (spill, copy on
// write, commit); only the draft's writers wait for it, and they hold rw,
// which those steps hold exclusively anyway. Size, Dirty, Err, SetMtime
// and Place never wait for mu.
type Draft struct {
	s   *Store
	ino uint64
	// rw is held shared by writers while they copy, and exclusively by
	// truncation, copy-on-write, commit and close.
	rw sync.RWMutex
	// appendMu orders appends: each one reads the size the last left.
	appendMu sync.Mutex
	// size and dirty are changed under mu but read without it by Size
	// and Dirty, which must not wait for a commit's network calls: a stat
	// of a file being committed answers at once.
	size  atomic.Uint64
	dirty atomic.Bool // differs from the version it started from
	mu    struct {
		sync.Mutex
		from     BytesID // the bytes it started from, or RebaseOnto moved it onto
		last     BytesID // the bytes it committed last, else from (Continues)
		gen      uint64  // RebaseOnto moves made (Continues)
		base     *Reader // unmodified base version, nil once copied
		own      bool    // the draft has its own extents
		ext      []segment.Extent
		starts   []uint64
		capacity uint64
		zeroed   uint64 // bytes [0,zeroed) are defined: written or zero-filled
		expect   uint64 // the size the writer announced (Expect); 0: unknown
		noEvict  bool   // reserve without evicting (NoEvict)
		closed   bool
		// Placement (placement.go): where ext lives. node is "" until the
		// first reservation decides it; extResv[i] is the reservation id
		// of ext[i] on a remote node (0 for local extents); resv holds
		// the ids of the remote reservations the draft still owns (leased:
		// renewed while the draft is open, lease.go).
		node    string
		epoch   uint64 // of node's daemon, from its reservations
		extResv []uint64
		resv    map[uint64]bool
	}
	// meta is a leaf lock, never held across anything: what callers
	// outside the draft's writers set or ask (a stat, a futimens, a
	// setxattr) never waits for the draft's copies and control calls,
	// which run under mu.
	meta struct {
		sync.Mutex
		// failed is the first error of a write or truncation that did
		// not happen (no space, a failed copy, its node died): the draft
		// can no longer commit.
		failed error
		mtime  int64 // explicit modification time (SetMtime) since the last change; 0: now
		place  Placement
	}
}

// Growth bounds of a draft's reservation; the tail is trimmed at commit.
const (
	minGrow = 256 << 10
	maxGrow = 64 << 20
)

// NewDraft starts a draft of the object with inode ino. base, when not
// nil, is the version the draft starts from; the draft takes ownership of
// it. With trunc the draft starts empty.
func (s *Store) NewDraft(ino uint64, base *Reader, trunc bool) *Draft {
	d := &Draft{s: s, ino: ino}
	d.meta.place = DefaultPlacement()
	s.openIno(ino)
	if base != nil {
		d.mu.from = base.BytesID()
	}
	d.mu.last = d.mu.from
	if base != nil && !trunc && base.Size() > 0 {
		d.mu.base = base
		d.size.Store(base.Size())
	} else {
		if base != nil {
			base.Close()
		}
		d.mu.own = true
		d.dirty.Store(trunc && base != nil && base.Size() > 0)
	}
	return d
}

// OpenDraft starts a draft of the file at key that must still be the
// object with inode ino: a key that is gone or holds another object fails
// with ErrStale, so a writer never starts a draft that could only commit
// into nowhere. Without trunc the draft starts from the current version.
// The file counts as open (never evicted) from the check on.
func (s *Store) OpenDraft(ctx context.Context, key string, ino uint64, trunc bool) (*Draft, error) {
	r, err := s.OpenReader(ctx, key)
	if errors.Is(err, ErrNotFound) {
		return nil, fmt.Errorf("open %q (inode %d) for writing: gone: %w", key, ino, ErrStale)
	}
	if err != nil {
		return nil, err
	}
	if r.Object().Ino != ino {
		r.Close()
		return nil, fmt.Errorf("open %q (inode %d) for writing: replaced: %w", key, ino, ErrStale)
	}
	return s.NewDraft(ino, r, trunc), nil
}

// Expect announces the size the draft's writes will reach: its next
// reservation takes that much, instead of growing speculatively.
func (d *Draft) Expect(size uint64) {
	d.mu.Lock()
	d.mu.expect = size
	d.mu.Unlock()
}

// NoEvict makes the draft's reservations fail with ErrNoSpace rather than
// evict other files (for a batch that reserves many drafts before any
// frees the versions they replace; it retries those that fail).
func (d *Draft) NoEvict() {
	d.mu.Lock()
	d.mu.noEvict = true
	d.mu.Unlock()
}

// BaseReader returns a lease of its own on the version the draft
// continues from while it has no changes of its own: after a commit, the
// committed version; before its first write, the one it was opened on.
// Nil when it has changes, is empty, is closed, or its base is on
// another node.
func (d *Draft) BaseReader() *Reader {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mu.closed || d.mu.own || d.mu.base == nil {
		return nil
	}
	return d.mu.base.Dup()
}

// RebaseOnto starts a draft that has no changes of its own anew from r,
// the current version of its file as the caller found it (wherever
// renames took it), when that is a later version of the same file (a
// writer of its own published one since the draft began): the draft's
// writers then go on from what they would find in the file they share
// on tmpfs, and its readers read that. It reports whether it did. A draft
// with changes of its own keeps them (its commit replaces the version:
// the last close wins), and so does a closed or failed draft, or one
// that r is another file's version of. It takes r over, and closes it
// unless the draft keeps it.
func (d *Draft) RebaseOnto(r *Reader) bool {
	if r.Object().Ino != d.ino {
		r.Close()
		return false
	}
	// No append is between its look at the size and its write (it
	// would land at the old version's end), and no write is copying.
	d.appendMu.Lock()
	defer d.appendMu.Unlock()
	d.rw.Lock()
	d.mu.Lock()
	keep := d.mu.closed || d.dirty.Load() || d.Err() != nil || len(d.mu.ext) > 0 ||
		d.mu.base != nil && d.mu.base.Object().Version == r.Object().Version
	var old *Reader
	if !keep {
		old = d.mu.base
		d.mu.from = r.BytesID()
		d.mu.last = d.mu.from
		d.mu.gen++
		if r.Size() > 0 {
			d.mu.base, d.mu.own = r, false
			d.size.Store(r.Size())
			r = nil
		} else {
			d.mu.base, d.mu.own = nil, true
			d.size.Store(0)
		}
	}
	d.mu.Unlock()
	d.rw.Unlock()
	if old != nil {
		old.Close()
	}
	if r != nil {
		r.Close()
	}
	return !keep
}

// Size returns the draft's current size.
func (d *Draft) Size() uint64 {
	return d.size.Load()
}

// Place sets where the draft's next reservation goes and how many replicas
// its commits make (see placement.go). It takes effect from the next
// commit on; bytes already placed stay where they are.
func (d *Draft) Place(p Placement) {
	if p.Replicas < 1 {
		p.Replicas = 1
	}
	d.meta.Lock()
	d.meta.place = p
	d.meta.Unlock()
}

// Dirty reports whether the draft differs from the version it started from
// (or last committed).
func (d *Draft) Dirty() bool {
	return d.dirty.Load()
}

// errSpill asks the caller of reserveLocked to retry with the draft held
// exclusively: its bytes move to another node.
var errSpill = errors.New("store: draft must spill to another node")

// errWritePanicked fails a draft whose write panicked (go-fuse recovers
// a handler's panic): whether its copies ran is unknown, so its range
// holds undefined bytes and it must not commit.
var errWritePanicked = errors.New("store: a write panicked: its range is undefined")

// errNotOwn tells a writer that a commit made the draft's version the
// committed one again: it must take extents of its own first (ensureOwn).
var errNotOwn = errors.New("store: draft has no extents of its own")

// reserveLocked grows the draft to hold at least need bytes. With excl the
// caller holds d.rw exclusively, which moving the draft to another node
// (spilling) needs; without it a spill returns errSpill.
func (d *Draft) reserveLocked(ctx context.Context, need uint64, excl bool) error {
	if need <= d.mu.capacity {
		return nil
	}
	grow := need - d.mu.capacity
	want := max(grow, min(max(d.mu.capacity, minGrow), maxGrow))
	if d.mu.expect >= need {
		// The writer said how large it gets: reserve that, no more (a
		// small value would otherwise take minGrow and give it back).
		want = d.mu.expect - d.mu.capacity
	}
	if d.mu.capacity == 0 {
		node, err := d.s.primaryNode(d.placement(), need)
		if err != nil {
			return err
		}
		d.mu.node = node
	}
	if !d.s.isLocal(d.mu.node) {
		return d.reserveRemoteLocked(ctx, d.mu.node, want, grow)
	}
	// Speculative growth never evicts: only what is really needed may
	// push other objects out.
	ext, err := d.s.segs.Alloc(want)
	if err != nil {
		ext, err = d.s.segs.Alloc(grow)
	}
	if err != nil && d.placement().Policy == PolicyLocal {
		if node, ok := d.s.spillNode(need); ok {
			switch {
			case d.mu.capacity == 0:
				d.mu.node = node
				return d.reserveRemoteLocked(ctx, node, want, grow)
			case !excl:
				return errSpill
			}
			return d.spillLocked(ctx, node, need, need+want-grow)
		}
	}
	if err != nil && !d.mu.noEvict {
		ext, err = d.s.alloc(grow) // evicts; its error says so
	} else if errors.Is(err, segment.ErrNoSpace) {
		err = fmt.Errorf("store: reserve %d B without evicting: %w", grow, errors.Join(ErrNoSpace, err))
	}
	if err != nil {
		return err
	}
	d.addExtLocked(ext, 0)
	return nil
}

func (d *Draft) addExtLocked(ext []segment.Extent, resv uint64) {
	d.mu.ext = append(d.mu.ext, ext...)
	for range ext {
		d.mu.extResv = append(d.mu.extResv, resv)
	}
	d.mu.starts = extentStarts(d.mu.ext)
	d.mu.capacity = segment.TotalLen(d.mu.ext)
}

// reserveRemoteLocked reserves want (at least grow) bytes on node.
func (d *Draft) reserveRemoteLocked(ctx context.Context, node string, want, grow uint64) error {
	t := d.s.opts.Transport
	if t == nil {
		return fmt.Errorf("store: reserve on node %q: %w", node, errNoTransport)
	}
	r, err := d.s.reserveRemoteOrLess(ctx, node, want, grow)
	if err != nil {
		return fmt.Errorf("store: reserve %d B on node %q: %w", grow, node, err)
	}
	if len(d.mu.ext) > 0 && r.Epoch != d.mu.epoch {
		// The node restarted under the draft: what was written is gone.
		d.s.freeReservations(ctx, []transfer.Reservation{r})
		return fmt.Errorf("store: node %q restarted while a draft was written to it: %w", node, transfer.ErrStaleEpoch)
	}
	d.mu.epoch = r.Epoch
	d.ownResvLocked(r.ID)
	d.addExtLocked(r.Extents, r.ID)
	return nil
}

// placedLocked describes where the draft's extents are.
func (d *Draft) placedLocked() Replica {
	if d.s.isLocal(d.mu.node) {
		return Replica{Node: d.s.opts.Node, Epoch: d.s.opts.Epoch, Extents: d.mu.ext}
	}
	return Replica{Node: d.mu.node, Epoch: d.mu.epoch, Extents: d.mu.ext}
}

// spillLocked moves the draft from this node to node with room for total
// bytes (at least need): the defined bytes are copied over, the local
// extents freed. Caller holds d.rw exclusively and d.mu.
func (d *Draft) spillLocked(ctx context.Context, node string, need, total uint64) error {
	t := d.s.opts.Transport
	if t == nil {
		return fmt.Errorf("store: spill to node %q: %w", node, errNoTransport)
	}
	r, err := d.s.reserveRemoteOrLess(ctx, node, total, need)
	if err != nil {
		if !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrNoSpace) {
			err = errors.Join(ErrNoSpace, err) // this node is full either way
		}
		return fmt.Errorf("store: spill %d B to node %q: %w", total, node, err)
	}
	dst := Replica{Node: node, Epoch: r.Epoch, Extents: r.Extents}
	if err := d.s.copyExtents(ctx, d.placedLocked(), dst, sameResv(r), d.mu.zeroed, 0); err != nil {
		d.s.freeReservations(ctx, []transfer.Reservation{r})
		return fmt.Errorf("store: spill to node %q: %w", node, err)
	}
	_ = d.s.segs.Free(d.mu.ext)
	d.mu.ext, d.mu.extResv = nil, nil
	d.mu.node, d.mu.epoch = node, r.Epoch
	d.ownResvLocked(r.ID)
	d.addExtLocked(r.Extents, r.ID)
	return nil
}

// ownResvLocked notes remote reservation id as the draft's.
func (d *Draft) ownResvLocked(id uint64) {
	if d.mu.resv == nil {
		d.mu.resv = map[uint64]bool{}
	}
	d.mu.resv[id] = true
}

// zeroes is a source of zero bytes for remote zero-fill.
var zeroes = make([]byte, 1<<20)

// zeroLocked fills [from, to) of the draft with zeros.
func (d *Draft) zeroLocked(ctx context.Context, from, to uint64) error {
	if to <= from {
		return nil
	}
	if d.s.isLocal(d.mu.node) {
		span(d.mu.ext, d.mu.starts, from, to-from, func(e segment.Extent, _ uint64) bool {
			if m, err := d.s.segs.Bytes(e); err == nil {
				clear(m)
			}
			return true
		})
		return nil
	}
	var reqs []transfer.Request
	spanIdx(d.mu.ext, d.mu.starts, from, to-from, func(i int, e segment.Extent, _ uint64) bool {
		for off := uint64(0); off < e.Len; off += uint64(len(zeroes)) {
			n := min(uint64(len(zeroes)), e.Len-off)
			reqs = append(reqs, transfer.Request{Op: transfer.Write, Buf: transfer.HostBuffer(zeroes[:n]),
				Extent: segment.Extent{Segment: e.Segment, Off: e.Off + off, Len: n}, Node: d.mu.node, Epoch: d.mu.epoch,
				Resv: d.mu.extResv[i]})
		}
		return true
	})
	return d.s.eng.Submit(context.WithoutCancel(ctx), reqs)
}

// materialize copies up to keep bytes of the base into the draft's own
// extents. Caller holds d.rw exclusively.
func (d *Draft) materialize(ctx context.Context, keep uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mu.closed {
		return ErrClosed // closed since the caller looked (Close drops the base)
	}
	if d.mu.own {
		return nil
	}
	base := d.mu.base
	keep = min(keep, base.Size())
	if err := d.reserveLocked(ctx, keep, true); err != nil {
		return err
	}
	if keep > 0 {
		if err := d.s.copyExtents(ctx, base.replica(), d.placedLocked(), d.mu.extResv, keep, base.obj.Version); err != nil {
			return fmt.Errorf("store: copy on write of %d B: %w", keep, err)
		}
	}
	base.Close()
	d.mu.base = nil
	d.mu.own = true
	d.size.Store(keep)
	d.mu.zeroed = keep
	return nil
}

func (d *Draft) ensureOwn(ctx context.Context, keep uint64) error {
	d.mu.Lock()
	own, closed := d.mu.own, d.mu.closed
	d.mu.Unlock()
	if closed {
		return ErrClosed
	}
	if own {
		return nil
	}
	d.rw.Lock()
	defer d.rw.Unlock()
	return d.materialize(ctx, keep)
}

// WriteAt copies p into the draft at off, growing it as needed. Bytes
// between the old end and off read as zeros.
func (d *Draft) WriteAt(ctx context.Context, p []byte, off uint64) (int, error) {
	n, err := d.WriteFrom(ctx, transfer.HostBuffer(p), off)
	return int(n), err
}

// WriteFrom copies the whole of buf (host, registered or another process's
// memory) into the draft at off: one copy, by the transfer engine. On a
// failed copy the range reads as zeros, never as stale bytes.
//
// A write that fails (no space, a copy or a node that failed) fails the
// draft: it can no longer commit (Err says why), so a file whose write
// was refused never publishes what was written around it.
func (d *Draft) WriteFrom(ctx context.Context, buf transfer.Buffer, off uint64) (uint64, error) {
	if err := d.Err(); err != nil {
		// Failed already: no later write may look as if it landed.
		return 0, err
	}
	n, err := d.writeFrom(ctx, buf, off)
	if err != nil {
		d.fail(err)
	}
	return n, err
}

// stagePiece is the most of another process's memory WriteStaged holds
// in daemon memory at once.
const stagePiece = 4 << 20

// WriteStaged is WriteFrom for a draft that others read while it is
// written (an open file's): another process's memory is first copied
// into daemon memory, a piece at a time, with nothing of the draft held,
// and then written from there. Its pages may be a mapping of this very
// file, whose faults come back as READs of the draft; a copy holding the
// draft would wait on them behind any writer queued meanwhile (a commit,
// a truncate), and they on it. Other memory goes straight, as WriteFrom.
func (d *Draft) WriteStaged(ctx context.Context, buf transfer.Buffer, off uint64) (uint64, error) {
	if buf.Kind != transfer.ProcessVM || buf.Len == 0 {
		return d.WriteFrom(ctx, buf, off)
	}
	if err := d.Err(); err != nil {
		return 0, err
	}
	if off+buf.Len < off {
		return 0, fmt.Errorf("store: write %d B at %d: %w", buf.Len, off, ErrTooLarge)
	}
	stage := make([]byte, min(buf.Len, stagePiece))
	var done uint64
	for done < buf.Len {
		p := stage[:min(buf.Len-done, stagePiece)]
		if err := d.s.eng.Stage(buf, done, p); err != nil {
			d.fail(err)
			return done, err
		}
		n, err := d.WriteFrom(ctx, transfer.HostBuffer(p), off+done)
		done += n
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

// AppendFrom writes buf at the draft's end, as one write: appends through
// one draft never overlap, whatever size the caller believed the file had.
// It returns the offset written at.
func (d *Draft) AppendFrom(ctx context.Context, buf transfer.Buffer) (off, n uint64, err error) {
	d.appendMu.Lock()
	defer d.appendMu.Unlock()
	off = d.Size()
	n, err = d.WriteFrom(ctx, buf, off)
	return off, n, err
}

// fail records the first error that makes the draft unfit to commit.
func (d *Draft) fail(err error) {
	if errors.Is(err, ErrClosed) {
		return
	}
	d.meta.Lock()
	if d.meta.failed == nil {
		d.meta.failed = err
	}
	d.meta.Unlock()
}

// placement returns where the draft's next reservation goes.
func (d *Draft) placement() Placement {
	d.meta.Lock()
	defer d.meta.Unlock()
	return d.meta.place
}

// Err returns the error of the write or truncation that failed the draft,
// nil while it can commit.
func (d *Draft) Err() error {
	d.meta.Lock()
	defer d.meta.Unlock()
	return d.meta.failed
}

func (d *Draft) writeFrom(ctx context.Context, buf transfer.Buffer, off uint64) (uint64, error) {
	reqs, w, err := d.prepareWrite(ctx, []transfer.Buffer{buf}, off, nil)
	if err != nil || w.d == nil {
		return 0, err
	}
	// A panic in the engine keeps the draft held: copies it started may
	// still run into the draft's extents, which a close would free.
	return w.finish(ctx, d.s.eng.Submit(ctx, reqs))
}

// pendingWrite is a write between prepareWrite and its finish.
type pendingWrite struct {
	d           *Draft // nil: an empty write, nothing to finish
	off, end, n uint64
}

// prepareWrite reserves room for bufs, one after the other, at off and
// appends the requests that copy them to reqs; w.finish, called once with
// the outcome of those requests, records it (and, for a copy that failed,
// zeroes its range) and returns what the write returns. The draft is held
// shared from prepareWrite to finish. A w with no draft and a nil error is
// an empty write.
func (d *Draft) prepareWrite(ctx context.Context, bufs []transfer.Buffer, off uint64, reqs []transfer.Request) (_ []transfer.Request, w pendingWrite, _ error) {
	var n uint64
	for _, b := range bufs {
		if n+b.Size() < n {
			return reqs, w, fmt.Errorf("store: write of %d pieces at %d: %w", len(bufs), off, ErrTooLarge)
		}
		n += b.Size()
	}
	if n == 0 {
		return reqs, w, nil
	}
	end := off + n
	if end < off {
		return reqs, w, fmt.Errorf("store: write %d B at %d: %w", n, off, ErrTooLarge)
	}
	// The draft stays held shared past a successful return, for finish;
	// a panic on the way (go-fuse recovers a handler's) lets it go, or
	// the file's next close or commit would wait forever, and fails it.
	held := false
	defer func() {
		if held {
			d.fail(errWritePanicked)
			d.rw.RUnlock()
		}
	}()
	for {
		if err := d.ensureOwn(ctx, ^uint64(0)); err != nil {
			return reqs, w, err
		}
		d.rw.RLock()
		held = true
		v, err := d.reserveWrite(ctx, off, end)
		if err == nil {
			at := off
			for _, buf := range bufs {
				spanIdx(v.ext, v.starts, at, buf.Size(), func(i int, e segment.Extent, rel uint64) bool {
					reqs = append(reqs, transfer.Request{Op: transfer.Write, Buf: buf, BufOff: rel, Extent: e, Node: v.node, Epoch: v.epoch, Resv: v.resv[i]})
					return true
				})
				at += buf.Size()
			}
			held = false
			return reqs, pendingWrite{d: d, off: off, end: end, n: n}, nil
		}
		d.rw.RUnlock()
		held = false
		switch {
		case errors.Is(err, errNotOwn):
			// A commit between ensureOwn and the lock made the committed
			// version the base again; writing now would go to extents no
			// commit sees.
		case errors.Is(err, errSpill):
			if err := d.spill(ctx, end); err != nil {
				return reqs, w, err
			}
		default:
			return reqs, w, err
		}
	}
}

// writeView is what a write's requests are made of: the draft's extents
// and where they lie, read under d.mu by reserveWrite.
type writeView struct {
	ext    []segment.Extent
	starts []uint64
	node   string
	epoch  uint64
	resv   []uint64
}

// reserveWrite, with the draft held shared, reserves room up to end and
// zeroes any gap before off. errNotOwn: the draft's version is no longer
// its own (ensureOwn again); errSpill: the room is elsewhere, and moving
// there needs the draft exclusively (spill).
func (d *Draft) reserveWrite(ctx context.Context, off, end uint64) (writeView, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mu.closed {
		return writeView{}, ErrClosed
	}
	if !d.mu.own {
		return writeView{}, errNotOwn
	}
	err := d.reserveLocked(ctx, end, false)
	if err == nil && off > d.mu.zeroed {
		err = d.zeroLocked(ctx, d.mu.zeroed, off)
	}
	if err != nil {
		return writeView{}, err
	}
	d.mu.zeroed = max(d.mu.zeroed, end)
	return writeView{d.mu.ext, d.mu.starts, d.mu.node, d.mu.epoch, d.mu.extResv}, nil
}

// spill moves the draft where it has room up to end, holding it
// exclusively so that no writer copies into the extents being moved. A
// draft committed or closed meanwhile needs nothing: its writer starts
// over.
func (d *Draft) spill(ctx context.Context, end uint64) error {
	d.rw.Lock()
	defer d.rw.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.mu.own || d.mu.closed {
		return nil
	}
	return d.reserveLocked(ctx, end, true)
}

// finish records the outcome err of the write's requests and ends it.
func (w pendingWrite) finish(ctx context.Context, err error) (uint64, error) {
	d := w.d
	ended := false
	defer func() {
		if !ended { // clearing the range panicked: it is undefined
			d.fail(errWritePanicked)
		}
		d.rw.RUnlock()
	}()
	if err != nil {
		zerr := d.zeroRange(ctx, w.off, w.end)
		ended = true
		if zerr != nil {
			// Neither the bytes nor zeros reached the range: committing
			// would publish whatever the remote memory holds.
			d.fail(fmt.Errorf("store: write of %d B at %d failed and its range could not be cleared: %w", w.n, w.off, errors.Join(err, zerr)))
		}
		return 0, err
	}
	ended = true
	d.mu.Lock()
	d.size.Store(max(d.size.Load(), w.end))
	d.dirty.Store(true)
	d.mu.Unlock()
	d.setMtime(0)
	return w.n, nil
}

// zeroRange is zeroLocked under d.mu, let go also if it panics.
func (d *Draft) zeroRange(ctx context.Context, from, to uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.zeroLocked(ctx, from, to)
}

// DraftWrite is one write of a WriteMany: Bufs, one after the other, into
// Draft at Off.
type DraftWrite struct {
	Draft *Draft
	Bufs  []transfer.Buffer
	Off   uint64
}

// WriteMany runs several writes, each into a draft of its own (a draft
// is held from its write's reservation to its end), as one transfer: one
// engine batch, so a process's memory is read with as few
// process_vm_readv calls as the kernel allows and GPU copies are
// synchronized once. It returns each write's error, nil for all when all
// succeeded; each write fails its own draft only, as WriteFrom would.
func (s *Store) WriteMany(ctx context.Context, ws []DraftWrite) []error {
	return s.StartWrites(ctx, ws).Wait()
}

// Writes is a WriteMany started by StartWrites.
type Writes struct {
	ctx    context.Context
	ws     []DraftWrite
	each   []writeState
	errs   []error // for Wait, when some write failed
	flight *transfer.Flight
	copyNs int64 // in the engine: starting the copies and waiting for them
	failed bool
	done   bool
}

// CopyNs returns the time spent in the engine so far: starting the
// copies and, once Wait returned, waiting for them (the rest of a
// StartWrites and Wait is the store's own work: reserving, finishing).
func (w *Writes) CopyNs() int64 { return w.copyNs }

// writeState is one write of Writes.
type writeState struct {
	err  error
	w    pendingWrite
	span [2]int // the write's requests in the flight
}

// StartWrites is WriteMany that returns once the copies are started: GPU
// copies may still run, so the caller can do other work (commit drafts of
// an earlier batch) meanwhile. Each draft stays busy until Wait, which
// the caller must call before it commits or closes them.
func (s *Store) StartWrites(ctx context.Context, ws []DraftWrite) *Writes {
	w := &Writes{ctx: ctx, ws: ws, each: make([]writeState, len(ws))}
	// A panic while the writes are prepared lets go of the drafts held so
	// far; one in the engine keeps them (see abandon).
	handed := false
	defer func() {
		if !handed {
			w.abandon(0)
		}
	}()
	all := make([]transfer.Request, 0, len(ws))
	for i, dw := range ws {
		st := &w.each[i]
		if err := dw.Draft.Err(); err != nil {
			st.err, w.failed = err, true
			continue
		}
		first := len(all)
		var err error
		all, st.w, err = dw.Draft.prepareWrite(ctx, dw.Bufs, dw.Off, all)
		if err != nil {
			dw.Draft.fail(err)
			st.err, w.failed = err, true
			continue
		}
		st.span = [2]int{first, len(all)}
	}
	handed = true
	t0 := time.Now()
	w.flight = s.eng.Start(ctx, all)
	w.copyNs = int64(time.Since(t0))
	return w
}

// abandon lets go of the drafts of writes from on that are still held
// (a panic on the way, go-fuse recovering it), failing each: whether its
// copies ran is unknown. Only where no copy of theirs can still run:
// before the engine has them, or after their flight ended (a close frees
// a draft's extents, which a running copy would write into).
func (w *Writes) abandon(from int) {
	for i := from; i < len(w.each); i++ {
		if d := w.each[i].w.d; d != nil {
			w.each[i].w.d = nil
			d.fail(errWritePanicked)
			d.rw.RUnlock()
		}
	}
}

// Wait waits for the copies and returns each write's error as WriteMany
// does.
func (w *Writes) Wait() []error {
	if !w.done {
		w.done = true
		next := -1 // once the flight ended: the writes from here on are not finished
		defer func() {
			if next >= 0 && next < len(w.each) { // a panic
				w.abandon(next)
			}
		}()
		t0 := time.Now()
		each := w.flight.Wait()
		w.copyNs += int64(time.Since(t0))
		next = 0
		for i := range w.each {
			next = i
			st := &w.each[i]
			pw := st.w
			if pw.d == nil {
				continue
			}
			st.w.d = nil // finish lets it go, also when it panics
			var err error
			if each != nil {
				err = errors.Join(each[st.span[0]:st.span[1]]...)
			}
			if _, err = pw.finish(w.ctx, err); err != nil {
				w.ws[i].Draft.fail(err)
				st.err, w.failed = err, true
			}
		}
		next = len(w.each)
	}
	if !w.failed {
		return nil
	}
	if w.errs == nil {
		w.errs = make([]error, len(w.each))
		for i := range w.each {
			w.errs[i] = w.each[i].err
		}
	}
	return w.errs
}

// Holds says whether the draft's bytes are now exactly the bytes id: it
// changed nothing since it started from them (or RebaseOnto moved it onto
// them), and committed nothing either. A reader of id then reads what
// the draft would give it.
func (d *Draft) Holds(id BytesID) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.mu.closed || d.dirty.Load():
		return false
	case d.mu.base != nil:
		return d.mu.base.BytesID() == id
	}
	return d.mu.own && len(d.mu.ext) == 0 && d.size.Load() == 0 && id == BytesID{}
}

// ReadAt copies draft bytes at off into p and returns the count, short at
// the draft's end.
func (d *Draft) ReadAt(ctx context.Context, p []byte, off uint64) (int, error) {
	return d.readAt(ctx, p, off, nil)
}

// Continues says whether the draft's bytes continue the bytes id (it
// started from them, RebaseOnto moved it onto them, or it committed them
// last), and since which of its moves (gen, for ReadAtGen).
func (d *Draft) Continues(id BytesID) (gen uint64, ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mu.gen, !d.mu.closed && (id == d.mu.from || id == d.mu.last)
}

// Last returns the bytes the draft committed last (else those it started
// from) and its RebaseOnto moves so far, closed or not.
func (d *Draft) Last() (BytesID, uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mu.last, d.mu.gen
}

// Gen is the count of the draft's RebaseOnto moves.
func (d *Draft) Gen() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mu.gen
}

// ReadAtGen is ReadAt for a reader of bytes the draft continued at its
// move gen (Continues): once RebaseOnto moved it again, onto other bytes, it
// reads nothing and fails with ErrMoved.
func (d *Draft) ReadAtGen(ctx context.Context, p []byte, off uint64, gen uint64) (int, error) {
	return d.readAt(ctx, p, off, &gen)
}

func (d *Draft) readAt(ctx context.Context, p []byte, off uint64, gen *uint64) (int, error) {
	d.rw.RLock() // RebaseOnto holds it alone
	defer d.rw.RUnlock()
	d.mu.Lock()
	if d.mu.closed {
		d.mu.Unlock()
		return 0, ErrClosed
	}
	if gen != nil && *gen != d.mu.gen {
		d.mu.Unlock()
		return 0, ErrMoved
	}
	if base := d.mu.base; base != nil {
		d.mu.Unlock()
		return base.ReadAt(ctx, p, off)
	}
	size, ext, starts, node, epoch := d.size.Load(), d.mu.ext, d.mu.starts, d.mu.node, d.mu.epoch
	d.mu.Unlock()
	if off >= size {
		return 0, nil
	}
	n := min(uint64(len(p)), size-off)
	var reqs []transfer.Request
	span(ext, starts, off, n, func(e segment.Extent, rel uint64) bool {
		reqs = append(reqs, transfer.Request{Op: transfer.Read, Buf: transfer.HostBuffer(p), BufOff: rel, Extent: e, Node: node, Epoch: epoch})
		return true
	})
	if err := d.s.eng.Submit(ctx, reqs); err != nil {
		return 0, err
	}
	return int(n), nil
}

// SetMtime sets the modification time the next commit publishes (as
// futimens does before close, for cp -p and tar); a later write or
// truncate resets it to the commit time.
func (d *Draft) SetMtime(ns int64) { d.setMtime(ns) }

func (d *Draft) setMtime(ns int64) {
	d.meta.Lock()
	d.meta.mtime = ns
	d.meta.Unlock()
}

// Truncate sets the draft's size; growing fills with zeros. A failed
// truncation fails the draft, as a failed write does.
func (d *Draft) Truncate(ctx context.Context, size uint64) error {
	err := d.resize(ctx, size, false)
	if err != nil {
		d.fail(err)
	}
	return err
}

// Grow extends the draft to at least size with zeros (fallocate); a draft
// already that large is left alone, even if a write extends it meanwhile.
func (d *Draft) Grow(ctx context.Context, size uint64) error {
	err := d.resize(ctx, size, true)
	if err != nil {
		d.fail(err)
	}
	return err
}

func (d *Draft) resize(ctx context.Context, size uint64, growOnly bool) error {
	if err := d.Err(); err != nil {
		return err
	}
	// An append lands at the end as it is after the resize or before it,
	// never past a shrunk end (a gap of zeros) or inside a grown one.
	d.appendMu.Lock()
	defer d.appendMu.Unlock()
	d.rw.Lock()
	defer d.rw.Unlock()
	d.mu.Lock()
	closed, own, cur := d.mu.closed, d.mu.own, d.size.Load()
	d.mu.Unlock()
	if closed {
		return ErrClosed
	}
	if size == cur || growOnly && size < cur {
		return nil
	}
	if !own {
		if size == 0 {
			d.mu.Lock()
			d.mu.base.Close()
			d.mu.base = nil
			d.mu.own = true
			d.mu.Unlock()
		} else if err := d.materialize(ctx, size); err != nil {
			return err
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.reserveLocked(ctx, size, true); err != nil {
		return err
	}
	if size > d.mu.zeroed {
		if err := d.zeroLocked(ctx, d.mu.zeroed, size); err != nil {
			return err
		}
	}
	d.mu.zeroed = size
	d.size.Store(size)
	d.dirty.Store(true)
	d.setMtime(0)
	return nil
}

// CommitOptions says how a draft becomes the current version of a key.
type CommitOptions struct {
	Key string
	// IfIno, when not zero, requires the key's current object to carry
	// this inode number; otherwise Commit fails with ErrStale (the file
	// was replaced or removed while the draft was open).
	IfIno uint64
	// Exclusive fails with ErrExists if the key exists: first writer wins.
	Exclusive bool
	// IfVersion, when not zero, requires the key's current version to be
	// exactly this; otherwise Commit fails with ErrConflict.
	IfVersion uint64
	// Template gives Mode, Uid, Gid, Ino and Xattrs for a key that does
	// not exist yet. Nil means mode 0644, owner 0, a new inode number.
	Template *Object
	// SetXattrs are set on the committed version, new or not, with its
	// content (a nil value removes the name): attributes that describe
	// the bytes change with them, atomically.
	SetXattrs map[string][]byte
	// SharedXattrs says SetXattrs never changes and names no attribute to
	// remove: a new key with no attribute of its own may take the map as
	// its own (committed objects never change theirs; every change is
	// made on a copy), instead of a copy of it. A batch whose keys carry
	// one meta shares one map.
	SharedXattrs bool
	// replicas is the metadata of the replicas the commit will give the
	// new version (set by the store's own commits): a new key's room for
	// its entry (metaRoom) is checked before they are set on it.
	replicas uint64
	// KillSUID clears the set-user-ID bit of a version that replaces
	// another, and its set-group-ID bit where group execution is allowed:
	// its bytes come, whole, from a caller without the privilege to keep
	// them (a put, as write(2) clears them without CAP_FSETID). A new key
	// takes Template's mode as it is.
	KillSUID bool
	// Last closes the draft with a successful commit: it keeps nothing of
	// the committed version to continue from (a one-shot put saves the
	// lease it would drop at once). A failed commit leaves it open.
	Last bool
}

// Commit makes the draft's content the current version of o.Key (phase
// three). Without IfIno or Exclusive the last committer wins: a conflicting
// commit by someone else is retried against the newer version, keeping its
// metadata. On success the draft continues from the committed version.
func (d *Draft) Commit(ctx context.Context, o CommitOptions) (*Object, error) {
	if err := ValidateKey(o.Key); err != nil {
		return nil, fmt.Errorf("commit %q: %w", o.Key, err)
	}
	d.rw.Lock()
	defer d.rw.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mu.closed {
		return nil, ErrClosed
	}
	if err := d.Err(); err != nil {
		return nil, fmt.Errorf("commit %q: %w", o.Key, err)
	}
	d.meta.Lock()
	place, mtime := d.meta.place, d.meta.mtime
	d.meta.Unlock()
	if !d.mu.own {
		// Unchanged since the base version: nothing to publish.
		return d.mu.base.Object(), nil
	}
	d.trimLocked(ctx)
	ext := d.mu.ext
	size := d.size.Load()
	primary := d.placedLocked()
	if err := d.renewLocked(ctx); err != nil {
		return nil, err
	}
	var extra []Replica
	var extraResv []transfer.Reservation
	if place.Replicas > 1 && size > 0 {
		var err error
		if extra, extraResv, err = d.s.replicate(ctx, primary, size, place.Replicas-1); err != nil {
			return nil, fmt.Errorf("commit %q: %w", o.Key, err)
		}
	}
	// The replica on this node, if any, is a local body from the commit on.
	localExt := ext
	if !d.s.isLocal(primary.Node) {
		localExt = nil
		for _, r := range extra {
			if d.s.isLocal(r.Node) {
				localExt = r.Extents
			}
		}
	}
	rec := d.s.registerBody(localExt)
	if d.s.clustered() || !d.s.isLocal(primary.Node) {
		// Object.body is what a batch get leases without the store's
		// lock (openTogether): a store of one node's, the bytes here.
		rec = nil
	}
	published := false
	defer func() {
		if !published {
			d.s.unregisterBody(localExt)
			d.s.freeReservations(ctx, extraResv)
		}
	}()
	if len(ext) > 0 {
		o.replicas = replicaMeta(primary.Node, len(primary.Extents)) + replicasMeta(extra)
	}
	for {
		cur, err := d.s.idx.Get(ctx, o.Key)
		if err != nil && !errors.Is(err, ErrNotFound) {
			return nil, err
		}
		next, old, err := d.s.nextVersion(ctx, o, cur, size, mtime, place, nil, nil)
		if err != nil {
			return nil, err
		}
		next.Replicas = nil
		if len(ext) > 0 {
			next.Replicas = append([]Replica{primary}, extra...)
			next.body = rec
		}
		_, err = d.s.cas(ctx, Swap{Key: o.Key, Old: old, New: next, InDir: cur == nil})
		if errors.Is(err, ErrConflict) && ctx.Err() == nil {
			// Look again: an Exclusive commit that lost the race now sees
			// the winner and fails with ErrExists, IfIno rechecks the inode.
			continue
		}
		if err != nil {
			return nil, err
		}
		// The draft's extents are now the committed body: keep a lease
		// on them as the base of further changes.
		d.s.mu.Lock()
		if cur != nil {
			d.s.retireLocked(cur)
		}
		// The draft continues from the committed version, read like any
		// reader's (copy on write reads it later).
		var base *Reader
		if !o.Last {
			base = d.s.readerLocked(next, d.s.remoteReplicas(next))
		}
		published = true
		d.s.publishedBodyLocked(next)
		d.s.mu.Unlock()
		d.s.committed(nil, []*Object{next}, nil)
		// Remote reservations now belong to the committed body: their
		// owners take them over when they see the commit.
		for id := range d.mu.resv {
			d.s.handOver(d.mu.node, d.mu.epoch, id)
		}
		for _, r := range extraResv {
			d.s.handOver(r.Node, r.Epoch, r.ID)
		}
		d.mu.ext, d.mu.starts, d.mu.capacity, d.mu.zeroed = nil, nil, 0, 0
		d.mu.extResv, d.mu.resv, d.mu.node, d.mu.epoch = nil, nil, "", 0
		d.dirty.Store(false)
		d.meta.Lock()
		if d.meta.mtime == mtime {
			d.meta.mtime = 0
		}
		d.meta.Unlock()
		if base != nil {
			d.mu.last = base.BytesID()
		}
		switch {
		case o.Last:
			d.closeCommittedLocked()
		case size > 0:
			d.mu.base = base
			d.mu.own = false
		default:
			base.Close()
			d.mu.own = true
		}
		return next, nil
	}
}

// nextVersion returns the object a commit of o, size bytes long, makes
// over cur (nil: none), without replicas, and the version it replaces;
// mtime, when not zero, is an explicit modification time, place the
// placement the bytes were written with. The object is built in into
// when it is not nil (a batch's record of the key), else allocated.
func (s *Store) nextVersion(ctx context.Context, o CommitOptions, cur *Object, size uint64, mtime int64, place Placement, memo *commitMemo, into *Object) (*Object, uint64, error) {
	var next *Object
	var old uint64
	switch {
	case cur != nil && cur.Kind == KindDir:
		return nil, 0, fmt.Errorf("commit %q: %w", o.Key, ErrIsDir)
	case cur != nil && o.Exclusive:
		return nil, 0, fmt.Errorf("commit %q: %w", o.Key, ErrExists)
	case o.IfIno != 0 && (cur == nil || cur.Ino != o.IfIno):
		return nil, 0, fmt.Errorf("commit %q (inode %d): %w", o.Key, o.IfIno, ErrStale)
	case o.IfVersion != 0 && (cur == nil || cur.Version != o.IfVersion):
		return nil, 0, fmt.Errorf("commit %q: not at version %d: %w", o.Key, o.IfVersion, ErrConflict)
	case cur != nil:
		if into == nil {
			into = new(Object)
		}
		next = cur.nextBareTo(into, o.SetXattrs)
		old = cur.Version
		if o.KillSUID {
			next.Mode = KillSUID(next.Mode)
		}
	default:
		parent := memo.parent(ctx, s, o.Key)
		if parent.err != nil {
			return nil, 0, parent.err
		}
		// No object, but maybe an implicit directory: a file there would
		// hide its children.
		if has, err := memo.hasChildren(ctx, s, o.Key); err != nil {
			return nil, 0, err
		} else if has {
			return nil, 0, fmt.Errorf("commit %q: %w", o.Key, ErrIsDir)
		}
		if into == nil {
			into = new(Object)
		}
		next = s.newObjectIn(into, o.Key, KindFile, o.Template, memo.time(s))
		parent.inherit(next)
		if o.SharedXattrs && next.Xattrs == nil {
			next.Xattrs = o.SetXattrs
		} else {
			setXattrs(next, o.SetXattrs)
		}
		grow := next.MetaBytes() + o.replicas
		if !memo.takeMeta(s, grow) { // else held with the batch's budget
			if err := s.metaRoom("commit", o.Key, grow); err != nil {
				return nil, 0, err
			}
			if memo != nil {
				// Held until the batch's swap (Puts.Commit lets it go).
				s.metaHeld.Add(int64(grow))
				memo.metaHeld += grow
			}
		}
	}
	next.Size = size
	next.Mtime = memo.time(s)
	next.Ctime = next.Mtime
	if mtime != 0 {
		next.Mtime = mtime
	}
	if want := place.Replicas; want > 1 {
		if _, ok := next.Xattrs[XattrReplicas]; !ok {
			// Repair restores the count the object was written with.
			// (The map may be cur's: nextBareTo shares it.)
			next.Xattrs = maps.Clone(next.Xattrs)
			if next.Xattrs == nil {
				next.Xattrs = map[string][]byte{}
			}
			next.Xattrs[XattrReplicas] = []byte(strconv.Itoa(want))
		}
	}
	return next, old, nil
}

// KillSUID returns mode without the bits a write by an unprivileged
// caller removes: set-user-ID, and set-group-ID where the group may
// execute (without it the bit marks mandatory locking, kept).
func KillSUID(mode uint32) uint32 {
	mode &^= 0o4000
	if mode&0o010 != 0 {
		mode &^= 0o2000
	}
	return mode
}

// setXattrs applies CommitOptions.SetXattrs to o.
func setXattrs(o *Object, set map[string][]byte) {
	for k, v := range set {
		switch {
		case v != nil:
			if o.Xattrs == nil {
				o.Xattrs = map[string][]byte{}
			}
			o.Xattrs[k] = slices.Clone(v)
		case o.Xattrs != nil:
			delete(o.Xattrs, k)
		}
	}
}

// trimLocked gives back reserved space past the size (rounded to the
// granule). The tail leaves the extent list whatever its owner answers:
// no byte of it is ever published, and a remote part whose free failed
// expires with its reservation once the lease ends (when no kept extent
// is in it) or with the commit's takeover (when one is).
func (d *Draft) trimLocked(ctx context.Context) {
	keep := (d.size.Load() + segment.Granule - 1) / segment.Granule * segment.Granule
	if keep >= d.mu.capacity {
		return
	}
	var kept, freed []segment.Extent
	var keptResv, freedResv []uint64
	var off uint64
	for i, e := range d.mu.ext {
		id := d.mu.extResv[i]
		switch {
		case off >= keep:
			freed, freedResv = append(freed, e), append(freedResv, id)
		case off+e.Len > keep:
			k := keep - off
			kept, keptResv = append(kept, segment.Extent{Segment: e.Segment, Off: e.Off, Len: k}), append(keptResv, id)
			freed, freedResv = append(freed, segment.Extent{Segment: e.Segment, Off: e.Off + k, Len: e.Len - k}), append(freedResv, id)
		default:
			kept, keptResv = append(kept, e), append(keptResv, id)
		}
		off += e.Len
	}
	d.mu.ext, d.mu.extResv = kept, keptResv
	d.mu.starts = extentStarts(kept)
	d.mu.capacity = keep
	d.mu.zeroed = min(d.mu.zeroed, keep)
	if d.s.isLocal(d.mu.node) {
		_ = d.s.segs.Free(freed)
		return
	}
	byID := map[uint64][]segment.Extent{}
	for i, e := range freed {
		byID[freedResv[i]] = append(byID[freedResv[i]], e)
	}
	for id, ext := range byID {
		if !slices.Contains(keptResv, id) {
			// Nothing of it stays: give all of it back.
			delete(d.mu.resv, id)
			d.s.freeReservations(ctx, []transfer.Reservation{{Node: d.mu.node, Epoch: d.mu.epoch, ID: id}})
			continue
		}
		if err := d.s.opts.Transport.Free(ctx, d.mu.node, d.mu.epoch, id, ext); err != nil {
			d.s.opts.Logf("trim reservation %d on node %q: %v", id, d.mu.node, err)
		}
	}
}

// renewLocked renews the draft's remote reservations before a commit: it
// proves the owner still holds them (it did not die or restart since the
// bytes were written) and makes them outlive the commit.
func (d *Draft) renewLocked(ctx context.Context) error {
	for id := range d.mu.resv {
		if err := d.s.opts.Transport.Renew(ctx, d.mu.node, d.mu.epoch, id, d.s.reserveTTL()); err != nil {
			return fmt.Errorf("store: renew reservation on node %q: %w", d.mu.node, err)
		}
		d.s.renewed(d.mu.node, d.mu.epoch, id)
	}
	return nil
}

// Close discards uncommitted changes (revoke: the reservation is freed) and
// drops the lease on the base. Closing twice is a no-op.
func (d *Draft) Close() {
	d.rw.Lock()
	defer d.rw.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mu.closed {
		return
	}
	d.mu.closed = true
	if d.mu.base != nil {
		d.mu.base.Close()
		d.mu.base = nil
	}
	if len(d.mu.ext) > 0 {
		if d.s.isLocal(d.mu.node) {
			_ = d.s.segs.Free(d.mu.ext)
		} else {
			// Best effort: what is not freed now expires with its TTL.
			var all []transfer.Reservation
			for id := range d.mu.resv {
				all = append(all, transfer.Reservation{Node: d.mu.node, Epoch: d.mu.epoch, ID: id})
			}
			d.s.freeReservations(context.Background(), all)
			d.mu.resv = nil
		}
		d.mu.ext = nil
		if d.dirty.Load() {
			d.s.stats.revokes.Add(1)
		}
	}
	d.s.closeIno(d.ino)
}

// closeCommittedLocked closes a draft whose bytes its commit just took
// over (nothing of its own is left to free), as Close would. The caller
// holds d.rw and d.mu.
func (d *Draft) closeCommittedLocked() {
	d.mu.closed = true
	if d.mu.base != nil {
		d.mu.base.Close()
		d.mu.base = nil
	}
	d.s.closeIno(d.ino)
}

// alloc reserves n bytes of local segment space, evicting if allowed.
func (s *Store) alloc(n uint64) ([]segment.Extent, error) {
	if size := s.segs.Size(); n > size {
		// Evicting cannot help: refuse before anything is evicted.
		return nil, fmt.Errorf("store: reserve %d B in a store of %d B: %w", n, size, ErrNoSpace)
	}
	ext, err := s.segs.Alloc(n)
	if err == nil || !errors.Is(err, segment.ErrNoSpace) {
		return ext, err
	}
	var evictErr error // the index's, when it did not answer the pass
	if s.opts.Evict {
		// Even when this pass evicted nothing: another one may have freed
		// the room meanwhile (evictOne waits for a pass it meets).
		_, evictErr = s.evictFor(n)
		if ext, err = s.segs.Alloc(n); err == nil {
			return ext, nil
		}
	}
	// Bytes retired with FreeDelay come back soon: wait for them rather
	// than fail.
	for deadline := time.Now().Add(s.opts.FreeDelay + time.Second); s.stats.delayed.Load() > 0 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		if ext, err = s.segs.Alloc(n); err == nil {
			return ext, nil
		}
	}
	if evictErr != nil {
		// Full, and what would make room cannot be removed for now: a
		// timeout (try again), not a full store.
		return nil, fmt.Errorf("store: reserve %d B: full, and eviction needs the index: %w", n, evictErr)
	}
	return nil, fmt.Errorf("store: reserve %d B: %w", n, errors.Join(ErrNoSpace, err))
}

// CommitInto commits src (a fresh draft holding a whole new content) as
// o.Key's next version, and makes d continue from that version as if d
// had committed it: what d held and had not committed is dropped, since
// the new content replaces all of it. Writers of d wait meanwhile, so no
// write lands in between and is lost. src stays src's to close.
func (d *Draft) CommitInto(ctx context.Context, src *Draft, o CommitOptions) (*Object, error) {
	d.rw.Lock()
	defer d.rw.Unlock()
	d.mu.Lock()
	closed := d.mu.closed
	d.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	obj, err := src.Commit(ctx, o)
	if err != nil {
		return nil, err
	}
	src.rw.Lock()
	src.mu.Lock()
	base := src.mu.base
	src.mu.base, src.mu.own = nil, true
	src.mu.Unlock()
	src.rw.Unlock()
	d.mu.Lock()
	old := d.dropOwnLocked()
	if d.mu.base != nil {
		d.mu.base.Close()
	}
	d.mu.base, d.mu.own = base, base == nil
	d.size.Store(obj.Size)
	d.dirty.Store(false)
	d.mu.Unlock()
	d.s.freeReservations(ctx, old)
	d.meta.Lock()
	d.meta.failed, d.meta.mtime = nil, 0
	d.meta.Unlock()
	return obj, nil
}

// dropOwnLocked forgets the draft's own extents and returns them as
// reservations to free (local ones as allocations). Caller holds d.rw
// exclusively and d.mu.
func (d *Draft) dropOwnLocked() []transfer.Reservation {
	var out []transfer.Reservation
	if len(d.mu.ext) > 0 {
		if d.s.isLocal(d.mu.node) {
			out = append(out, transfer.Reservation{Node: d.s.opts.Node, Extents: d.mu.ext})
		} else {
			for id := range d.mu.resv {
				out = append(out, transfer.Reservation{Node: d.mu.node, Epoch: d.mu.epoch, ID: id})
			}
		}
	}
	d.mu.ext, d.mu.starts, d.mu.capacity, d.mu.zeroed = nil, nil, 0, 0
	d.mu.extResv, d.mu.resv, d.mu.node, d.mu.epoch = nil, nil, "", 0
	return out
}
