package segment

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
)

func newTable(t testing.TB, sizes ...uint64) *Table {
	t.Helper()
	tb := NewTable()
	for i, n := range sizes {
		if err := tb.Add(NewSegment(ID(i+1), make([]byte, n))); err != nil {
			t.Fatal(err)
		}
	}
	return tb
}

func checkTable(t *testing.T, tb *Table) {
	t.Helper()
	for _, s := range tb.Segments() {
		if err := s.Alloc.Check(); err != nil {
			t.Fatalf("seg%d: %v", s.ID, err)
		}
	}
}

func TestTableAdd(t *testing.T) {
	tb := NewTable()
	s1 := NewSegment(1, make([]byte, pg(2)))
	for _, tc := range []struct {
		s    *Segment
		want error
	}{
		{s1, nil},
		{NewSegment(2, nil), nil},
		{NewSegment(1, make([]byte, pg(1))), ErrDuplicateSegment},
		{nil, ErrInvalidSegment},
		{&Segment{ID: 3, Mem: make([]byte, pg(1))}, ErrInvalidSegment},
		{&Segment{ID: 4, Mem: make([]byte, pg(1)), Alloc: NewAllocator(pg(2))}, ErrInvalidSegment},
	} {
		if err := tb.Add(tc.s); !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("Add(%+v): %v, want %v", tc.s, err, tc.want)
		}
	}
	if s, ok := tb.Get(1); !ok || s != s1 {
		t.Errorf("Get(1) = %v, %v", s, ok)
	}
	if _, ok := tb.Get(3); ok {
		t.Errorf("Get(3) found a segment that failed to add")
	}
	segs := tb.Segments()
	if len(segs) != 2 || segs[0].ID != 1 || segs[1].ID != 2 {
		t.Fatalf("Segments() = %v", segs)
	}
	segs[0] = nil // the caller owns the slice
	if tb.Segments()[0] != s1 {
		t.Fatal("Segments() shares its slice with the table")
	}
}

func TestTableAlloc(t *testing.T) {
	for _, tc := range []struct {
		name  string
		sizes []uint64 // segment sizes in granules
		used  [][]Range
		n     uint64
		want  []Extent
	}{
		{"best fit segment", []uint64{8, 4, 6}, nil, pg(4), []Extent{{2, 0, pg(4)}}},
		{"best fit hole", []uint64{8, 8}, [][]Range{{pr(0, 6)}, {pr(0, 3)}}, pg(2), []Extent{{1, pg(6), pg(2)}}},
		{"tie goes to first added", []uint64{4, 4}, nil, pg(1), []Extent{{1, 0, pg(1)}}},
		// An exact fit is taken where it is seen: the first segment that
		// has one, not a later one with one too or a larger first range.
		{"first exact fit", []uint64{8, 8, 8}, [][]Range{{pr(0, 6)}, {pr(0, 6)}, {pr(0, 6)}}, pg(2), []Extent{{1, pg(6), pg(2)}}},
		{"exact fit after a larger one", []uint64{8, 8, 8}, [][]Range{{pr(0, 5)}, {pr(0, 6)}, {pr(0, 6)}}, pg(2), []Extent{{2, pg(6), pg(2)}}},
		// The last segment's fit is taken in the look when it beats every
		// earlier one, and not when an earlier one fits better or as well.
		{"last segment fits best", []uint64{8, 8}, [][]Range{{pr(0, 4)}, {pr(0, 5)}}, pg(2), []Extent{{2, pg(5), pg(2)}}},
		{"earlier segment fits better", []uint64{8, 8}, [][]Range{{pr(0, 5)}, {pr(0, 4)}}, pg(2), []Extent{{1, pg(5), pg(2)}}},
		{"last segment ties", []uint64{8, 8}, [][]Range{{pr(0, 5)}, {pr(0, 5)}}, pg(2), []Extent{{1, pg(5), pg(2)}}},
		{"fill most free first", []uint64{4, 8, 6}, nil, pg(12), []Extent{{2, 0, pg(8)}, {3, 0, pg(4)}}},
		{"fill splits within segments", []uint64{8, 8}, [][]Range{{pr(2, 1), pr(5, 1)}, {pr(4, 1)}},
			// seg2 has 7 granules free in [0,4) [5,8), seg1 6 in [0,2) [3,5) [6,8).
			// Within a segment: largest first, ties by highest offset.
			pg(12), []Extent{{2, 0, pg(4)}, {2, pg(5), pg(3)}, {1, pg(6), pg(2)}, {1, pg(3), pg(2)}, {1, 0, pg(1)}}},
		{"everything", []uint64{2, 3}, nil, pg(5), []Extent{{2, 0, pg(3)}, {1, 0, pg(2)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tb := NewTable()
			for i, size := range tc.sizes {
				s := NewSegment(ID(i+1), make([]byte, pg(size)))
				if err := tb.Add(s); err != nil {
					t.Fatal(err)
				}
				if i < len(tc.used) {
					// Allocate exactly the ranges in used.
					if _, err := s.Alloc.Alloc(pg(size)); err != nil {
						t.Fatal(err)
					}
					prev := uint64(0)
					for _, u := range append(tc.used[i], pr(size, 0)) {
						if u.Off > prev {
							if err := s.Alloc.Free(Range{Off: prev, Len: u.Off - prev}); err != nil {
								t.Fatal(err)
							}
						}
						prev = u.End()
					}
				}
			}
			got, err := tb.Alloc(tc.n)
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("Alloc(%d): %v, %v; want %v", tc.n, got, err, tc.want)
			}
			if TotalLen(got) != tc.n {
				t.Fatalf("total %d, want %d", TotalLen(got), tc.n)
			}
			checkTable(t, tb)
		})
	}
}

