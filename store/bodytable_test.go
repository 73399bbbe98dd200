package store

import (
	"math/rand/v2"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// TestBodyTable adds and drops bodies at random granules of three
// segments against a map, checking every lookup, the count, and that a
// leaf stays only while it holds a body.
func TestBodyTable(t *testing.T) {
	var tb bodyTable
	model := map[segment.Extent]*body{}
	rng := rand.New(rand.NewPCG(1, 2))
	ext := func() segment.Extent {
		// Granules spread over a few leaves, so that leaves empty and
		// come back.
		g := rng.Uint64N(4 * bodyLeafGranules)
		return segment.Extent{Segment: []segment.ID{0, 7, bodyNearSegs + 1}[rng.IntN(3)], Off: g * segment.Granule, Len: segment.Granule}
	}
	for step := range 200000 {
		e := ext()
		switch b := model[e]; {
		case b == nil:
			b = newBody([]segment.Extent{e}, bodyLive, 1)
			tb.add(b)
			model[e] = b
		case rng.IntN(2) == 0:
			tb.drop(b)
			delete(model, e)
		default:
			// Dropping another body of the same first extent changes
			// nothing.
			tb.drop(newBody([]segment.Extent{e}, bodyLive, 1))
		}
		probe := ext()
		if got := tb.get(probe); got != model[probe] {
			t.Fatalf("step %d: get(%v) = %p, want %p", step, probe, got, model[probe])
		}
		if tb.n != len(model) {
			t.Fatalf("step %d: %d bodies counted, %d added", step, tb.n, len(model))
		}
	}
	leaves := map[[2]uint64]int{}
	for e := range model {
		leaves[[2]uint64{uint64(e.Segment), e.Off / segment.Granule / bodyLeafGranules}]++
	}
	segs := map[segment.ID]*bodySeg{}
	for id, sg := range tb.segs {
		if sg != nil {
			segs[segment.ID(id)] = sg
		}
	}
	for id, sg := range tb.far {
		segs[id] = sg
	}
	inUse := 0
	for id, sg := range segs {
		for li, l := range sg.leaves {
			if l != nil {
				inUse++
			}
			want := leaves[[2]uint64{uint64(id), uint64(li)}]
			switch {
			case l == nil && want > 0:
				t.Fatalf("segment %d leaf %d gone with %d bodies", id, li, want)
			case l != nil && l.n != want:
				t.Fatalf("segment %d leaf %d counts %d bodies, has %d", id, li, l.n, want)
			case l != nil && want == 0:
				t.Fatalf("segment %d leaf %d kept empty", id, li)
			}
		}
	}
	if tb.leaves != inUse {
		t.Fatalf("%d leaves counted in use, %d are", tb.leaves, inUse)
	}
	checkSpare(t, &tb)
	for e, b := range model {
		tb.drop(b)
		if tb.get(e) != nil {
			t.Fatalf("%v still found after its drop", e)
		}
	}
	for id, sg := range segs {
		for li, l := range sg.leaves {
			if l != nil {
				t.Fatalf("segment %d leaf %d kept in an empty table", id, li)
			}
		}
	}
	checkSpare(t, &tb)
}

// checkSpare checks tb's spare leaves: empty, and no more than its bound.
func checkSpare(t *testing.T, tb *bodyTable) {
	t.Helper()
	if len(tb.spare) > max(bodySpareLeaves, tb.leaves) {
		t.Fatalf("%d spare leaves with %d in use", len(tb.spare), tb.leaves)
	}
	for i, l := range tb.spare {
		if l.n != 0 || l.b != [bodyLeafGranules]*body{} {
			t.Fatalf("spare leaf %d holds %d bodies", i, l.n)
		}
	}
}

// TestBodyTableSpareLeaves puts and removes bodies of a leaf's size or
// more, a leaf each, as 1 MiB values do: the leaves they leave are kept
// and used again, up to the bound, and never more than were in use.
func TestBodyTableSpareLeaves(t *testing.T) {
	var tb bodyTable
	const n = 4 * bodySpareLeaves
	bodies := make([]*body, n)
	add := func() {
		for i := range bodies {
			bodies[i] = newBody([]segment.Extent{{Segment: 3, Off: uint64(i) * bodyLeafGranules * segment.Granule, Len: bodyLeafGranules * segment.Granule}}, bodyLive, 1)
			tb.add(bodies[i])
		}
	}
	drop := func() {
		for _, b := range bodies {
			tb.drop(b)
			checkSpare(t, &tb)
		}
	}
	add()
	if tb.leaves != n || len(tb.spare) != 0 {
		t.Fatalf("%d leaves in use and %d spare after %d bodies a leaf each", tb.leaves, len(tb.spare), n)
	}
	drop()
	if tb.leaves != 0 || len(tb.spare) != bodySpareLeaves {
		t.Fatalf("%d leaves in use and %d spare after removing all %d; want 0 and %d", tb.leaves, len(tb.spare), n, bodySpareLeaves)
	}
	spare := map[*bodyLeaf]bool{}
	for _, l := range tb.spare {
		spare[l] = true
	}
	add()
	reused := 0
	for _, l := range tb.segs[3].leaves {
		if spare[l] {
			reused++
		}
	}
	if reused != bodySpareLeaves || len(tb.spare) != 0 {
		t.Fatalf("%d spare leaves used again, %d left; want %d and 0", reused, len(tb.spare), bodySpareLeaves)
	}
	// Half the bodies go: as many leaves are kept as stay in use.
	for _, b := range bodies[:n/2] {
		tb.drop(b)
	}
	if tb.leaves != n/2 || len(tb.spare) != n/2 {
		t.Fatalf("%d leaves in use and %d spare after removing half; want %d and %d", tb.leaves, len(tb.spare), n/2, n/2)
	}
	checkSpare(t, &tb)
}
