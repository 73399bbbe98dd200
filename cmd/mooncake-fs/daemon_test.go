package main

import (
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
