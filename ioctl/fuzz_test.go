package ioctl

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzDecode feeds arbitrary bytes to every argument decoder: no panic, only
// the decoding errors, and whatever decodes re-encodes to the same bytes.
func FuzzDecode(f *testing.F) {
	f.Add(MagicArg{Magic: MagicValue}.Marshal())
	f.Add(ABIVersionArg{Major: 1}.Marshal())
	f.Add([]byte{})
	f.Add(make([]byte, 7))
	f.Fuzz(func(t *testing.T, b []byte) {
		var m MagicArg
		if err := m.Unmarshal(b); err == nil {
			if !bytes.Equal(m.Marshal(), b[:SizeMagicArg]) {
				t.Fatalf("MagicArg does not round-trip")
			}
		} else if !errors.Is(err, ErrShortArg) && !errors.Is(err, ErrArgSize) {
			t.Fatalf("unexpected error %v", err)
		}
		var v ABIVersionArg
		if err := v.Unmarshal(b); err == nil {
			if !bytes.Equal(v.Marshal(), b[:SizeABIVersionArg]) {
				t.Fatalf("ABIVersionArg does not round-trip")
			}
		} else if !errors.Is(err, ErrShortArg) && !errors.Is(err, ErrArgSize) {
			t.Fatalf("unexpected error %v", err)
		}
	})
}
