package store

import (
	"context"
	"errors"
	"fmt"
	"sync"

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
// Lock order: rw before mu; mu is never held across a copy.
type Draft struct {
	s   *Store
	ino uint64
	// rw is held shared by writers while they copy, and exclusively by
	// truncation, copy-on-write, commit and close.
	rw sync.RWMutex
	mu struct {
		sync.Mutex
		base     *Reader // unmodified base version, nil once copied
		own      bool    // the draft has its own extents
		ext      []segment.Extent
		starts   []uint64
		capacity uint64
		size     uint64
		zeroed   uint64 // bytes [0,zeroed) are defined: written or zero-filled
		dirty    bool
		closed   bool
		mtime    int64 // explicit modification time (SetMtime) since the last change; 0: now
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
	s.openIno(ino)
	if base != nil && !trunc && base.Size() > 0 {
		d.mu.base = base
		d.mu.size = base.Size()
	} else {
		if base != nil {
			base.Close()
		}
		d.mu.own = true
		d.mu.dirty = trunc && base != nil && base.Size() > 0
	}
	return d
}

// Size returns the draft's current size.
func (d *Draft) Size() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mu.size
}

// Dirty reports whether the draft differs from the version it started from
// (or last committed).
func (d *Draft) Dirty() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mu.dirty
}

// reserveLocked grows the draft to hold at least need bytes.
func (d *Draft) reserveLocked(need uint64) error {
	if need <= d.mu.capacity {
		return nil
	}
	grow := need - d.mu.capacity
	want := max(grow, min(max(d.mu.capacity, minGrow), maxGrow))
	// Speculative growth never evicts: only what is really needed may
	// push other objects out.
	ext, err := d.s.segs.Alloc(want)
	if err != nil {
		ext, err = d.s.alloc(grow)
	}
	if err != nil {
		return err
	}
	d.mu.ext = append(d.mu.ext, ext...)
	d.mu.starts = extentStarts(d.mu.ext)
	d.mu.capacity = segment.TotalLen(d.mu.ext)
	return nil
}

// zeroLocked fills [from, to) of the draft with zeros.
func (d *Draft) zeroLocked(from, to uint64) {
	if to <= from {
		return
	}
	span(d.mu.ext, d.mu.starts, from, to-from, func(e segment.Extent, _ uint64) bool {
		if m, err := d.s.segs.Bytes(e); err == nil {
			clear(m)
		}
		return true
	})
}

