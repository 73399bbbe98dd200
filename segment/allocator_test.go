package segment

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"
)

var seedFlag = flag.Uint64("seed", 0, "seed for randomized tests (0: time-based)")

// pg returns n granules in bytes.
func pg(n uint64) uint64 { return n * Granule }

// pr returns the range of granules [off, off+n).
func pr(off, n uint64) Range { return Range{Off: pg(off), Len: pg(n)} }

// allocatorWithFree returns an allocator of size granules, fully allocated
// except for free, which it frees.
func allocatorWithFree(t *testing.T, size uint64, free ...Range) *Allocator {
	t.Helper()
	a := NewAllocator(pg(size))
	if _, err := a.Alloc(pg(size)); err != nil {
		t.Fatal(err)
	}
	for _, r := range free {
		if err := a.Free(r); err != nil {
			t.Fatalf("setup free %v: %v", r, err)
		}
	}
	return a
}

func mustCheck(t *testing.T, a *Allocator) {
	t.Helper()
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
}

func TestFreeCoalesce(t *testing.T) {
	for _, tc := range []struct {
		name string
		free []Range // free before
		r    Range
		want []Range // free after
	}{
		{"no neighbours", nil, pr(3, 2), []Range{pr(3, 2)}},
		{"gaps both sides", []Range{pr(0, 1), pr(7, 1)}, pr(3, 2), []Range{pr(0, 1), pr(3, 2), pr(7, 1)}},
		{"prev adjacent", []Range{pr(1, 2)}, pr(3, 2), []Range{pr(1, 4)}},
		{"next adjacent", []Range{pr(5, 2)}, pr(3, 2), []Range{pr(3, 4)}},
		{"both adjacent", []Range{pr(1, 2), pr(5, 1)}, pr(3, 2), []Range{pr(1, 5)}},
		{"prev adjacent next gap", []Range{pr(1, 2), pr(6, 1)}, pr(3, 2), []Range{pr(1, 4), pr(6, 1)}},
		{"prev gap next adjacent", []Range{pr(0, 2), pr(5, 1)}, pr(3, 2), []Range{pr(0, 2), pr(3, 3)}},
		{"at start", []Range{pr(1, 1)}, pr(0, 1), []Range{pr(0, 2)}},
		{"at end", []Range{pr(6, 1)}, pr(7, 1), []Range{pr(6, 2)}},
		{"fills the only hole", []Range{pr(0, 3), pr(4, 4)}, pr(3, 1), []Range{pr(0, 8)}},
		{"whole space", nil, pr(0, 8), []Range{pr(0, 8)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := allocatorWithFree(t, 8, tc.free...)
			if err := a.Free(tc.r); err != nil {
				t.Fatal(err)
			}
			if got := a.FreeRanges(); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("free ranges %v, want %v", got, tc.want)
			}
			mustCheck(t, a)
		})
	}
}

// TestFreePart frees pieces of one allocation: head, middle, tail.
func TestFreePart(t *testing.T) {
	a := NewAllocator(pg(8))
	rs, err := a.Alloc(pg(8))
	if err != nil || len(rs) != 1 {
		t.Fatalf("alloc: %v %v", rs, err)
	}
	for _, step := range []struct {
		r    Range
		want []Range
	}{
		{pr(7, 1), []Range{pr(7, 1)}},                     // trim the tail
		{pr(0, 2), []Range{pr(0, 2), pr(7, 1)}},           // the head
		{pr(3, 2), []Range{pr(0, 2), pr(3, 2), pr(7, 1)}}, // the middle
		{pr(5, 2), []Range{pr(0, 2), pr(3, 5)}},
		{pr(2, 1), []Range{pr(0, 8)}},
	} {
		if err := a.Free(step.r); err != nil {
			t.Fatalf("free %v: %v", step.r, err)
		}
		if got := a.FreeRanges(); !reflect.DeepEqual(got, step.want) {
			t.Fatalf("after free %v: free ranges %v, want %v", step.r, got, step.want)
		}
		mustCheck(t, a)
	}
}

