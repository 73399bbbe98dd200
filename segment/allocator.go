package segment

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sync"
	"sync/atomic"

	"github.com/google/btree"
)

// Granule is the unit of allocation in bytes. Every offset and length the
// allocator hands out or accepts is a multiple of it.
const Granule = 4096

// Range is a byte range [Off, Off+Len) inside one allocator's space.
type Range struct {
	Off uint64
	Len uint64
}

// End returns the offset one past the last byte of r.
func (r Range) End() uint64 { return r.Off + r.Len }

func (r Range) String() string { return fmt.Sprintf("[%d+%d)", r.Off, r.Len) }

// Range returns the range of e inside its segment.
func (e Extent) Range() Range { return Range{Off: e.Off, Len: e.Len} }

// Stats is a snapshot of an allocator's (or a table's) space.
type Stats struct {
	Size        uint64 // bytes managed
	Used        uint64 // bytes allocated
	Free        uint64 // bytes free; Used+Free == Size
	LargestFree uint64 // length of the largest free range
	FreeRanges  int    // number of free ranges after coalescing
	// Fragmentation is 1 - LargestFree/Free: 0 when all free space is one
	// range (or there is none), approaching 1 as it splinters.
	Fragmentation float64
}

func fragmentation(largest, free uint64) float64 {
	if free == 0 {
		return 0
	}
	return 1 - float64(largest)/float64(free)
}

// btreeDegree suits small fixed-size items: nodes of up to 63 ranges fit in
// a few cache lines' worth of pointers and keep the trees shallow.
const btreeDegree = 32

// Allocator hands out granule-aligned ranges of [0, Size). It knows nothing
// about the memory it describes. It is safe for concurrent use; every method
// takes a.mu for its whole duration and never calls out while holding it.
//
// Free space is kept twice: by offset, for coalescing on Free, and by
// (length, offset), for best fit on Alloc. Both are O(log n) in the number of
// free ranges.
type Allocator struct {
	size uint64 // immutable

	mu struct {
		sync.Mutex
		byOff *btree.BTreeG[Range] // free ranges keyed by Off
		byLen *btree.BTreeG[Range] // the same ranges keyed by (Len, Off)
		free  uint64               // sum of the free ranges' lengths
		used  uint64               // bytes handed out and not yet freed
		// perClass counts the free ranges of each size class (classOf).
		perClass [64]int
	}
	// usedNow mirrors mu.used for readers that take no lock (Used).
	usedNow atomic.Uint64
	// classes has bit c set while some free range is of class c: a
	// table of many segments skips, without their locks, those that
	// cannot hold an allocation better than one it has found (mayHold).
	classes atomic.Uint64
}

// classOf is the size class of a free range of n > 0 bytes, floor(log2 n):
// a range of class c is [2^c, 2^(c+1)) bytes long.
func classOf(n uint64) int { return bits.Len64(n) - 1 }

// mayHold reports whether a free range of a length in [lo, hi] may exist:
// false is certain at the moment of the call, true is a maybe (another
// length of the same classes). 0 < lo.
func (a *Allocator) mayHold(lo, hi uint64) bool {
	if hi < lo {
		return false
	}
	return classMask(classOf(lo), classOf(hi))&a.classes.Load() != 0
}

// classMask has bits lo to hi set.
func classMask(lo, hi int) uint64 { return (^uint64(0) >> (63 - hi)) &^ (1<<lo - 1) }

func lessByOff(a, b Range) bool { return a.Off < b.Off }

func lessByLen(a, b Range) bool {
	if a.Len != b.Len {
		return a.Len < b.Len
	}
	return a.Off < b.Off
}

// NewAllocator returns an allocator over [0, size) with everything free.
// size is rounded down to a multiple of Granule.
func NewAllocator(size uint64) *Allocator {
	a := &Allocator{size: size &^ (Granule - 1)}
	a.mu.byOff = btree.NewG(btreeDegree, lessByOff)
	a.mu.byLen = btree.NewG(btreeDegree, lessByLen)
	if a.size > 0 {
		a.insertLocked(Range{Off: 0, Len: a.size})
	}
	a.mu.free = a.size
	return a
}

// Size returns the number of bytes the allocator manages.
func (a *Allocator) Size() uint64 { return a.size }

// roundUp rounds n up to a multiple of Granule; ok is false on overflow.
func roundUp(n uint64) (_ uint64, ok bool) {
	if n > math.MaxUint64-(Granule-1) {
		return 0, false
	}
	return (n + Granule - 1) &^ (Granule - 1), true
}

