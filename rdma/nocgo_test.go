//go:build !cgo

package rdma

import (
	"errors"
	"testing"
)

// verbsHaveCgo: this test binary has the stub, which never loads a library.
const verbsHaveCgo = false

// layoutRow mirrors layout.go's type, which needs cgo.
type layoutRow struct {
	what         string
	mirror, real int64
}

// mirrorLayout has nothing to compare without cgo.
func mirrorLayout() ([]layoutRow, bool) { return nil, false }

// TestVerbsWithoutCgo checks that the stub answers ErrUnavailable.
func TestVerbsWithoutCgo(t *testing.T) {
	p := Verbs()
	if p.Name() != "libibverbs" {
		t.Errorf("Name() = %q, want libibverbs", p.Name())
	}
	if devs, err := p.Devices(); !errors.Is(err, ErrUnavailable) || devs != nil {
		t.Errorf("Devices() = %v, %v; want nil, ErrUnavailable", devs, err)
	}
	if d, err := p.Open("mlx5_0"); !errors.Is(err, ErrUnavailable) || d != nil {
		t.Errorf("Open() = %v, %v; want nil, ErrUnavailable", d, err)
	}
	if r := Reason(); r != "built without cgo" {
		t.Errorf("Reason() = %q", r)
	}
}
