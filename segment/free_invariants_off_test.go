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