func TestTableAllocNoSpace(t *testing.T) {
	tb := newTable(t, pg(4), pg(4), pg(2))
	if _, err := tb.Alloc(pg(3)); err != nil {
		t.Fatal(err)
	}
	before := tb.Stats()
	for _, n := range []uint64{pg(7) + 1, pg(8), ^uint64(0)} {
		if es, err := tb.Alloc(n); !errors.Is(err, ErrNoSpace) || es != nil {
			t.Errorf("Alloc(%d): %v, %v; want ErrNoSpace", n, es, err)
		}
	}
	if after := tb.Stats(); after != before {
		t.Errorf("stats %+v -> %+v", before, after)
	}
	if es, err := tb.Alloc(pg(7)); err != nil || TotalLen(es) != pg(7) {
		t.Errorf("Alloc all free: %v, %v", es, err)
	}
	if es, err := NewTable().Alloc(1); !errors.Is(err, ErrNoSpace) {
		t.Errorf("empty table: %v, %v", es, err)
	}
	checkTable(t, tb)
}

// TestTableAllocTo checks that AllocTo lays the extents in the caller's
// array when it holds them and grows past it when not.
func TestTableAllocTo(t *testing.T) {
	tb := newTable(t, pg(4), pg(4))
	var room [1]Extent
	old := Extent{Segment: 9, Off: 1, Len: 2}
	es, err := tb.AllocTo([]Extent{old}[:1:1], pg(1)) // a used dst: cut to [:0]
	if err != nil || len(es) != 1 || es[0].Len != pg(1) {
		t.Fatalf("AllocTo(used dst): %v, %v", es, err)
	}
	es, err = tb.AllocTo(room[:0], pg(2))
	if err != nil || len(es) != 1 || &es[0] != &room[0] || room[0].Len != pg(2) {
		t.Fatalf("AllocTo(room): %v, %v; room %v", es, err, room)
	}
	// 5 pages free, 3 in one segment and 2 in the other: two extents,
	// more than room holds.
	room2 := [1]Extent{old}
	es, err = tb.AllocTo(room2[:0], pg(5))
	if err != nil || len(es) != 2 || TotalLen(es) != pg(5) {
		t.Fatalf("AllocTo(5 pages over 2 segments): %v, %v", es, err)
	}
	if es, err := tb.AllocTo(room2[:0], pg(1)); !errors.Is(err, ErrNoSpace) || es != nil {
		t.Errorf("AllocTo(full): %v, %v", es, err)
	}
	if es, err := tb.AllocTo(room2[:0], 0); err != nil || len(es) != 0 {
		t.Errorf("AllocTo(0): %v, %v", es, err)
	}
	checkTable(t, tb)
}