// Alloc allocates n bytes, rounded up to Granule, and returns the ranges in
// the order the caller should lay its bytes out. n == 0 returns nil, nil.
//
// If one free range can hold n, Alloc returns a single range taken from the
// start of the smallest such range (best fit; ties go to the lowest offset).
// Otherwise it takes the largest free ranges whole, largest first, and the
// start of one more for the remainder, so an allocation can use all free
// space. If less than n is free it returns an error wrapping ErrNoSpace and
// changes nothing.
//
// The caller owns the returned ranges until it passes them to Free.
func (a *Allocator) Alloc(n uint64) ([]Range, error) {
	if n == 0 {
		return nil, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	rn, ok := roundUp(n)
	if !ok || rn > a.mu.free {
		// max reports the rounded size, or n itself if rounding overflowed.
		return nil, fmt.Errorf("segment: alloc %d B (free %d B): %w", max(n, rn), a.mu.free, ErrNoSpace)
	}
	rs := a.allocLocked(rn)
	a.checkInvariantsLocked()
	return rs, nil
}

// AllocContiguous allocates n bytes, rounded up to Granule, as one range,
// best fit. n == 0 returns an empty Range and no error. If no free range is
// large enough it returns an error wrapping ErrNoSpace and changes nothing.
func (a *Allocator) AllocContiguous(n uint64) (Range, error) {
	if n == 0 {
		return Range{}, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	rn, ok := roundUp(n)
	var r Range
	if ok {
		r, ok = a.bestFitLocked(rn)
	}
	if !ok {
		largest, _ := a.mu.byLen.Max()
		return Range{}, fmt.Errorf("segment: alloc contiguous %d B (largest free %d B): %w",
			max(n, rn), largest.Len, ErrNoSpace)
	}
	a.takeLocked(r, rn)
	a.checkInvariantsLocked()
	return Range{Off: r.Off, Len: rn}, nil
}

// allocUpTo allocates min(n, free) bytes the way Alloc does and returns the
// ranges, or nil if nothing is free. n must be a multiple of Granule.
func (a *Allocator) allocUpTo(n uint64) []Range {
	a.mu.Lock()
	defer a.mu.Unlock()
	n = min(n, a.mu.free)
	if n == 0 {
		return nil
	}
	rs := a.allocLocked(n)
	a.checkInvariantsLocked()
	return rs
}

// takeFit allocates n bytes (a multiple of Granule) from the free range
// AllocContiguous(n) would take from, when that range is exactly n long
// (no other segment can fit n better) or shorter than below (a caller
// that saw no better fit elsewhere). Otherwise it allocates nothing and
// returns that range's length, ok false when no range holds n.
func (a *Allocator) takeFit(n, below uint64) (taken Range, best uint64, ok bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.takeFitLocked(n, below)
}

// takeFitLocked is takeFit with a.mu held.
func (a *Allocator) takeFitLocked(n, below uint64) (taken Range, best uint64, ok bool) {
	return a.takeFitRunLocked(n, 1, below)
}

// takeFitRunLocked is takeFitLocked for up to count allocations of n
// bytes one after the other, taken as one range of a multiple of n
// bytes: as many as the best fit for the first holds, up to count. Each
// of them would have gone where it lies: once the first n bytes of the
// best fit r are taken, the rest of r is shorter than r, and no other
// free range is of a length in [n, r.Len) (r was the best fit), so the
// rest of r is the next best fit while it holds n. One search and one
// change of the free lists, not one of each per allocation. a.mu held.
func (a *Allocator) takeFitRunLocked(n, count, below uint64) (taken Range, best uint64, ok bool) {
	r, ok := a.bestFitLocked(n)
	if !ok {
		return Range{}, 0, false
	}
	if r.Len == n || r.Len < below {
		k := min(max(count, 1), r.Len/n) * n
		a.takeLocked(r, k)
		a.checkInvariantsLocked()
		return Range{Off: r.Off, Len: k}, r.Len, true
	}
	return Range{}, r.Len, true
}

// freeBytes returns the number of free bytes.
func (a *Allocator) freeBytes() uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.mu.free
}

// allocLocked allocates n bytes; 0 < n <= a.mu.free and n is a multiple of
// Granule.
func (a *Allocator) allocLocked(n uint64) []Range {
	if r, ok := a.bestFitLocked(n); ok {
		a.takeLocked(r, n)
		return []Range{{Off: r.Off, Len: n}}
	}
	// No range holds n, so every range taken here but the last is taken whole.
	var out []Range
	for n > 0 {
		r, _ := a.mu.byLen.Max()
		k := min(r.Len, n)
		a.takeLocked(r, k)
		out = append(out, Range{Off: r.Off, Len: k})
		n -= k
	}
	return out
}

// bestFitLocked returns the smallest free range of at least n bytes, lowest
// offset first among equals.
func (a *Allocator) bestFitLocked(n uint64) (best Range, ok bool) {
	a.mu.byLen.AscendGreaterOrEqual(Range{Len: n}, func(r Range) bool {
		best, ok = r, true
		return false
	})
	return best, ok
}

// takeLocked allocates the first k bytes of the free range r. The
// remainder goes in before r goes out: classes, read without the lock,
// may show a class too many during a change, never one too few of what
// holds before and after it (a reader would skip a segment that fits).
func (a *Allocator) takeLocked(r Range, k uint64) {
	if r.Len > k {
		a.insertLocked(Range{Off: r.Off + k, Len: r.Len - k})
	}
	a.deleteLocked(r)
	a.mu.free -= k
	a.mu.used += k
	a.usedNow.Store(a.mu.used)
}

func (a *Allocator) insertLocked(r Range) {
	a.mu.byOff.ReplaceOrInsert(r)
	a.mu.byLen.ReplaceOrInsert(r)
	a.countClassLocked(classOf(r.Len), 1)
}

func (a *Allocator) deleteLocked(r Range) {
	a.mu.byOff.Delete(r)
	a.mu.byLen.Delete(r)
	a.countClassLocked(classOf(r.Len), -1)
}

// countClassLocked adds d to the count of free ranges of class c, and
// sets or clears the class's bit in classes when the count leaves or
// reaches 0.
func (a *Allocator) countClassLocked(c, d int) {
	was := a.mu.perClass[c]
	a.mu.perClass[c] = was + d
	switch {
	case was == 0 && d > 0:
		a.classes.Store(a.classes.Load() | 1<<c)
	case was+d == 0:
		a.classes.Store(a.classes.Load() &^ (1 << c))
	}
}

// Free returns r to the free space and merges it with free neighbours. r need
// not be a whole range from Alloc: any allocated, granule-aligned part of
// one may be freed, e.g. a tail being trimmed.
//
// A range that is empty, unaligned or out of bounds returns an error
// wrapping ErrBadRange. A range that overlaps free space returns an error
// wrapping ErrDoubleFree, or panics in builds with -tags invariants. Either
// way nothing changes.
func (a *Allocator) Free(r Range) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.freeLocked(r)
}

