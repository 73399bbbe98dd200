package pinned

import (
	"errors"
	"strings"
	"testing"
)

func TestDefaultOptions(t *testing.T) {
	o := DefaultOptions()
	if !o.Reserve || !o.Lock || o.Huge != HugeAuto || o.ProcRoot != "/proc" || o.PrefaultWorkers != 0 {
		t.Errorf("DefaultOptions() = %+v", o)
	}
	if err := o.Validate(); !errors.Is(err, ErrInvalidOptions) {
		t.Errorf("defaults without Size: Validate() = %v, want ErrInvalidOptions", err)
	}
	o.Size = 1
	if err := o.Validate(); err != nil {
		t.Errorf("defaults with Size: Validate() = %v", err)
	}
}

func TestValidateReportsEveryField(t *testing.T) {
	o := Options{Size: 0, Huge: HugeMode(7), PrefaultWorkers: -1, ProcRoot: "proc"}
	err := o.Validate()
	if !errors.Is(err, ErrInvalidOptions) {
		t.Fatalf("Validate() = %v, want ErrInvalidOptions", err)
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("Validate() = %T, want a joined error", err)
	}
	if n := len(joined.Unwrap()); n != 4 {
		t.Errorf("Validate() reported %d errors, want 4:\n%v", n, err)
	}
	for _, field := range []string{"Size", "Huge", "PrefaultWorkers", "ProcRoot"} {
		if !strings.Contains(err.Error(), field) {
			t.Errorf("Validate() does not name %s:\n%v", field, err)
		}
	}
	for _, e := range joined.Unwrap() {
		if !errors.Is(e, ErrInvalidOptions) {
			t.Errorf("%v does not wrap ErrInvalidOptions", e)
		}
	}
}

func TestValidateSizeLimit(t *testing.T) {
	for _, size := range []uint64{MaxSize + 1, 1<<64 - 1} {
		o := DefaultOptions()
		o.Size = size
		if err := o.Validate(); !errors.Is(err, ErrInvalidOptions) {
			t.Errorf("Size %d: Validate() = %v, want ErrInvalidOptions", size, err)
		}
	}
}

func TestMapRejectsBadOptions(t *testing.T) {
	r, err := Map(Options{Huge: -1})
	if !errors.Is(err, ErrInvalidOptions) || r != nil {
		t.Fatalf("Map(bad) = %v, %v; want nil, ErrInvalidOptions", r, err)
	}
}

func TestHugeModeString(t *testing.T) {
	for m, want := range map[HugeMode]string{HugeAuto: "auto", HugeRequire: "require", HugeOff: "off", 9: "HugeMode(9)"} {
		if got := m.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", int(m), got, want)
		}
	}
}