// TestTableAllocRollback drives fill with a stale view of free space, as
// when concurrent allocations take space between counting and allocating:
// everything fill took must be freed again.
func TestTableAllocRollback(t *testing.T) {
	tb := newTable(t, pg(4), pg(4), pg(4))
	segs := tb.Segments()
	// Someone takes most of seg3 after Alloc counted it as free.
	if _, err := segs[2].Alloc.Alloc(pg(3)); err != nil {
		t.Fatal(err)
	}
	before := tb.Stats()
	order := []segFree{{segs[0], pg(4)}, {segs[1], pg(4)}, {segs[2], pg(4)}}
	es, err := tb.fill(nil, order, pg(12), pg(10))
	if !errors.Is(err, ErrNoSpace) || es != nil {
		t.Fatalf("fill: %v, %v; want ErrNoSpace", es, err)
	}
	if after := tb.Stats(); after != before {
		t.Fatalf("rollback left stats %+v, want %+v", after, before)
	}
	for _, s := range segs[:2] {
		if got := s.Alloc.FreeRanges(); !reflect.DeepEqual(got, []Range{pr(0, 4)}) {
			t.Errorf("seg%d free ranges %v after rollback", s.ID, got)
		}
	}
	checkTable(t, tb)
}

func TestTableFreeErrors(t *testing.T) {
	tb := newTable(t, pg(4), pg(4))
	es, err := tb.Alloc(pg(6))
	if err != nil {
		t.Fatal(err)
	}
	bad := []Extent{{9, 0, Granule}, {1, 1, Granule}, {2, pg(4), Granule}}
	err = tb.Free(append(append([]Extent{bad[0]}, es...), bad[1:]...))
	for _, want := range []error{ErrUnknownSegment, ErrBadRange} {
		if !errors.Is(err, want) {
			t.Errorf("Free: %v; want it to wrap %v", err, want)
		}
	}
	if n := len(err.(interface{ Unwrap() []error }).Unwrap()); n != len(bad) {
		t.Errorf("Free joined %d errors, want %d: %v", n, len(bad), err)
	}
	// The good extents were freed despite the bad ones around them.
	if st := tb.Stats(); st.Used != 0 || st.FreeRanges != 2 {
		t.Errorf("stats after free %+v", st)
	}
	if err := tb.Free(nil); err != nil {
		t.Errorf("Free(nil): %v", err)
	}
	checkTable(t, tb)
}

func TestTableBytes(t *testing.T) {
	tb := newTable(t, pg(2), pg(3)+10)
	for _, tc := range []struct {
		e    Extent
		len  int
		want error
	}{
		{Extent{1, 0, pg(2)}, int(pg(2)), nil},
		{Extent{2, pg(3), 10}, 10, nil},
		{Extent{2, pg(3), 11}, 0, ErrBadRange},
		{Extent{1, pg(2), Granule}, 0, ErrBadRange},
		{Extent{3, 0, Granule}, 0, ErrUnknownSegment},
	} {
		b, err := tb.Bytes(tc.e)
		if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) || len(b) != tc.len {
			t.Errorf("Bytes(%v): len %d, %v; want len %d, %v", tc.e, len(b), err, tc.len, tc.want)
		}
	}
}

func TestTableStats(t *testing.T) {
	tb := newTable(t, pg(8), pg(4))
	a1, _ := tb.Get(1)
	if _, err := a1.Alloc.AllocContiguous(pg(2)); err != nil {
		t.Fatal(err)
	}
	if err := a1.Alloc.Free(pr(0, 1)); err != nil {
		t.Fatal(err)
	}
	// seg1: free [0,1) [2,8); seg2: free [0,4). Fragmentation is the
	// free-weighted mean of the segments' (seg2 has none).
	want := Stats{Size: pg(12), Used: pg(1), Free: pg(11), LargestFree: pg(6), FreeRanges: 3,
		Fragmentation: fragmentation(pg(6), pg(7)) * float64(pg(7)) / float64(pg(11))}
	if got := tb.Stats(); got != want {
		t.Fatalf("%+v, want %+v", got, want)
	}
	if got := NewTable().Stats(); got != (Stats{}) {
		t.Fatalf("empty table: %+v", got)
	}
	// The lock-free figures agree with Stats when nothing runs.
	if tb.Size() != want.Size || tb.Used() != want.Used {
		t.Fatalf("Size %d Used %d, want %d %d", tb.Size(), tb.Used(), want.Size, want.Used)
	}
	ext, err := tb.Alloc(pg(9))
	if err != nil {
		t.Fatal(err)
	}
	if tb.Used() != pg(10) || tb.Stats().Used != pg(10) {
		t.Fatalf("after a split allocation: Used %d, Stats %+v", tb.Used(), tb.Stats())
	}
	if err := tb.Free(ext); err != nil {
		t.Fatal(err)
	}
	if tb.Used() != pg(1) {
		t.Fatalf("after the free: Used %d", tb.Used())
	}
}