func TestAllocBestFit(t *testing.T) {
	// Holes of 3, 1, 2 and 2 granules.
	a := allocatorWithFree(t, 16, pr(0, 3), pr(4, 1), pr(6, 2), pr(10, 2))
	for _, step := range []struct {
		n    uint64
		want Range
	}{
		{1, pr(4, 1)},         // the exact 1-granule hole, not a split
		{pg(2), pr(6, 2)},     // two exact fits: the lower offset
		{pg(1), pr(10, 1)},    // no exact fit: split the smallest that holds it
		{pg(2) + 1, pr(0, 3)}, // rounds up to 3 granules
		{pg(1), pr(11, 1)},    // the last granule
	} {
		rs, err := a.Alloc(step.n)
		if err != nil || !reflect.DeepEqual(rs, []Range{step.want}) {
			t.Fatalf("alloc %d B: %v, %v; want [%v]", step.n, rs, err, step.want)
		}
		mustCheck(t, a)
	}
	if st := a.Stats(); st.Free != 0 {
		t.Fatalf("free %d B, want 0", st.Free)
	}
}

func TestAllocContiguous(t *testing.T) {
	a := allocatorWithFree(t, 16, pr(0, 3), pr(4, 1), pr(8, 2))
	if r, err := a.AllocContiguous(0); err != nil || r != (Range{}) {
		t.Fatalf("alloc 0: %v %v", r, err)
	}
	if r, err := a.AllocContiguous(pg(2)); err != nil || r != pr(8, 2) {
		t.Fatalf("alloc 2 granules: %v %v, want %v", r, err, pr(8, 2))
	}
	before := a.Stats()
	if _, err := a.AllocContiguous(pg(4)); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("alloc 4 granules with 4 free in pieces: %v, want ErrNoSpace", err)
	}
	if after := a.Stats(); after != before {
		t.Fatalf("failed alloc changed stats: %+v -> %+v", before, after)
	}
	mustCheck(t, a)
}

// TestAllocMultiRange allocates more than the largest free range: the
// largest ranges go first and whole, the last is split.
func TestAllocMultiRange(t *testing.T) {
	a := allocatorWithFree(t, 32, pr(0, 2), pr(4, 5), pr(12, 3), pr(20, 1), pr(24, 8))
	st := a.Stats()
	if st.LargestFree != pg(8) || st.Free != pg(19) || st.FreeRanges != 5 {
		t.Fatalf("setup stats %+v", st)
	}
	rs, err := a.Alloc(pg(15))
	if err != nil {
		t.Fatal(err)
	}
	want := []Range{pr(24, 8), pr(4, 5), pr(12, 2)}
	if !reflect.DeepEqual(rs, want) {
		t.Fatalf("alloc 15 granules: %v, want %v", rs, want)
	}
	if got, want := a.FreeRanges(), []Range{pr(0, 2), pr(14, 1), pr(20, 1)}; !reflect.DeepEqual(got, want) {
		t.Fatalf("free ranges %v, want %v", got, want)
	}
	// All that is left, in three pieces.
	rs, err = a.Alloc(pg(4))
	if err != nil || len(rs) != 3 {
		t.Fatalf("alloc the rest: %v %v", rs, err)
	}
	if st := a.Stats(); st.Free != 0 || st.Used != pg(32) {
		t.Fatalf("stats %+v, want all used", st)
	}
	mustCheck(t, a)
}

func TestAllocNoSpaceChangesNothing(t *testing.T) {
	a := allocatorWithFree(t, 16, pr(1, 2), pr(5, 3), pr(12, 1))
	before, beforeRanges := a.Stats(), a.FreeRanges()
	for _, n := range []uint64{pg(6) + 1, pg(7), pg(17), 1 << 62, ^uint64(0)} {
		rs, err := a.Alloc(n)
		if !errors.Is(err, ErrNoSpace) || rs != nil {
			t.Errorf("alloc %d B: %v, %v; want ErrNoSpace", n, rs, err)
		}
		if _, err := a.AllocContiguous(n); !errors.Is(err, ErrNoSpace) {
			t.Errorf("alloc contiguous %d B: %v; want ErrNoSpace", n, err)
		}
	}
	if after := a.Stats(); after != before {
		t.Errorf("stats %+v -> %+v", before, after)
	}
	if after := a.FreeRanges(); !reflect.DeepEqual(after, beforeRanges) {
		t.Errorf("free ranges %v -> %v", beforeRanges, after)
	}
	// Exactly what is free still works.
	if rs, err := a.Alloc(pg(6)); err != nil || len(rs) != 3 {
		t.Errorf("alloc all free: %v %v", rs, err)
	}
	mustCheck(t, a)
}

