//go:build !invariants

package ioctl

import (
	"errors"
	"testing"
)

// In normal builds a double Return returns ErrDoubleReturn and leaves the
// slot with its current lease; pool_invariants_on_test.go checks that
// -tags invariants panics instead.
func TestDoubleReturn(t *testing.T) {
	s := newSlots(1)
	if err := doubleReturn(t, s); !errors.Is(err, ErrDoubleReturn) {
		t.Fatalf("double return: %v", err)
	}
	if st := s.stats(); st.Leased != 1 || st.Returns != 1 {
		t.Errorf("stats after a refused return: %+v", st)
	}
	if err := s.give(7, 0); !errors.Is(err, ErrDoubleReturn) {
		t.Errorf("return of a slot out of range: %v", err)
	}
}