// TestTableConcurrent allocates, stamps, verifies and frees through a table
// from many goroutines while the table is nearly full, so that fills race and
// roll back, and adds segments midway to exercise the lock-free lookups.
func TestTableConcurrent(t *testing.T) {
	s := seed(t)
	const workers, iters = 8, 300
	tb := newTable(t, 96<<10, 64<<10, 32<<10)
	var wg sync.WaitGroup
	errc := make(chan error, workers+1)
	wg.Go(func() {
		for id := ID(10); id < 14; id++ {
			if err := tb.Add(NewSegment(id, make([]byte, 16<<10))); err != nil {
				errc <- err
			}
		}
	})
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(s, uint64(w)))
			stamp := byte(w + 1)
			for range iters {
				var es []Extent
				if w%2 == 0 {
					var err error
					es, err = tb.Alloc(uint64(rng.IntN(40<<10) + 1))
					if errors.Is(err, ErrNoSpace) {
						continue
					} else if err != nil {
						errc <- err
						return
					}
				} else {
					// Odd workers allocate batches (AllocMany), some of
					// whose sizes may fail alone.
					n := 1 + rng.IntN(4)
					sizes, dst, errs := make([]uint64, n), make([][]Extent, n), make([]error, n)
					for k := range sizes {
						sizes[k] = uint64(rng.IntN(12<<10) + 1)
					}
					tb.AllocMany(dst, sizes, errs)
					for k, err := range errs {
						if err != nil && !errors.Is(err, ErrNoSpace) {
							errc <- err
							return
						}
						if rn, _ := roundUp(sizes[k]); err == nil && TotalLen(dst[k]) != rn {
							errc <- fmt.Errorf("worker %d: AllocMany(%d) = %v", w, sizes[k], dst[k])
							return
						}
						es = append(es, dst[k]...)
					}
				}
				for _, e := range es {
					b, err := tb.Bytes(e)
					if err != nil {
						errc <- err
						return
					}
					for i := range b {
						b[i] = stamp
					}
				}
				for _, e := range es {
					b, _ := tb.Bytes(e)
					for _, c := range b {
						if c != stamp {
							errc <- fmt.Errorf("worker %d: %v overwritten", w, e)
							return
						}
					}
				}
				if err := tb.Free(es); err != nil {
					errc <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Error(err)
	}
	st := tb.Stats()
	if st.Used != 0 || st.FreeRanges != len(tb.Segments()) || len(tb.Segments()) != 7 {
		t.Errorf("after all frees: %+v over %d segments", st, len(tb.Segments()))
	}
	checkTable(t, tb)
}

