package ioctl

import (
	"errors"
	"testing"
)

// These numbers are the ABI. Changing one breaks every client built before.
func TestCommandNumbers(t *testing.T) {
	for _, c := range []struct {
		name string
		cmd  uint32
		want uint32
	}{
		{"GET_MAGIC", CmdGetMagic, 0x80104d01},
		{"GET_ABI_VERSION", CmdGetABIVersion, 0x80104d02},
	} {
		if c.cmd != c.want {
			t.Errorf("%s = %#x, want %#x", c.name, c.cmd, c.want)
		}
		if TypeOf(c.cmd) != Type {
			t.Errorf("%s type %#x", c.name, TypeOf(c.cmd))
		}
		if s := Size(c.cmd); s%8 != 0 || s > MaxArgSize {
			t.Errorf("%s size %d not 8-aligned or too large", c.name, s)
		}
	}
}

func TestStructSizes(t *testing.T) {
	if n := len(MagicArg{}.Marshal()); n != 16 {
		t.Errorf("MagicArg %d B", n)
	}
	if n := len(ABIVersionArg{}.Marshal()); n != 16 {
		t.Errorf("ABIVersionArg %d B", n)
	}
}

func TestRoundTrip(t *testing.T) {
	a := ABIVersionArg{Major: 3, Minor: 7}
	var b ABIVersionArg
	if err := b.Unmarshal(a.Marshal()); err != nil || b.Major != 3 || b.Minor != 7 || b.Size != SizeABIVersionArg {
		t.Fatalf("got %+v, %v", b, err)
	}
	m := MagicArg{Magic: MagicValue}
	var m2 MagicArg
	if err := m2.Unmarshal(m.Marshal()); err != nil || m2.Magic != MagicValue {
		t.Fatalf("got %+v, %v", m2, err)
	}
}

func TestDecodeRejects(t *testing.T) {
	var a ABIVersionArg
	if err := a.Unmarshal(make([]byte, 8)); !errors.Is(err, ErrShortArg) {
		t.Errorf("short: %v", err)
	}
	b := ABIVersionArg{}.Marshal()
	b[0] = 99
	if err := a.Unmarshal(b); !errors.Is(err, ErrArgSize) {
		t.Errorf("bad size: %v", err)
	}
}
