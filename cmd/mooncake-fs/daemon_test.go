package main

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// TestCacheTimeoutFlag: --cache-timeout sets how long the kernel keeps
// names and attributes, one second unless given; a negative or absurd
// one is refused with its flag named.
func TestCacheTimeoutFlag(t *testing.T) {
	c, err := parseMountFlags([]string{"/mnt/x"})
	if err != nil || c.cacheTTL != time.Second {
		t.Fatalf("default: %v, %v; want 1s", c.cacheTTL, err)
	}
	if c, err = parseMountFlags([]string{"--cache-timeout", "0", "/mnt/x"}); err != nil || c.cacheTTL != 0 {
		t.Fatalf("0: %v, %v", c.cacheTTL, err)
	}
	for _, bad := range []string{"-1s", "25h"} {
		if _, err := parseMountFlags([]string{"--cache-timeout", bad, "/mnt/x"}); err == nil || !strings.Contains(err.Error(), "--cache-timeout") {
			t.Fatalf("--cache-timeout %s: %v", bad, err)
		}
	}
}

// TestNodeFlag: --node takes a host name's characters; a name that
// replica lists and placement values could not carry is refused.
func TestNodeFlag(t *testing.T) {
	for _, good := range []string{"a", "gpu-7.cluster_1", strings.Repeat("n", 253)} {
		if c, err := parseMountFlags([]string{"--node", good, "/mnt/x"}); err != nil || c.node != good {
			t.Fatalf("--node %q: %v", good, err)
		}
	}
	for _, bad := range []string{"a b", "a,b", "a:b", "a/b", strings.Repeat("n", 254)} {
		if _, err := parseMountFlags([]string{"--node", bad, "/mnt/x"}); err == nil || !strings.Contains(err.Error(), "--node") {
			t.Fatalf("--node %q: %v", bad, err)
		}
	}
}

// TestLazyFreeGODEBUG: madvdontneed=0 is added to a GODEBUG that does not
// set madvdontneed, kept with the settings already there, and a GODEBUG
// that sets it, either way, is left as it is.
func TestLazyFreeGODEBUG(t *testing.T) {
	for _, c := range []struct {
		in, want string
		changed  bool
	}{
		{"", "madvdontneed=0", true},
		{"  ", "madvdontneed=0", true},
		{"gctrace=1", "gctrace=1,madvdontneed=0", true},
		{"madvdontneedx=1", "madvdontneedx=1,madvdontneed=0", true},
		{"madvdontneed=1", "madvdontneed=1", false},
		{"gctrace=1, madvdontneed=1", "gctrace=1, madvdontneed=1", false},
		{"madvdontneed=0,gctrace=1", "madvdontneed=0,gctrace=1", false},
		// Odd ones the runtime reads as it will: the name alone, a value it
		// does not know, an empty entry.
		{"madvdontneed", "madvdontneed", false},
		{"madvdontneed=7", "madvdontneed=7", false},
		{"gctrace=1,", "gctrace=1,,madvdontneed=0", true},
		{"=1", "=1,madvdontneed=0", true},
	} {
		got, changed := lazyFreeGODEBUG(c.in)
		if got != c.want || changed != c.changed {
			t.Errorf("lazyFreeGODEBUG(%q) = %q, %v; want %q, %v", c.in, got, changed, c.want, c.changed)
		}
	}
}

// TestSetEnv: every variable of the name goes, others stay in order, and
// the new one comes last.
func TestSetEnv(t *testing.T) {
	got := setEnv([]string{"A=1", "GODEBUG=x=1", "B=2", "GODEBUG=", "GODEBUGX=3"}, "GODEBUG", "y=0")
	want := []string{"A=1", "B=2", "GODEBUGX=3", "GODEBUG=y=0"}
	if !slices.Equal(got, want) {
		t.Fatalf("setEnv: %q, want %q", got, want)
	}
}