// freeMany frees each of rs (checked as Free checks them) under one hold
// of the lock, and returns every error joined. A run of ranges that
// follow each other (the values of a batch, allocated one after the
// other) is freed as one range, one change of the free lists; if that
// fails, each of them is freed alone, with its own error.
func (a *Allocator) freeMany(rs []Range) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	for i := 0; i < len(rs); {
		// Only whole granules join a run: parts that are not would be
		// refused alone, and must be.
		j, run := i+1, rs[i]
		for wholeGranules(run) && j < len(rs) && rs[j].Off == run.End() && wholeGranules(rs[j]) && run.Len <= a.size-rs[j].Len {
			run.Len += rs[j].Len
			j++
		}
		if j == i+1 || a.freeLocked(run) != nil {
			for _, r := range rs[i:j] {
				if err := a.freeLocked(r); err != nil {
					errs = append(errs, err)
				}
			}
		}
		i = j
	}
	return errors.Join(errs...)
}

// wholeGranules reports whether r is a non-empty run of whole granules.
func wholeGranules(r Range) bool { return r.Len > 0 && r.Off%Granule == 0 && r.Len%Granule == 0 }

// freeLocked is Free with a.mu held.
func (a *Allocator) freeLocked(r Range) error {
	if !wholeGranules(r) || r.Len > a.size || r.Off > a.size-r.Len {
		return fmt.Errorf("segment: free %v (size %d B): %w", r, a.size, ErrBadRange)
	}
	// prev is the last free range starting at or before r, next the first
	// one starting after r. Free ranges do not overlap, so r overlaps free
	// space exactly when it overlaps one of them.
	var prev, next Range
	var hasPrev, hasNext bool
	a.mu.byOff.DescendLessOrEqual(Range{Off: r.Off}, func(f Range) bool {
		prev, hasPrev = f, true
		return false
	})
	a.mu.byOff.AscendGreaterOrEqual(Range{Off: r.Off + 1}, func(f Range) bool {
		next, hasNext = f, true
		return false
	})
	var overlap Range
	switch {
	case hasPrev && prev.End() > r.Off:
		overlap = prev
	case hasNext && next.Off < r.End():
		overlap = next
	}
	if overlap.Len > 0 {
		err := fmt.Errorf("segment: free %v (overlaps free %v): %w", r, overlap, ErrDoubleFree)
		if invariants {
			panic(err)
		}
		return err
	}

	merged := r
	if hasPrev && prev.End() == r.Off {
		merged.Off, merged.Len = prev.Off, merged.Len+prev.Len
	}
	if hasNext && next.Off == r.End() {
		merged.Len += next.Len
	}
	// The merged range's class counts before its parts go (takeLocked
	// says why), and once it is in, that extra count goes.
	a.countClassLocked(classOf(merged.Len), 1)
	if merged.Off != r.Off {
		a.deleteLocked(prev)
	}
	if merged.End() != r.End() {
		a.deleteLocked(next)
	}
	a.insertLocked(merged)
	a.countClassLocked(classOf(merged.Len), -1)
	a.mu.free += r.Len
	a.mu.used -= r.Len
	a.usedNow.Store(a.mu.used)
	a.checkInvariantsLocked()
	return nil
}

