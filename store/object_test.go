package store

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// validateKeyModel is ValidateKey as its doc states it: each name in
// turn, as ValidateName.
func validateKeyModel(key string) error {
	if len(key) > MaxKeyLen {
		return ErrNameTooLong
	}
	if key == "" {
		return ErrInvalidName
	}
	for name := range strings.SplitSeq(key, "/") {
		if err := ValidateName(name); err != nil {
			return err
		}
	}
	return nil
}

// TestValidateKey checks ValidateKey against the model on keys built from
// the bytes that matter (slashes, dots, NUL) and names around the length
// limit.
func TestValidateKey(t *testing.T) {
	fixed := []string{"", "a", "/", "a/", "/a", "a//b", ".", "..", "...", "a/./b", "a/../b", "a/.b", "..a",
		"a\x00", "a/\x00/b", strings.Repeat("x", 255), strings.Repeat("x", 256), strings.Repeat("x", 256) + "/\x00",
		"\x00/" + strings.Repeat("x", 256), strings.Repeat("a/", 2047) + "a", strings.Repeat("a/", 2048)}
	for _, k := range fixed {
		if got, want := ValidateKey(k), validateKeyModel(k); got != want {
			t.Errorf("ValidateKey(%q) = %v, want %v", k, got, want)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	parts := []string{"/", ".", "..", "\x00", "a", "bc", strings.Repeat("y", 200), strings.Repeat("z", 60)}
	for range 20000 {
		var b strings.Builder
		for range r.IntN(8) {
			b.WriteString(parts[r.IntN(len(parts))])
		}
		k := b.String()
		if got, want := ValidateKey(k), validateKeyModel(k); got != want {
			t.Fatalf("ValidateKey(%q) = %v, want %v", k, got, want)
		}
	}
}

// FuzzValidateKey checks ValidateKey against the model on any bytes.
func FuzzValidateKey(f *testing.F) {
	for _, k := range []string{"", "a/b", "a//b", "./a", "a/..", "a\x00b/c", strings.Repeat("x", 256) + "/\x00", "a/" + strings.Repeat("y", 300)} {
		f.Add(k)
	}
	f.Fuzz(func(t *testing.T, k string) {
		if got, want := ValidateKey(k), validateKeyModel(k); got != want {
			t.Fatalf("ValidateKey(%q) = %v, want %v", k, got, want)
		}
	})
}
