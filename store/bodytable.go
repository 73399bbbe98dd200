package store

import "github.com/mooncake-fs/mooncake-fs/segment"

// bodyTable finds the local body by its first extent (Store.mu.bodies):
// per segment, a slice of leaves, each holding the bodies of
// bodyLeafGranules granules in a row by the granule their first extent
// starts at. A batch put registers bodies in neighbouring extents
// (Table.AllocMany places runs together), which share a leaf and its
// cache lines; a hash map spread them over a line each, each a miss
// under Store.mu (a quarter of a microsecond a key of a 16 KiB put on the
// H100 host, 2026-12-06). A leaf leaves its segment with its last body
// (kept spare for the next, see spare), so the table holds at most a
// pointer per granule of the megabytes that have bodies, twice, and a
// pointer per megabyte of a segment up to its last body.
// No two bodies share a first granule: their extents are allocated, and
// allocations do not overlap. Its user holds Store.mu.
type bodyTable struct {
	segs []*bodySeg              // by segment ID, below bodyNearSegs
	far  map[segment.ID]*bodySeg // the others
	n    int                     // bodies in the table
	// spare is leaves that lost their last body, kept (empty) for the
	// next: where bodies are a leaf's size or more (values of 128 KiB
	// and more), every put would make one and every removal drop one, a
	// leaf of the heap and the collector's work a key. It keeps at most as many as are
	// in use, or bodySpareLeaves when more: the leaves of a table never
	// weigh more than twice those in use, or 512 KiB more.
	spare  []*bodyLeaf
	leaves int // leaves in use
}

// bodySpareLeaves is the spare leaves kept even when few are in use: 512
// KiB.
const bodySpareLeaves = 2048

// bodyNearSegs bounds the segment IDs found by index: a daemon numbers
// its segments from 0, one a GiB.
const bodyNearSegs = 4096

// bodyLeafGranules is the granules of a leaf: 256 B of pointers for 128
// KiB of a segment. Leaves exist only where bodies start, so a store of 1
// MiB values keeps one a value: 256 B of heap (2 KiB with leaves of 1
// MiB: 1.9 KiB a key less in BenchmarkBatchPutGrow/1024KiB), while the
// bodies of a batch of small values still share a leaf's lines.
const bodyLeafGranules = 32

type bodySeg struct {
	leaves []*bodyLeaf
}

// bodyLeaf's count comes first, in the line of its first bodies': a body
// of a leaf's size or more (a 1 MiB value) is its leaf's only one, at the
// leaf's start, and adding or dropping it touches one line, not two.
type bodyLeaf struct {
	n int // bodies in b
	b [bodyLeafGranules]*body
}

// leaf returns the leaf of first's granule, its index in its segment's
// leaves and the granule's index in it; with grow, it makes the leaf
// when there is none, else it returns a nil leaf.
func (t *bodyTable) leaf(first segment.Extent, grow bool) (*bodySeg, *bodyLeaf, uint64, int) {
	id := first.Segment
	var sg *bodySeg
	if id < bodyNearSegs {
		if int(id) < len(t.segs) {
			sg = t.segs[id]
		}
	} else {
		sg = t.far[id]
	}
	if sg == nil {
		if !grow {
			return nil, nil, 0, 0
		}
		sg = new(bodySeg)
		switch {
		case id >= bodyNearSegs && t.far == nil:
			t.far = map[segment.ID]*bodySeg{id: sg}
		case id >= bodyNearSegs:
			t.far[id] = sg
		default:
			if int(id) >= len(t.segs) {
				t.segs = append(t.segs, make([]*bodySeg, int(id)+1-len(t.segs))...)
			}
			t.segs[id] = sg
		}
	}
	g := first.Off / segment.Granule
	li, bi := g/bodyLeafGranules, int(g%bodyLeafGranules)
	if li >= uint64(len(sg.leaves)) {
		if !grow {
			return sg, nil, li, bi
		}
		sg.leaves = append(sg.leaves, make([]*bodyLeaf, li+1-uint64(len(sg.leaves)))...)
	}
	l := sg.leaves[li]
	if l == nil && grow {
		if n := len(t.spare); n > 0 {
			l, t.spare[n-1] = t.spare[n-1], nil
			t.spare = t.spare[:n-1]
		} else {
			l = new(bodyLeaf)
		}
		sg.leaves[li] = l
		t.leaves++
	}
	return sg, l, li, bi
}

// get returns the body whose first extent starts where first does, nil
// if none.
func (t *bodyTable) get(first segment.Extent) *body {
	if _, l, _, i := t.leaf(first, false); l != nil {
		return l.b[i]
	}
	return nil
}

// add records b, in place of the body that starts at its first granule,
// if any (none does: addBodyLocked).
func (t *bodyTable) add(b *body) {
	_, l, _, i := t.leaf(b.id, true)
	if l.b[i] == nil {
		l.n++
		t.n++
	}
	l.b[i] = b
}

// drop forgets b, if the table has it, and its leaf with its last body.
func (t *bodyTable) drop(b *body) {
	sg, l, li, i := t.leaf(b.id, false)
	if l == nil || l.b[i] != b {
		return
	}
	l.b[i] = nil
	l.n--
	t.n--
	if l.n == 0 {
		sg.leaves[li] = nil
		t.leaves--
		switch keep := max(bodySpareLeaves, t.leaves); {
		case len(t.spare) < keep:
			t.spare = append(t.spare, l)
		case len(t.spare) > keep:
			// One over, with one fewer in use: the collector's.
			t.spare[len(t.spare)-1] = nil
			t.spare = t.spare[:len(t.spare)-1]
		}
	}
}
