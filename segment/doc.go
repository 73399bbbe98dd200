// Package segment allocates space in this node's pinned memory segments.
//
// # Concepts
//
// A Segment is one region of pinned memory (from package pinned; this package
// never maps memory) plus an Allocator over its bytes. A Table holds the
// node's segments by ID. An Extent names a byte range of one segment; an
// object replica is an ordered list of extents.
//
// Allocator hands out granule-aligned (Granule, 4 KiB) ranges of [0, Size).
// Alloc prefers one contiguous range (best fit); when no free range is big
// enough it takes the largest ranges first, so a request succeeds whenever
// enough bytes are free in total. AllocContiguous never splits. Free merges
// the range with its free neighbours and accepts any allocated aligned part
// of an earlier allocation, so a caller may trim a tail. Table.Alloc does the
// same across segments: one extent in the best-fitting segment if possible,
// else it fills the emptiest segments first. Each Allocator publishes,
// without a lock, which size classes (floor log2 of a length) its free
// ranges have, so Table.Alloc skips the segments that cannot beat the fit
// it has found and takes a fit no later segment can beat in the same look;
// a change adds a class before it removes one, so a reader may see a class
// too many, never one missing. Table.AllocMany allocates many sizes in
// order with the choices Table.AllocTo would make one after the other,
// keeping the lock of the allocator it took from last while the next
// sizes fit best there too (a batch of keys takes it about once) and
// starting a look for the size it just placed at the segment it placed
// it in (a batch of equal sizes looks at one segment a size, however
// many the table has), and
// Table.Free frees a run of one segment's extents under one hold.
//
// Allocation is all-or-nothing: on ErrNoSpace nothing stays allocated.
//
// # Ownership
//
// Ranges and extents returned by Alloc belong to the caller until freed.
// Bytes returns slices that alias segment memory; they are valid while the
// table is mounted and must not be used after the extent is freed. The
// package does not track which extents are allocated beyond the free lists,
// so Bytes does not check that an extent is live.
//
// # Locking
//
// Lock order, outermost first:
//
//	Table.mu      (Add only; lookups load an immutable snapshot, lock-free)
//	  Allocator.mu  (one allocator at a time; never two)
//
// No lock in this package is held across a copy into or out of segment
// memory, or across any call out of the package (AllocMany lets go of
// the allocator's lock before it returns). Table.Alloc locks each
// allocator separately, so a multi-segment allocation is not atomic: a
// concurrent Alloc may fail with ErrNoSpace while another one's partial
// allocation is being rolled back.
//
// # Invariants
//
// For each Allocator, checked by Check:
//
//   - the free ranges by offset and by (length, offset) hold the same ranges;
//   - every free range is non-empty, granule-aligned and within [0, Size);
//   - free ranges do not overlap, and no two are adjacent (Free coalesces);
//   - the free ranges add up to Free, and Used+Free == Size;
//   - the per-class counts and the published classes match the free ranges.
//
// Builds with -tags invariants run Check after every Alloc and Free and
// panic on a violation, and a double free panics instead of returning
// ErrDoubleFree. Bad input (unaligned or out-of-bounds ranges, unknown
// segments) always returns an error and never panics.
//
// # Errors
//
// ErrNoSpace, ErrBadRange, ErrDoubleFree, ErrUnknownSegment,
// ErrDuplicateSegment, ErrInvalidSegment and ErrCorrupt are sentinels; the
// errors returned wrap them with the operation and sizes. Test with
// errors.Is.
package segment
