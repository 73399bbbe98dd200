package segment

import "errors"

// Sentinel errors. Callers test them with errors.Is; the returned errors wrap
// them with the operation and the sizes involved.
var (
	// ErrNoSpace means an allocation could not be satisfied. Nothing was
	// allocated.
	ErrNoSpace = errors.New("segment: no space")
	// ErrBadRange means a range or extent is empty, not granule-aligned, or
	// outside its segment.
	ErrBadRange = errors.New("segment: bad range")
	// ErrDoubleFree means a freed range overlaps space that is already free.
	// In builds with -tags invariants a double free panics instead.
	ErrDoubleFree = errors.New("segment: double free")
	// ErrUnknownSegment means an extent names a segment that is not in the
	// table.
	ErrUnknownSegment = errors.New("segment: unknown segment")
	// ErrDuplicateSegment means a segment with the same ID is already in the
	// table.
	ErrDuplicateSegment = errors.New("segment: duplicate segment")
	// ErrInvalidSegment means a segment passed to Table.Add is nil, has no
	// allocator, or its allocator covers more bytes than its memory.
	ErrInvalidSegment = errors.New("segment: invalid segment")
)

// ErrCorrupt is wrapped by the errors Allocator.Check returns: the free-space
// trees disagree with each other or with the byte counters.
var ErrCorrupt = errors.New("segment: corrupt allocator")