func TestFreeBadRange(t *testing.T) {
	a := allocatorWithFree(t, 8, pr(2, 1))
	before := a.Stats()
	for _, r := range []Range{
		{},
		{Off: 0, Len: 1},
		{Off: 1, Len: Granule},
		{Off: Granule, Len: Granule + 1},
		pr(8, 1),
		pr(7, 2),
		pr(0, 9),
		{Off: ^uint64(0) &^ (Granule - 1), Len: pg(2)}, // Off+Len overflows
		{Off: Granule, Len: ^uint64(0) &^ (Granule - 1)},
	} {
		if err := a.Free(r); !errors.Is(err, ErrBadRange) {
			t.Errorf("free %v: %v, want ErrBadRange", r, err)
		}
	}
	if after := a.Stats(); after != before {
		t.Errorf("stats %+v -> %+v", before, after)
	}
	mustCheck(t, a)
}

func TestStats(t *testing.T) {
	a := NewAllocator(pg(10) + 123)
	if got, want := a.Stats(), (Stats{Size: pg(10), Free: pg(10), LargestFree: pg(10), FreeRanges: 1}); got != want {
		t.Fatalf("new: %+v, want %+v", got, want)
	}
	a = allocatorWithFree(t, 10, pr(0, 1), pr(4, 3))
	want := Stats{Size: pg(10), Used: pg(6), Free: pg(4), LargestFree: pg(3), FreeRanges: 2, Fragmentation: 0.25}
	if got := a.Stats(); got != want {
		t.Fatalf("%+v, want %+v", got, want)
	}
	if got := NewAllocator(Granule - 1).Stats(); got != (Stats{}) {
		t.Fatalf("empty: %+v", got)
	}
}

func TestCheckFindsCorruption(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(a *Allocator)
	}{
		{"uncoalesced", func(a *Allocator) {
			a.deleteLocked(pr(0, 4))
			a.insertLocked(pr(0, 2))
			a.insertLocked(pr(2, 2))
		}},
		{"overlap", func(a *Allocator) { a.insertLocked(pr(1, 2)) }},
		{"index mismatch", func(a *Allocator) { a.mu.byLen.ReplaceOrInsert(pr(6, 1)) }},
		{"counter", func(a *Allocator) { a.mu.free -= Granule }},
		{"unaligned", func(a *Allocator) { a.insertLocked(Range{Off: pg(6), Len: 100}) }},
		{"out of bounds", func(a *Allocator) { a.insertLocked(pr(9, 1)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := allocatorWithFree(t, 8, pr(0, 4))
			mustCheck(t, a)
			a.mu.Lock()
			tc.corrupt(a)
			a.mu.Unlock()
			if err := a.Check(); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Check: %v, want ErrCorrupt", err)
			}
		})
	}
}

// seed returns the seed for a randomized test and logs it if the test fails.
func seed(t *testing.T) uint64 {
	s := *seedFlag
	if s == 0 {
		s = uint64(time.Now().UnixNano())
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("seed %d (rerun with -seed %d)", s, s)
		}
	})
	return s
}

// pageModel is the reference the randomized test compares the allocator
// against: one bool per granule.
type pageModel []bool // true: allocated

// runs returns the free runs in offset order.
func (m pageModel) runs() []Range {
	var out []Range
	for i := 0; i < len(m); {
		if m[i] {
			i++
			continue
		}
		j := i
		for j < len(m) && !m[j] {
			j++
		}
		out = append(out, pr(uint64(i), uint64(j-i)))
		i = j
	}
	return out
}

func (m pageModel) set(r Range, used bool) error {
	for p := r.Off / Granule; p < r.End()/Granule; p++ {
		if m[p] == used {
			return fmt.Errorf("granule %d already used=%v", p, used)
		}
		m[p] = used
	}
	return nil
}