func BenchmarkTableAlloc(b *testing.B) {
	for _, n := range []uint64{64 << 10, 4 << 20} {
		b.Run(fmt.Sprintf("segments=4/size=%dKiB", n>>10), func(b *testing.B) {
			tb := newTable(b, 1<<24, 1<<24, 1<<24, 1<<24)
			b.SetBytes(int64(n))
			b.ReportAllocs()
			for b.Loop() {
				es, err := tb.Alloc(n)
				if err != nil {
					b.Fatal(err)
				}
				if err := tb.Free(es); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
		})
	}
}

// BenchmarkTableReplace is a KV cache's steady state: a table of 256 MiB
// segments, the first one a quarter full of 16 KiB values, each
// iteration allocating a new value and freeing a resident one at random
// (ns per iteration).
func BenchmarkTableReplace(b *testing.B) {
	const n, segSize = 16 << 10, 256 << 20
	for _, segs := range []int{1, 4, 64} {
		b.Run(fmt.Sprintf("segments=%d", segs), func(b *testing.B) {
			sizes := make([]uint64, segs)
			for i := range sizes {
				sizes[i] = segSize
			}
			tb := newTable(b, sizes...) // untouched memory: no pages behind it
			held := make([][]Extent, segSize/4/n)
			for i := range held {
				held[i], _ = tb.Alloc(n)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			b.ReportAllocs()
			for b.Loop() {
				i := rng.IntN(len(held))
				es, err := tb.AllocTo(held[i][:0:0], n)
				if err != nil {
					b.Fatal(err)
				}
				if err := tb.Free(held[i]); err != nil {
					b.Fatal(err)
				}
				held[i] = es
			}
		})
	}
}

// segmentSizes returns the sizes of 1 to most segments of 1 to pages
// pages each, at random.
func segmentSizes(rng *rand.Rand, most, pages int) []uint64 {
	var sizes []uint64
	for range 1 + rng.IntN(most) {
		sizes = append(sizes, pg(uint64(1+rng.IntN(pages))))
	}
	return sizes
}

// TestTableBestFitModel allocates and frees at random in tables of
// several segments and checks every contiguous allocation against the
// rule, worked out from each segment's free ranges: the smallest free
// range that holds it, the lowest offset among equals, ties to the
// segment added first. The size classes that let Alloc skip segments
// must never make it miss that range.
func TestTableBestFitModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	for round := range 20 {
		tb := newTable(t, segmentSizes(rng, 6, 300)...)
		var held [][]Extent
		for step := range 400 {
			if len(held) > 0 && rng.IntN(5) < 2 {
				i := rng.IntN(len(held))
				if err := tb.Free(held[i]); err != nil {
					t.Fatal(err)
				}
				held[i] = held[len(held)-1]
				held = held[:len(held)-1]
				continue
			}
			n := pg(uint64(1 + rng.IntN(8)))
			if rng.IntN(10) == 0 {
				n = pg(uint64(1 + rng.IntN(200)))
			}
			var want Extent
			for _, s := range tb.Segments() {
				for _, r := range s.Alloc.FreeRanges() {
					if r.Len >= n && (want.Len == 0 || r.Len < want.Len) {
						want = Extent{Segment: s.ID, Off: r.Off, Len: r.Len}
					}
				}
			}
			got, err := tb.Alloc(n)
			if want.Len == 0 {
				// No one range holds n: filled from several, or none.
				if err == nil {
					held = append(held, got)
				}
				continue
			}
			if err != nil || len(got) != 1 || got[0] != (Extent{Segment: want.Segment, Off: want.Off, Len: n}) {
				t.Fatalf("round %d step %d: Alloc(%d) = %v, %v; best fit is in %v", round, step, n, got, err, want)
			}
			held = append(held, got)
		}
		checkTable(t, tb)
	}
}

// TestTableAllocSeesFitsDuringFrees: segment 1 holds a free range that
// fits every allocation, which frees in another goroutine only grow;
// segment 2 has more free bytes, in single pages. No allocation may miss
// segment 1's range and come back split from segment 2's pages: a free's
// changes to the size classes that Alloc reads without the lock must
// never show a class missing that is there before and after it.
func TestTableAllocSeesFitsDuringFrees(t *testing.T) {
	const n = 2048
	for range 10 {
		tb := newTable(t, pg(n), pg(2*n))
		var seg1, seg2 [][]Extent // every page, allocated one by one
		for range n {
			es, _ := tb.Alloc(Granule)
			seg1 = append(seg1, es)
		}
		for range 2 * n {
			es, _ := tb.Alloc(Granule)
			seg2 = append(seg2, es)
		}
		for i := 1; i < len(seg2); i += 2 {
			if err := tb.Free(seg2[i]); err != nil {
				t.Fatal(err)
			}
		}
		for _, es := range seg1[:8] {
			if err := tb.Free(es); err != nil {
				t.Fatal(err)
			}
		}
		var done atomic.Bool
		freed := make(chan error, 1)
		go func() {
			defer done.Store(true)
			for _, es := range seg1[8:] {
				if err := tb.Free(es); err != nil {
					freed <- err
					return
				}
			}
			freed <- nil
		}()
		for !done.Load() {
			es, err := tb.Alloc(pg(4))
			if err != nil {
				t.Fatal(err)
			}
			if len(es) != 1 || es[0].Segment != 1 {
				t.Fatalf("Alloc(4 pages) = %v while segment 1 held a fit", es)
			}
			if err := tb.Free(es); err != nil {
				t.Fatal(err)
			}
		}
		if err := <-freed; err != nil {
			t.Fatal(err)
		}
		checkTable(t, tb)
	}
}

// TestTableAllocMany checks AllocMany against AllocTo: on a quiet table
// it must allocate exactly what AllocTo one size after the other
// allocates on a twin table (the same extents, the same failures), every
// size its bytes in extents no one else holds. Tables have 1 to 4
// segments, some with more than 64 (the look's scratch on the heap);
// batches mix in sizes of 0 and unroundable ones; frees give back many
// extents of a segment at a time (Free's runs).
func TestTableAllocMany(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 5))
	for round := range 40 {
		sizes := segmentSizes(rng, 4, 400)
		if round%10 == 9 {
			for range 66 {
				sizes = append(sizes, pg(uint64(1+rng.IntN(8))))
			}
		}
		tb, tw := newTable(t, sizes...), newTable(t, sizes...)
		var held, heldTwin [][]Extent
		var used uint64
		for step := range 60 {
			if len(held) > 0 && rng.IntN(3) == 0 {
				// Free a run of held values at once, as Commit does.
				i := rng.IntN(len(held))
				j := min(len(held), i+1+rng.IntN(40))
				var all, allTwin []Extent
				for k := i; k < j; k++ {
					all = append(all, held[k]...)
					used -= TotalLen(held[k])
					allTwin = append(allTwin, heldTwin[k]...)
				}
				if err := tb.Free(all); err != nil {
					t.Fatal(err)
				}
				held = append(held[:i], held[j:]...)
				if err := tw.Free(allTwin); err != nil {
					t.Fatal(err)
				}
				heldTwin = append(heldTwin[:i], heldTwin[j:]...)
				continue
			}
			n := 1 + rng.IntN(100)
			want := make([]uint64, n)
			for k := range want {
				switch r := rng.IntN(40); {
				case r == 0:
					want[k] = 0
				case r == 1:
					want[k] = ^uint64(0) - 5 // rounding overflows
				case r < 5:
					want[k] = pg(uint64(1+rng.IntN(100))) - uint64(rng.IntN(100))
				case r < 25 && k > 0:
					// Runs of one size, as a batch of KV blocks: one look
					// places as many as its best fit holds.
					want[k] = want[k-1] - uint64(rng.IntN(2))
				default:
					want[k] = pg(uint64(1 + rng.IntN(6)))
				}
			}
			dst, errs := make([][]Extent, n), make([]error, n)
			for k := range dst {
				dst[k] = make([]Extent, 0, 1)
			}
			tb.AllocMany(dst, want, errs)
			for k, sz := range want {
				es, err := tw.AllocTo(nil, sz)
				if (err == nil) != (errs[k] == nil) || !reflect.DeepEqual(append([]Extent{}, es...), append([]Extent{}, dst[k]...)) {
					t.Fatalf("round %d step %d size %d: AllocMany %v, %v; AllocTo %v, %v", round, step, sz, dst[k], errs[k], es, err)
				}
				if err == nil && sz > 0 {
					heldTwin = append(heldTwin, es)
				}
				switch {
				case errs[k] != nil:
					if !errors.Is(errs[k], ErrNoSpace) || len(dst[k]) != 0 {
						t.Fatalf("size %d: %v, %v", sz, dst[k], errs[k])
					}
				case sz == 0:
					if len(dst[k]) != 0 {
						t.Fatalf("size 0: %v", dst[k])
					}
				default:
					rn, _ := roundUp(sz)
					if TotalLen(dst[k]) != rn {
						t.Fatalf("size %d: got %v", sz, dst[k])
					}
					held = append(held, dst[k])
					used += rn
				}
			}
			// Overlaps between held extents would show as used bytes that
			// the allocators do not count, or as broken free lists.
			if got := tb.Stats().Used; got != used {
				t.Fatalf("round %d step %d: used %d, held %d", round, step, got, used)
			}
			checkTable(t, tb)
		}
	}
}

