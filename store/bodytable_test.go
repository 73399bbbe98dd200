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
	for id, sg := range segs {
		for li, l := range sg.leaves {
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
}