// expectAlloc returns what Alloc(n) should return given the free runs: the
// best fit (smallest, then lowest offset), else the largest runs first (ties:
// highest offset first, the order a descending (len, off) walk gives).
func expectAlloc(runs []Range, n uint64, contiguous bool) ([]Range, bool) {
	var best Range
	for _, r := range runs {
		if r.Len >= n && (best.Len == 0 || r.Len < best.Len) {
			best = r
		}
	}
	if best.Len > 0 {
		return []Range{{Off: best.Off, Len: n}}, true
	}
	var free uint64
	for _, r := range runs {
		free += r.Len
	}
	if contiguous || free < n {
		return nil, false
	}
	byLen := slices.Clone(runs)
	slices.SortFunc(byLen, func(a, b Range) int {
		return cmp.Or(cmp.Compare(b.Len, a.Len), cmp.Compare(b.Off, a.Off))
	})
	var out []Range
	for _, r := range byLen {
		k := min(r.Len, n)
		out = append(out, Range{Off: r.Off, Len: k})
		if n -= k; n == 0 {
			break
		}
	}
	return out, true
}

// TestAllocatorRandom runs random Alloc, AllocContiguous and (partial) Free
// against a page map and checks every result and the stats exactly.
func TestAllocatorRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(seed(t), 0))
	ops := 5000
	if testing.Short() {
		ops = 1000
	}
	pages := 64 + rng.IntN(448)
	a := NewAllocator(pg(uint64(pages)))
	m := make(pageModel, pages)
	var live []Range // allocated ranges, each freed at most once

	for i := range ops {
		runs := m.runs()
		switch op := rng.IntN(10); {
		case op < 5:
			// Mostly small requests, some larger than anything free.
			n := uint64(rng.IntN(pages/8*Granule) + 1)
			if rng.IntN(8) == 0 {
				n = uint64(rng.IntN(pages*Granule) + 1)
			}
			contiguous := op == 4
			rn, _ := roundUp(n)
			want, ok := expectAlloc(runs, rn, contiguous)
			var got []Range
			var err error
			if contiguous {
				var r Range
				if r, err = a.AllocContiguous(n); err == nil {
					got = []Range{r}
				}
			} else {
				got, err = a.Alloc(n)
			}
			if !ok {
				if !errors.Is(err, ErrNoSpace) {
					t.Fatalf("op %d: alloc(contiguous=%v) %d B with runs %v: %v, %v; want ErrNoSpace",
						i, contiguous, n, runs, got, err)
				}
				break
			}
			if err != nil || !reflect.DeepEqual(got, want) {
				t.Fatalf("op %d: alloc(contiguous=%v) %d B with runs %v: %v, %v; want %v",
					i, contiguous, n, runs, got, err, want)
			}
			for _, r := range got {
				if err := m.set(r, true); err != nil {
					t.Fatalf("op %d: alloc returned %v: %v", i, r, err)
				}
			}
			live = append(live, got...)
		default:
			if len(live) == 0 {
				break
			}
			j := rng.IntN(len(live))
			r := live[j]
			live = slices.Delete(live, j, j+1)
			// Free all of r, or a random aligned part and keep the rest live.
			if op >= 8 && r.Len > Granule {
				n := r.Len / Granule
				off := uint64(rng.IntN(int(n)))
				k := uint64(rng.IntN(int(n-off))) + 1
				part := pr(r.Off/Granule+off, k)
				if part.Off > r.Off {
					live = append(live, Range{Off: r.Off, Len: part.Off - r.Off})
				}
				if part.End() < r.End() {
					live = append(live, Range{Off: part.End(), Len: r.End() - part.End()})
				}
				r = part
			}
			if err := a.Free(r); err != nil {
				t.Fatalf("op %d: free %v: %v", i, r, err)
			}
			if err := m.set(r, false); err != nil {
				t.Fatalf("op %d: model free %v: %v", i, r, err)
			}
		}
		checkAgainstModel(t, a, m, i)
	}

	for _, r := range live {
		if err := a.Free(r); err != nil {
			t.Fatalf("final free %v: %v", r, err)
		}
	}
	if got, want := a.FreeRanges(), []Range{pr(0, uint64(pages))}; !reflect.DeepEqual(got, want) {
		t.Fatalf("after freeing everything: %v, want %v", got, want)
	}
	mustCheck(t, a)
}

