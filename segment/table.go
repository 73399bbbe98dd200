package segment

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
)

// Table is the set of this node's segments. Segments are added at mount and
// stay until unmount, so lookups are lock-free: Add publishes a new immutable
// snapshot and readers load it atomically. Table is safe for concurrent use.
type Table struct {
	mu   sync.Mutex // serializes Add; readers never take it
	snap atomic.Pointer[tableSnap]
}

// tableSnap is never modified once published.
type tableSnap struct {
	byID map[ID]*Segment
	list []*Segment // in Add order
	size uint64     // the allocators' sizes, summed
}

// NewTable returns an empty table.
func NewTable() *Table {
	t := &Table{}
	t.snap.Store(&tableSnap{byID: map[ID]*Segment{}})
	return t
}

// Add adds s to the table; the table keeps s until it is dropped. It returns
// an error wrapping ErrDuplicateSegment if a segment with s.ID is present,
// or ErrInvalidSegment if s is nil, has no allocator, or its allocator covers
// more bytes than s.Mem.
func (t *Table) Add(s *Segment) error {
	if s == nil || s.Alloc == nil {
		return fmt.Errorf("segment: add nil segment or allocator: %w", ErrInvalidSegment)
	}
	if s.Alloc.Size() > uint64(len(s.Mem)) {
		return fmt.Errorf("segment: add seg%d (allocator %d B > memory %d B): %w",
			s.ID, s.Alloc.Size(), len(s.Mem), ErrInvalidSegment)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.snap.Load()
	if _, dup := old.byID[s.ID]; dup {
		return fmt.Errorf("segment: add seg%d: %w", s.ID, ErrDuplicateSegment)
	}
	next := &tableSnap{byID: maps.Clone(old.byID), list: append(slices.Clip(old.list), s), size: old.size + s.Alloc.Size()}
	next.byID[s.ID] = s
	t.snap.Store(next)
	return nil
}

// Get returns the segment with the given ID. It takes no lock.
func (t *Table) Get(id ID) (*Segment, bool) {
	s, ok := t.snap.Load().byID[id]
	return s, ok
}

// Size returns the bytes the segments' allocators manage. It takes no
// lock.
func (t *Table) Size() uint64 { return t.snap.Load().size }

// Used returns the bytes allocated in all segments, as Stats().Used
// but cheaply and without locks: each segment's figure is a moment's,
// so the sum may mix moments of concurrent allocations.
func (t *Table) Used() uint64 {
	var n uint64
	for _, s := range t.snap.Load().list {
		n += s.Alloc.Used()
	}
	return n
}

// Segments returns the segments in the order they were added. The caller
// owns the returned slice, not the segments.
func (t *Table) Segments() []*Segment {
	return slices.Clone(t.snap.Load().list)
}

// maxContiguousTries bounds how often Alloc re-picks a best-fit segment when
// a concurrent allocation takes the range it chose.
const maxContiguousTries = 3

// Alloc allocates n bytes, rounded up to Granule, across the table's
// segments and returns the extents in the order the caller should lay its
// bytes out. n == 0 returns nil, nil.
//
// If some segment has one free range that holds n, Alloc returns that single
// extent, best fit across all segments (ties go to the segment added first).
// Otherwise it fills from the segment with the most free space, then the
// next, each segment allocating as Allocator.Alloc does.
//
// If the table has less than n free, Alloc returns an error wrapping
// ErrNoSpace. Failure is all-or-nothing: anything allocated is freed again
// before Alloc returns. While that happens a concurrent Alloc may see the
// space as taken and fail too.
//
// The caller owns the returned extents until it passes them to Free.
func (t *Table) Alloc(n uint64) ([]Extent, error) { return t.AllocTo(nil, n) }

// AllocTo is Alloc appending the extents to dst[:0], whose array holds
// them when it is large enough: a caller that allocates many values can
// give each its room in a record of its own. n == 0 returns dst[:0].
func (t *Table) AllocTo(dst []Extent, n uint64) ([]Extent, error) {
	dst = dst[:0]
	if n == 0 {
		return dst, nil
	}
	segs := t.snap.Load().list
	rn, ok := roundUp(n)
	if !ok {
		return nil, fmt.Errorf("segment: alloc %d B (free %d B): %w", n, t.Stats().Free, ErrNoSpace)
	}

	var laterBuf [64]uint64 // on the stack for tables of up to 64 GiB
	later := laterBuf[:]
	if len(segs) > len(later) {
		later = make([]uint64, len(segs))
	}
	for range maxContiguousTries {
		e, best := look(segs, later, rn, 1, nil, nil)
		if e.Len > 0 {
			return append(dst, e), nil
		}
		if best == nil {
			break
		}
		if r, err := best.Alloc.AllocContiguous(rn); err == nil {
			return append(dst, Extent{Segment: best.ID, Off: r.Off, Len: r.Len}), nil
		}
		// A concurrent Alloc took the range; choose again.
	}

	order := make([]segFree, 0, len(segs))
	var total uint64
	for _, s := range segs {
		f := s.Alloc.freeBytes()
		order = append(order, segFree{s, f})
		total += f
	}
	if total < rn {
		return nil, fmt.Errorf("segment: alloc %d B (free %d B): %w", rn, total, ErrNoSpace)
	}
	slices.SortStableFunc(order, func(a, b segFree) int { return cmp.Compare(b.free, a.free) })
	return t.fill(dst, order, total, rn)
}

// AllocMany allocates sizes[k] bytes for each k, in order, as
// AllocTo(dst[k], sizes[k]) would one after the other: dst[k] gets the
// extents (in its own array when that is large enough) or errs[k] the
// error. Where AllocTo takes a segment's lock for every size, AllocMany
// keeps the lock of the last segment it took from while the next sizes
// fit best there too, so a batch of keys takes it about once. A size
// that one look does not place (a better fit was taken meanwhile, or only
// a split holds it) goes to AllocTo with no lock held. Sizes in a row
// that round alike (a batch of KV blocks) are placed by one look: its
// best fit holds as many of them as it can, one after the other, each
// where a look of its own would have put it (takeFitRunLocked).
func (t *Table) AllocMany(dst [][]Extent, sizes []uint64, errs []error) {
	segs := t.snap.Load().list
	var laterBuf [64]uint64
	later := laterBuf[:]
	if len(segs) > len(later) {
		later = make([]uint64, len(segs))
	}
	var held *Segment
	defer release(&held)
	var again resume
	var run Extent // the rest of the last look's run, for the sizes after its first
	same := 0      // sizes[k:same] round to the size of sizes[k] (while k < same)
	for k, n := range sizes {
		dst[k], errs[k] = dst[k][:0], nil
		if n == 0 {
			continue
		}
		rn, ok := roundUp(n)
		if ok && run.Len > 0 && rn == again.rn {
			dst[k] = append(dst[k], Extent{Segment: run.Segment, Off: run.Off, Len: rn})
			run.Off, run.Len = run.Off+rn, run.Len-rn
			continue
		}
		if ok {
			// The sizes that round to rn from here on, without a gap: one
			// look places as many of them as its best fit holds, each
			// where a look of its own would (takeFitRunLocked).
			if k >= same {
				for same = k + 1; same < len(sizes); same++ {
					if rm, ok := roundUp(sizes[same]); !ok || rm != rn {
						break
					}
				}
			}
			count := uint64(same - k)
			if e, _ := look(segs, later, rn, count, &held, &again); e.Len > 0 {
				dst[k] = append(dst[k], Extent{Segment: e.Segment, Off: e.Off, Len: rn})
				run = Extent{Segment: e.Segment, Off: e.Off + rn, Len: e.Len - rn}
				continue
			}
		}
		run = Extent{}
		release(&held)
		dst[k], errs[k] = t.AllocTo(dst[k], n)
	}
}

// look makes AllocTo's look at segs for one contiguous fit of rn bytes.
// It looks at the segments in order, by their lock, only where their
// size classes say they may beat the best fit so far (a fit as good goes
// to the earlier segment), and takes a fit that no later segment can
// beat (an exact one always): it returns that extent, or none and the
// segment of the best fit it saw (nil: no single range holds rn). later
// (len(segs), scratch) gets the classes of the segments after each, read
// once per look. With held non-nil the lock of the segment looked into
// last stays held, *held naming it, for the next look (AllocMany, which
// lets go with release); otherwise each segment's lock is taken alone.
//
// With again non-nil (AllocMany), a look for the size that the last one
// took starts at the segment it took from, with what it had found before
// it, and the classes it read (later) for the segments from there on: on
// a quiet table only that segment changed since, so the segments before
// it would be passed over again, and a batch of equal sizes costs a look
// of one segment a size, not of every segment. (A free into an earlier
// segment meanwhile, by another caller, goes unseen until the size
// changes: a fit as valid, maybe not the best.)
func look(segs []*Segment, later []uint64, rn, count uint64, held **Segment, again *resume) (Extent, *Segment) {
	from := 0
	var best *Segment
	bestLen := uint64(math.MaxUint64)
	if again != nil && again.rn == rn {
		from, bestLen = again.at, again.bestLen // (AllocMany reads no best)
	} else {
		var after uint64
		for i := len(segs) - 1; i >= 0; i-- {
			later[i] = after
			after |= segs[i].Alloc.classes.Load()
		}
	}
	if again != nil {
		again.rn = 0 // unless this look takes a fit
	}
	for i := from; i < len(segs); i++ {
		s := segs[i]
		if !s.Alloc.mayHold(rn, bestLen-1) {
			continue
		}
		below := bestLen
		if bound := fitBound(later[i], rn); bound < below {
			below = bound + 1 // a later fit as long loses to this one
		}
		var r Range
		var l uint64
		var ok bool
		if held == nil {
			r, l, ok = s.Alloc.takeFit(rn, below)
		} else {
			if *held != s {
				release(held)
				s.Alloc.mu.Lock()
				*held = s
			}
			r, l, ok = s.Alloc.takeFitRunLocked(rn, count, below)
		}
		if r.Len > 0 {
			if again != nil {
				*again = resume{rn: rn, at: i, bestLen: bestLen}
			}
			return Extent{Segment: s.ID, Off: r.Off, Len: r.Len}, s
		}
		if ok && l < bestLen {
			best, bestLen = s, l
		}
	}
	return Extent{}, best
}

// resume is where AllocMany's next look of the same size starts (look).
type resume struct {
	rn      uint64 // the size the last look took; 0: none
	at      int    // the index of the segment it took from
	bestLen uint64 // the best fit before that segment
}

// release lets go of the lock look kept for *held, if any.
func release(held **Segment) {
	if *held != nil {
		(*held).Alloc.mu.Unlock()
		*held = nil
	}
}

// fitBound is a lower bound on the best fit for n bytes among free ranges
// of the given size classes: MaxUint64 when none may hold n.
func fitBound(classes, n uint64) uint64 {
	classes &^= 1<<classOf(n) - 1
	if classes == 0 {
		return math.MaxUint64
	}
	return max(n, 1<<bits.TrailingZeros64(classes))
}

// segFree is a segment and its free bytes when Alloc looked.
type segFree struct {
	s    *Segment
	free uint64
}

// fill allocates rn bytes from the segments in order, each giving as much
// as it has, appending the extents to out (empty). total is what the
// caller counted free in them; concurrent allocations may since have
// taken some, in which case fill frees what it got and returns ErrNoSpace.
func (t *Table) fill(out []Extent, order []segFree, total, rn uint64) ([]Extent, error) {
	rem := rn
	for _, sf := range order {
		if rem == 0 {
			break
		}
		for _, r := range sf.s.Alloc.allocUpTo(rem) {
			out = append(out, Extent{Segment: sf.s.ID, Off: r.Off, Len: r.Len})
			rem -= r.Len
		}
	}
	if rem > 0 {
		err := fmt.Errorf("segment: alloc %d B (free %d B when counted, got %d B): %w",
			rn, total, rn-rem, ErrNoSpace)
		if ferr := t.Free(out); ferr != nil {
			err = errors.Join(err, fmt.Errorf("segment: alloc rollback: %w", ferr))
		}
		return nil, err
	}
	return out, nil
}

// Free frees each extent in its segment. It does not stop at a bad extent:
// it frees the rest and returns every error joined, each wrapping
// ErrUnknownSegment, ErrBadRange or ErrDoubleFree (the last panics in
// -tags invariants builds).
//
// Extents of one segment that follow each other in es are freed under one
// hold of its lock: a batch frees its keys' room in one go.
func (t *Table) Free(es []Extent) error {
	snap := t.snap.Load()
	var errs []error
	var buf [16]Range
	for i := 0; i < len(es); {
		id := es[i].Segment
		j := i + 1
		for j < len(es) && es[j].Segment == id {
			j++
		}
		s, ok := snap.byID[id]
		if !ok {
			for _, e := range es[i:j] {
				errs = append(errs, fmt.Errorf("segment: free %v: %w", e, ErrUnknownSegment))
			}
			i = j
			continue
		}
		for i < j {
			rs := buf[:0]
			for ; i < j && len(rs) < len(buf); i++ {
				rs = append(rs, es[i].Range())
			}
			if err := s.Alloc.freeMany(rs); err != nil {
				errs = append(errs, fmt.Errorf("segment: seg%d: %w", id, err))
			}
		}
	}
	return errors.Join(errs...)
}

// Bytes returns the memory of e; see Segment.Bytes for what the slice
// aliases. It returns an error wrapping ErrUnknownSegment if e's segment is
// not in the table, or ErrBadRange if e does not lie within it. It takes no
// lock and does not check that e is allocated.
func (t *Table) Bytes(e Extent) ([]byte, error) {
	s, ok := t.Get(e.Segment)
	if !ok {
		return nil, fmt.Errorf("segment: bytes %v: %w", e, ErrUnknownSegment)
	}
	b := s.Bytes(e)
	if b == nil {
		return nil, fmt.Errorf("segment: bytes %v (segment %d B): %w", e, len(s.Mem), ErrBadRange)
	}
	return b, nil
}

// Stats returns the sum of the segments' stats. LargestFree is the largest
// free range in any one segment; Fragmentation is recomputed from it. The
// segments are read one at a time, so under concurrent use the sum is not
// one instant's picture.
func (t *Table) Stats() Stats {
	// Fragmentation is the free-weighted mean of the segments' own: free
	// space split only by segment boundaries is not fragmented, since an
	// object's extents may lie in several segments.
	var st Stats
	var weighted float64
	for _, s := range t.snap.Load().list {
		ss := s.Alloc.Stats()
		st.Size += ss.Size
		st.Used += ss.Used
		st.Free += ss.Free
		st.LargestFree = max(st.LargestFree, ss.LargestFree)
		st.FreeRanges += ss.FreeRanges
		weighted += ss.Fragmentation * float64(ss.Free)
	}
	if st.Free > 0 {
		st.Fragmentation = weighted / float64(st.Free)
	}
	return st
}
