//go:build invariants

package segment

import (
	"errors"
	"testing"
)

// Under -tags invariants a double free panics with an error wrapping
// ErrDoubleFree.
func TestDoubleFree(t *testing.T) {
	for _, tc := range doubleFreeCases {
		t.Run(tc.name, func(t *testing.T) {
			a := allocatorWithFree(t, 8, tc.free...)
			defer func() {
				err, _ := recover().(error)
				if !errors.Is(err, ErrDoubleFree) {
					t.Fatalf("free %v: recovered %v, want a panic with ErrDoubleFree", tc.r, err)
				}
			}()
			_ = a.Free(tc.r)
		})
	}
}

// Bad ranges are input errors, not bugs: they return errors even here.
func TestBadRangeDoesNotPanic(t *testing.T) {
	a := NewAllocator(pg(4))
	if err := a.Free(Range{Off: 1, Len: Granule}); !errors.Is(err, ErrBadRange) {
		t.Fatalf("free unaligned: %v, want ErrBadRange", err)
	}
}