func checkAgainstModel(t *testing.T, a *Allocator, m pageModel, op int) {
	t.Helper()
	runs := m.runs()
	if got := a.FreeRanges(); !slices.Equal(got, runs) {
		t.Fatalf("op %d: free ranges %v, model %v", op, got, runs)
	}
	var want Stats
	want.Size = pg(uint64(len(m)))
	for _, r := range runs {
		want.Free += r.Len
		want.LargestFree = max(want.LargestFree, r.Len)
	}
	want.Used = want.Size - want.Free
	want.FreeRanges = len(runs)
	want.Fragmentation = fragmentation(want.LargestFree, want.Free)
	if got := a.Stats(); got != want {
		t.Fatalf("op %d: stats %+v, model %+v", op, got, want)
	}
	if err := a.Check(); err != nil {
		t.Fatalf("op %d: %v", op, err)
	}
}

// TestAllocatorConcurrent has goroutines allocate, stamp, verify and free
// memory through one allocator; overlapping allocations would corrupt a
// stamp (and trip the race detector).
func TestAllocatorConcurrent(t *testing.T) {
	s := seed(t)
	const workers, iters = 8, 400
	seg := NewSegment(1, make([]byte, 256<<10))
	errc := make(chan error, workers)
	for w := range workers {
		go func() {
			errc <- func() error {
				rng := rand.New(rand.NewPCG(s, uint64(w)))
				for range iters {
					n := uint64(rng.IntN(24<<10) + 1)
					rs, err := seg.Alloc.Alloc(n)
					if errors.Is(err, ErrNoSpace) {
						continue
					} else if err != nil {
						return err
					}
					stamp := byte(w + 1) // unique per worker
					for _, r := range rs {
						b := seg.Bytes(Extent{1, r.Off, r.Len})
						for j := range b {
							b[j] = stamp
						}
					}
					for _, r := range rs {
						for _, b := range seg.Bytes(Extent{1, r.Off, r.Len}) {
							if b != stamp {
								return fmt.Errorf("worker %d: %v overwritten", w, r)
							}
						}
						if err := seg.Alloc.Free(r); err != nil {
							return err
						}
					}
				}
				return nil
			}()
		}()
	}
	for range workers {
		if err := <-errc; err != nil {
			t.Error(err)
		}
	}
	if st := seg.Alloc.Stats(); st.Used != 0 || st.FreeRanges != 1 {
		t.Errorf("after all frees: %+v", st)
	}
	mustCheck(t, seg.Alloc)
}

func BenchmarkAlloc(b *testing.B) {
	const size = 1 << 30
	for _, state := range []string{"empty", "fragmented"} {
		for _, n := range []uint64{4 << 10, 64 << 10, 1 << 20} {
			b.Run(fmt.Sprintf("state=%s/size=%dKiB", state, n>>10), func(b *testing.B) {
				a := NewAllocator(size)
				if state == "fragmented" {
					// Every other granule allocated: size/2/Granule free ranges.
					for off := uint64(0); off < size; off += Granule {
						if _, err := a.AllocContiguous(Granule); err != nil {
							b.Fatal(err)
						}
					}
					for off := uint64(0); off < size; off += 2 * Granule {
						if err := a.Free(Range{Off: off, Len: Granule}); err != nil {
							b.Fatal(err)
						}
					}
				}
				b.SetBytes(int64(n))
				b.ReportAllocs()
				// b.Loop times only the loop: the setup above is excluded.
				for b.Loop() {
					rs, err := a.Alloc(n)
					if err != nil {
						b.Fatal(err)
					}
					for _, r := range rs {
						if err := a.Free(r); err != nil {
							b.Fatal(err)
						}
					}
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
			})
		}
	}
}

// doubleFreeCases free ranges that overlap free space on an 8-granule
// allocator; free_invariants_{on,off}_test.go run them.
var doubleFreeCases = []struct {
	name string
	free []Range // free before
	r    Range
}{
	{"exact", []Range{pr(2, 2)}, pr(2, 2)},
	{"inside", []Range{pr(1, 4)}, pr(2, 1)},
	{"covers", []Range{pr(3, 1)}, pr(2, 3)},
	{"overlaps start", []Range{pr(2, 2)}, pr(1, 2)},
	{"overlaps end", []Range{pr(2, 2)}, pr(3, 2)},
	{"spans two", []Range{pr(0, 2), pr(5, 1)}, pr(1, 5)},
	{"everything free", []Range{pr(0, 8)}, pr(7, 1)},
}
