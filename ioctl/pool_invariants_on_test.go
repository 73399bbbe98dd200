//go:build invariants

package ioctl

import (
	"errors"
	"testing"
)

// Under -tags invariants a double Return panics with ErrDoubleReturn.
func TestDoubleReturn(t *testing.T) {
	s := newSlots(1)
	defer func() {
		err, _ := recover().(error)
		if !errors.Is(err, ErrDoubleReturn) {
			t.Fatalf("recovered %v, want a panic with ErrDoubleReturn", err)
		}
	}()
	_ = doubleReturn(t, s)
}
