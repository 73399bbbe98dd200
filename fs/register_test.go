package fs

import (
	"errors"
	"testing"
)

// TestRegistrationLimits: registrations are bounded per open file and
// for the whole mount, by count and by the address space they map; a
// refused one changes nothing.
func TestRegistrationLimits(t *testing.T) {
	f := &FS{opts: DefaultOptions()}
	f.opts.MaxRegistrations, f.opts.MaxRegistrationsTotal, f.opts.MaxRegisteredBytes = 2, 3, 10<<10
	a, b := &regTable{fs: f}, &regTable{fs: f}
	reg := func(n int) *registration { return &registration{mem: make([]byte, n)} }
	for i, c := range []struct {
		t    *regTable
		size int
		ok   bool
	}{
		{a, 4 << 10, true},
		{a, 1 << 10, true},
		{a, 1 << 10, false}, // a third on one file
		{b, 6 << 10, false}, // 11 KiB on the mount
		{b, 1 << 10, true},
		{b, 1 << 10, false}, // a fourth on the mount
	} {
		_, err := c.t.add(reg(c.size))
		if (err == nil) != c.ok || err != nil && !errors.Is(err, errTooManyRegs) {
			t.Errorf("registration %d (%d B): %v, want ok=%v", i, c.size, err, c.ok)
		}
	}
	if live, bytes := f.regs.live.Load(), f.regs.bytes.Load(); live != 3 || bytes != 6<<10 {
		t.Errorf("live %d, %d B after the refusals; want 3, %d B", live, bytes, 6<<10)
	}
}
