//go:build !invariants

package segment

import (
	"errors"
	"reflect"
	"testing"
)

// In normal builds a double free returns ErrDoubleFree and changes nothing;
// free_invariants_on_test.go checks that -tags invariants panics instead.
func TestDoubleFree(t *testing.T) {
	for _, tc := range doubleFreeCases {
		t.Run(tc.name, func(t *testing.T) {
			a := allocatorWithFree(t, 8, tc.free...)
			before, beforeRanges := a.Stats(), a.FreeRanges()
			if err := a.Free(tc.r); !errors.Is(err, ErrDoubleFree) {
				t.Fatalf("free %v: %v, want ErrDoubleFree", tc.r, err)
			}
			if after := a.Stats(); after != before {
				t.Errorf("stats %+v -> %+v", before, after)
			}
			if after := a.FreeRanges(); !reflect.DeepEqual(after, beforeRanges) {
				t.Errorf("free ranges %v -> %v", beforeRanges, after)
			}
			mustCheck(t, a)
		})
	}
}

func TestTableFreeDoubleFree(t *testing.T) {
	tb := NewTable()
	if err := tb.Add(NewSegment(1, make([]byte, pg(4)))); err != nil {
		t.Fatal(err)
	}
	es, err := tb.Alloc(pg(2))
	if err != nil {
		t.Fatal(err)
	}
	if err := tb.Free(es); err != nil {
		t.Fatal(err)
	}
	if err := tb.Free(es); !errors.Is(err, ErrDoubleFree) {
		t.Fatalf("second free: %v, want ErrDoubleFree", err)
	}
}

// A batch's values lie one after the other and are freed together as
// one range (freeMany); a run with a part that may not be freed frees the
// others and fails that part alone, as each freed in turn would.
func TestTableFreeRuns(t *testing.T) {
	for _, tc := range []struct {
		name  string
		parts func(vals []Extent) []Extent
		errs  int   // errors joined
		want  error // each wraps it
		used  uint64
	}{
		{"whole run", func(v []Extent) []Extent { return v }, 0, nil, 0},
		{"one freed twice", func(v []Extent) []Extent { return append(v[:3:3], append([]Extent{v[2]}, v[3:]...)...) }, 1, ErrDoubleFree, 0},
		{"a part of one freed before", nil, 1, ErrDoubleFree, 0},
		{"halves of a granule", func(v []Extent) []Extent {
			return []Extent{{1, v[0].Off, Granule / 2}, {1, v[0].Off + Granule/2, Granule / 2}}
		}, 2, ErrBadRange, pg(8)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tb := newTable(t, pg(16))
			dst, errs := make([][]Extent, 8), make([]error, 8)
			sizes := []uint64{pg(1), pg(1), pg(1), pg(1), pg(1), pg(1), pg(1), pg(1)}
			tb.AllocMany(dst, sizes, errs)
			var vals []Extent
			for k, e := range dst {
				if errs[k] != nil || len(e) != 1 {
					t.Fatalf("value %d: %v, %v", k, e, errs[k])
				}
				if k > 0 && e[0].Off != vals[k-1].Off+pg(1) {
					t.Fatalf("value %d at %v, not after %v", k, e[0], vals[k-1])
				}
				vals = append(vals, e[0])
			}
			parts := vals
			if tc.parts != nil {
				parts = tc.parts(vals)
			} else if err := tb.Free([]Extent{vals[4]}); err != nil {
				t.Fatal(err)
			}
			err := tb.Free(parts)
			n := countErrs(err)
			if n != tc.errs || tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("Free: %d errors, %v; want %d wrapping %v", n, err, tc.errs, tc.want)
			}
			if st := tb.Stats(); st.Used != tc.used || tc.used == 0 && st.FreeRanges != 1 {
				t.Errorf("after the free %+v, want %d B used", st, tc.used)
			}
			checkTable(t, tb)
		})
	}
}

// countErrs counts the errors joined in err, through wrapping.
func countErrs(err error) int {
	switch e := err.(type) {
	case nil:
		return 0
	case interface{ Unwrap() []error }:
		n := 0
		for _, x := range e.Unwrap() {
			n += countErrs(x)
		}
		return n
	case interface{ Unwrap() error }:
		if u := e.Unwrap(); u != nil {
			return countErrs(u)
		}
	}
	return 1
}