// BenchmarkTableAllocMany is the GPU bench's batch puts: batches of 64
// values of 16 KiB into a table of 6, 64 or 256 segments, 16k values
// (256 MiB) held at a time and then freed (ns per value): how a look's
// cost grows with the segments.
func BenchmarkTableAllocMany(b *testing.B) {
	const n, batch, held = 16 << 10, 64, 16 << 10
	for _, segs := range []int{6, 64, 256} {
		b.Run(fmt.Sprintf("segments=%d", segs), func(b *testing.B) {
			sizes := make([]uint64, segs)
			for i := range sizes {
				sizes[i] = 256 << 20
			}
			tb := newTable(b, sizes...) // untouched memory: no pages behind it
			want := make([]uint64, batch)
			for i := range want {
				want[i] = n
			}
			dst, errs := make([][]Extent, batch), make([]error, batch)
			all := make([]Extent, 0, held)
			b.ReportAllocs()
			for b.Loop() {
				for k := range dst {
					dst[k] = dst[k][:0]
				}
				tb.AllocMany(dst, want, errs)
				for k := range dst {
					if errs[k] != nil {
						b.Fatal(errs[k])
					}
					all = append(all, dst[k]...)
				}
				if len(all) >= held {
					if err := tb.Free(all); err != nil {
						b.Fatal(err)
					}
					all = all[:0]
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/value")
		})
	}
}
