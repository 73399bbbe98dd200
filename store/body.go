package store

import (
	"sync/atomic"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// body is the local replica of one committed version's bytes. Its extents
// are immutable while anyone holds it. A body is freed once it is retired
// (no longer the current version of its key) and its last holder released
// it.
type body struct {
	id      segment.Extent // first extent: unique among live allocations
	extents []segment.Extent
	starts  []uint64 // starts[i] = object offset of extents[i]
	size    uint64
	refs    atomic.Int64
	// guarded by Store.mu
	retired bool
	freed   bool
}

func newBody(ext []segment.Extent, size uint64) *body {
	b := &body{extents: ext, size: size}
	if len(ext) > 0 {
		b.id = ext[0]
	}
	b.starts = extentStarts(ext)
	return b
}

func extentStarts(ext []segment.Extent) []uint64 {
	starts := make([]uint64, len(ext))
	var off uint64
	for i, e := range ext {
		starts[i] = off
		off += e.Len
	}
	return starts
}

// span calls fn for each piece of [off, off+n) of an extent list, with the
// sub-extent and the offset of the piece relative to off.
func span(ext []segment.Extent, starts []uint64, off, n uint64, fn func(e segment.Extent, rel uint64) bool) {
	spanIdx(ext, starts, off, n, func(_ int, e segment.Extent, rel uint64) bool { return fn(e, rel) })
}

// spanIdx is span that also passes the index in ext of each piece's extent.
func spanIdx(ext []segment.Extent, starts []uint64, off, n uint64, fn func(i int, e segment.Extent, rel uint64) bool) {
	if n == 0 || len(ext) == 0 {
		return
	}
	// Binary search for the extent holding off.
	lo, hi := 0, len(starts)
	for lo+1 < hi {
		mid := (lo + hi) / 2
		if starts[mid] <= off {
			lo = mid
		} else {
			hi = mid
		}
	}
	var rel uint64
	for i := lo; i < len(ext) && rel < n; i++ {
		e := ext[i]
		skip := uint64(0)
		if off+rel > starts[i] {
			skip = off + rel - starts[i]
		}
		if skip >= e.Len {
			continue
		}
		take := min(e.Len-skip, n-rel)
		if !fn(i, segment.Extent{Segment: e.Segment, Off: e.Off + skip, Len: take}, rel) {
			return
		}
		rel += take
	}
}
