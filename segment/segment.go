package segment

// Segment is one region of pinned memory and the allocator that carves it
// into extents. Mem is owned by whoever pinned it (package pinned) and must
// outlive the segment; the segment never frees or remaps it.
type Segment struct {
	ID    ID
	Mem   []byte
	Alloc *Allocator
}

// NewSegment returns a segment over mem with everything free. The allocator
// covers len(mem) rounded down to Granule; a ragged tail is never handed out.
func NewSegment(id ID, mem []byte) *Segment {
	return &Segment{ID: id, Mem: mem, Alloc: NewAllocator(uint64(len(mem)))}
}

// Bytes returns the memory of e, which must be an extent of this segment.
// The slice aliases s.Mem and its capacity ends at e.End(), so appending to
// it cannot spill into a neighbouring extent. Bytes returns nil if e names
// another segment or does not lie within s.Mem; an in-range empty extent
// gives an empty, non-nil slice. Bytes does not check that e is allocated.
func (s *Segment) Bytes(e Extent) []byte {
	size := uint64(len(s.Mem))
	if e.Segment != s.ID || e.Len > size || e.Off > size-e.Len {
		return nil
	}
	if e.Len == 0 {
		return []byte{}
	}
	return s.Mem[e.Off:e.End():e.End()]
}