// materialize copies up to keep bytes of the base into the draft's own
// extents. Caller holds d.rw exclusively.
func (d *Draft) materialize(ctx context.Context, keep uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mu.own {
		return nil
	}
	base := d.mu.base
	keep = min(keep, base.Size())
	if err := d.reserveLocked(keep); err != nil {
		return err
	}
	if keep > 0 && base.remote != nil {
		if err := d.fetchLocked(ctx, base, keep); err != nil {
			return fmt.Errorf("store: copy on write of %d B: %w", keep, err)
		}
	} else if keep > 0 {
		var reqs []transfer.Request
		var err error
		span(base.b.extents, base.b.starts, 0, keep, func(src segment.Extent, rel uint64) bool {
			var m []byte
			if m, err = d.s.segs.Bytes(src); err != nil {
				return false
			}
			span(d.mu.ext, d.mu.starts, rel, src.Len, func(dst segment.Extent, r2 uint64) bool {
				reqs = append(reqs, transfer.Request{Op: transfer.Write, Buf: transfer.HostBuffer(m), BufOff: r2, Extent: dst})
				return true
			})
			return true
		})
		if err == nil {
			err = d.s.eng.Submit(ctx, reqs)
		}
		if err != nil {
			return fmt.Errorf("store: copy on write of %d B: %w", keep, err)
		}
	}
	base.Close()
	d.mu.base = nil
	d.mu.own = true
	d.mu.size = keep
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
func (d *Draft) WriteFrom(ctx context.Context, buf transfer.Buffer, off uint64) (uint64, error) {
	n := buf.Size()
	if n == 0 {
		return 0, nil
	}
	end := off + n
	if end < off {
		return 0, fmt.Errorf("store: write %d B at %d: %w", n, off, ErrTooLarge)
	}
	for {
		if err := d.ensureOwn(ctx, ^uint64(0)); err != nil {
			return 0, err
		}
		d.rw.RLock()
		d.mu.Lock()
		if d.mu.own || d.mu.closed {
			break
		}
		// A commit between ensureOwn and RLock made the committed version
		// the base again; writing now would go to extents no commit sees.
		d.mu.Unlock()
		d.rw.RUnlock()
	}
	defer d.rw.RUnlock()
	if d.mu.closed {
		d.mu.Unlock()
		return 0, ErrClosed
	}
	if err := d.reserveLocked(end); err != nil {
		d.mu.Unlock()
		return 0, err
	}
	if off > d.mu.zeroed {
		d.zeroLocked(d.mu.zeroed, off)
	}
	d.mu.zeroed = max(d.mu.zeroed, end)
	ext, starts := d.mu.ext, d.mu.starts
	d.mu.Unlock()

	var reqs []transfer.Request
	span(ext, starts, off, n, func(e segment.Extent, rel uint64) bool {
		reqs = append(reqs, transfer.Request{Op: transfer.Write, Buf: buf, BufOff: rel, Extent: e})
		return true
	})
	if err := d.s.eng.Submit(ctx, reqs); err != nil {
		d.mu.Lock()
		d.zeroLocked(off, end)
		d.mu.Unlock()
		return 0, err
	}
	d.mu.Lock()
	d.mu.size = max(d.mu.size, end)
	d.mu.dirty = true
	d.mu.mtime = 0
	d.mu.Unlock()
	return n, nil
}

// ReadAt copies draft bytes at off into p and returns the count, short at
// the draft's end.
func (d *Draft) ReadAt(ctx context.Context, p []byte, off uint64) (int, error) {
	d.rw.RLock()
	defer d.rw.RUnlock()
	d.mu.Lock()
	if d.mu.closed {
		d.mu.Unlock()
		return 0, ErrClosed
	}
	if base := d.mu.base; base != nil {
		d.mu.Unlock()
		return base.ReadAt(ctx, p, off)
	}
	size, ext, starts := d.mu.size, d.mu.ext, d.mu.starts
	d.mu.Unlock()
	if off >= size {
		return 0, nil
	}
	n := min(uint64(len(p)), size-off)
	var reqs []transfer.Request
	span(ext, starts, off, n, func(e segment.Extent, rel uint64) bool {
		reqs = append(reqs, transfer.Request{Op: transfer.Read, Buf: transfer.HostBuffer(p), BufOff: rel, Extent: e})
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
func (d *Draft) SetMtime(ns int64) {
	d.mu.Lock()
	d.mu.mtime = ns
	d.mu.Unlock()
}

// Truncate sets the draft's size; growing fills with zeros.
func (d *Draft) Truncate(ctx context.Context, size uint64) error {
	d.rw.Lock()
	defer d.rw.Unlock()
	d.mu.Lock()
	closed, own, cur := d.mu.closed, d.mu.own, d.mu.size
	d.mu.Unlock()
	if closed {
		return ErrClosed
	}
	if size == cur {
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
	if err := d.reserveLocked(size); err != nil {
		return err
	}
	if size > d.mu.zeroed {
		d.zeroLocked(d.mu.zeroed, size)
	}
	d.mu.zeroed = size
	d.mu.size = size
	d.mu.dirty = true
	d.mu.mtime = 0
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
	if !d.mu.own {
		// Unchanged since the base version: nothing to publish.
		return d.mu.base.Object(), nil
	}
	d.trimLocked()
	ext := d.mu.ext
	size := d.mu.size
	d.s.registerBody(ext)
	published := false
	defer func() {
		if !published {
			d.s.unregisterBody(ext)
		}
	}()
	for {
		cur, err := d.s.idx.Get(ctx, o.Key)
		if err != nil && !errors.Is(err, ErrNotFound) {
			return nil, err
		}
		var next *Object
		var old uint64
		switch {
		case cur != nil && cur.Kind == KindDir:
			return nil, fmt.Errorf("commit %q: %w", o.Key, ErrIsDir)
		case cur != nil && o.Exclusive:
			return nil, fmt.Errorf("commit %q: %w", o.Key, ErrExists)
		case o.IfIno != 0 && (cur == nil || cur.Ino != o.IfIno):
			return nil, fmt.Errorf("commit %q (inode %d): %w", o.Key, o.IfIno, ErrStale)
		case o.IfVersion != 0 && (cur == nil || cur.Version != o.IfVersion):
			return nil, fmt.Errorf("commit %q: not at version %d: %w", o.Key, o.IfVersion, ErrConflict)
		case cur != nil:
			next = cur.Clone()
			old = cur.Version
		default:
			if err := d.s.checkParent(ctx, o.Key); err != nil {
				return nil, err
			}
			// No object, but maybe an implicit directory: a file there
			// would hide its children.
			if has, err := d.s.hasChildren(ctx, o.Key); err != nil {
				return nil, err
			} else if has {
				return nil, fmt.Errorf("commit %q: %w", o.Key, ErrIsDir)
			}
			next = d.s.newObject(o.Key, KindFile, o.Template)
		}
		next.Size = size
		next.Mtime = d.s.now()
		next.Ctime = next.Mtime
		if d.mu.mtime != 0 {
			next.Mtime = d.mu.mtime
		}
		next.Replicas = nil
		if len(ext) > 0 {
			next.Replicas = []Replica{{Node: d.s.opts.Node, Extents: ext}}
		}
		_, err = d.s.idx.CompareAndSwap(ctx, Swap{Key: o.Key, Old: old, New: next})
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
		b := d.s.acquireLocked(next)
		d.s.mu.opens[next.Ino]++
		published = true
		d.s.publishedBodyLocked(next)
		d.s.mu.Unlock()
		d.s.committed(nil, []*Object{next}, nil)
		d.mu.ext, d.mu.starts, d.mu.capacity, d.mu.zeroed = nil, nil, 0, 0
		d.mu.dirty = false
		d.mu.mtime = 0
		if size > 0 {
			d.mu.base = &Reader{s: d.s, obj: next, b: b}
			d.mu.own = false
		} else {
			d.s.release(b)
			d.s.closeIno(next.Ino)
			d.mu.own = true
		}
		return next, nil
	}
}

// trimLocked frees reserved space past the size (rounded to the granule).
func (d *Draft) trimLocked() {
	keep := (d.mu.size + segment.Granule - 1) / segment.Granule * segment.Granule
	if keep >= d.mu.capacity {
		return
	}
	var kept, freed []segment.Extent
	var off uint64
	for _, e := range d.mu.ext {
		switch {
		case off >= keep:
			freed = append(freed, e)
		case off+e.Len > keep:
			k := keep - off
			kept = append(kept, segment.Extent{Segment: e.Segment, Off: e.Off, Len: k})
			freed = append(freed, segment.Extent{Segment: e.Segment, Off: e.Off + k, Len: e.Len - k})
		default:
			kept = append(kept, e)
		}
		off += e.Len
	}
	_ = d.s.segs.Free(freed)
	d.mu.ext = kept
	d.mu.starts = extentStarts(kept)
	d.mu.capacity = keep
	d.mu.zeroed = min(d.mu.zeroed, keep)
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
		_ = d.s.segs.Free(d.mu.ext)
		d.mu.ext = nil
		if d.mu.dirty {
			d.s.stats.revokes.Add(1)
		}
	}
	d.s.closeIno(d.ino)
}

// alloc reserves n bytes of local segment space, evicting if allowed.
func (s *Store) alloc(n uint64) ([]segment.Extent, error) {
	if size := s.segs.Stats().Size; n > size {
		// Evicting cannot help: refuse before anything is evicted.
		return nil, fmt.Errorf("store: reserve %d B in a store of %d B: %w", n, size, ErrNoSpace)
	}
	ext, err := s.segs.Alloc(n)
	if err == nil || !errors.Is(err, segment.ErrNoSpace) {
		return ext, err
	}
	if s.opts.Evict && s.evictFor(n) {
		if ext, err = s.segs.Alloc(n); err == nil {
			return ext, nil
		}
	}
	return nil, fmt.Errorf("store: reserve %d B: %w", n, errors.Join(ErrNoSpace, err))
}