// Stats returns a snapshot of the allocator's space.
func (a *Allocator) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	largest, _ := a.mu.byLen.Max()
	return Stats{
		Size:          a.size,
		Used:          a.mu.used,
		Free:          a.mu.free,
		LargestFree:   largest.Len,
		FreeRanges:    a.mu.byOff.Len(),
		Fragmentation: fragmentation(largest.Len, a.mu.free),
	}
}

// Used returns the bytes handed out and not yet freed, without the lock:
// a moment's value, for a quick look such as an eviction watermark.
func (a *Allocator) Used() uint64 { return a.usedNow.Load() }

// FreeRanges returns the free ranges in offset order. It is O(n) and meant
// for tests and diagnostics.
func (a *Allocator) FreeRanges() []Range {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]Range, 0, a.mu.byOff.Len())
	a.mu.byOff.Ascend(func(r Range) bool {
		out = append(out, r)
		return true
	})
	return out
}

// Check verifies the allocator's invariants (see the package doc) and
// returns every violation found, each wrapping ErrCorrupt. It is O(n log n)
// in the number of free ranges.
func (a *Allocator) Check() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.checkLocked()
}

// checkInvariantsLocked runs checkLocked in -tags invariants builds and
// panics on a violation: the allocator has already been corrupted by the
// operation that just ran.
func (a *Allocator) checkInvariantsLocked() {
	if !invariants {
		return
	}
	if err := a.checkLocked(); err != nil {
		panic(err)
	}
}

func (a *Allocator) checkLocked() error {
	const maxErrs = 8
	var errs []error
	bad := func(format string, args ...any) {
		if len(errs) < maxErrs {
			errs = append(errs, fmt.Errorf("segment: check: "+format+": %w", append(args, ErrCorrupt)...))
		}
	}
	if nOff, nLen := a.mu.byOff.Len(), a.mu.byLen.Len(); nOff != nLen {
		bad("%d ranges by offset, %d by length", nOff, nLen)
	}
	var sum uint64
	var prev Range
	var perClass [64]int
	first := true
	a.mu.byOff.Ascend(func(r Range) bool {
		if r.Len > 0 {
			perClass[classOf(r.Len)]++
		}
		switch {
		case r.Len == 0 || r.Off%Granule != 0 || r.Len%Granule != 0:
			bad("free %v empty or unaligned", r)
		case r.Len > a.size || r.Off > a.size-r.Len:
			bad("free %v beyond size %d B", r, a.size)
		}
		if !first {
			switch {
			case prev.End() > r.Off:
				bad("free %v overlaps free %v", prev, r)
			case prev.End() == r.Off:
				bad("free %v and %v not coalesced", prev, r)
			}
		}
		if !a.mu.byLen.Has(r) {
			bad("free %v missing from length index", r)
		}
		sum += r.Len
		prev, first = r, false
		return true
	})
	a.mu.byLen.Ascend(func(r Range) bool {
		if f, ok := a.mu.byOff.Get(r); !ok || f != r {
			bad("free %v missing from offset index", r)
		}
		return true
	})
	if sum != a.mu.free {
		bad("free ranges sum to %d B, counter says %d B", sum, a.mu.free)
	}
	if a.mu.used+a.mu.free != a.size {
		bad("used %d B + free %d B != size %d B", a.mu.used, a.mu.free, a.size)
	}
	classes := a.classes.Load()
	for c, n := range perClass {
		if n != a.mu.perClass[c] || (n > 0) != (classes&(1<<c) != 0) {
			bad("class %d: %d free ranges, counted %d, bit %t", c, n, a.mu.perClass[c], classes&(1<<c) != 0)
		}
	}
	return errors.Join(errs...)
}
