package main

import (
	"strings"
	"testing"
)

func TestParsePutGet(t *testing.T) {
	c, a, err := parsePutGet("put", "put FILE KEYPATH", []string{"--excl", "--progress", "never", "f", "k"}, true)
	if err != nil || !c.excl || c.progress != "never" || len(a) != 2 || a[0] != "f" || a[1] != "k" {
		t.Fatalf("put flags: %+v %q %v", c, a, err)
	}
	c, _, err = parsePutGet("get", "get KEYPATH FILE", []string{"k", "f"}, false)
	if err != nil || c.progress != "auto" || c.excl {
		t.Fatalf("get defaults: %+v %v", c, err)
	}
	// Every bad argument is reported at once.
	_, _, err = parsePutGet("put", "put FILE KEYPATH", []string{"--progress", "sometimes", "only-one"}, true)
	if err == nil || !strings.Contains(err.Error(), "--progress") || !strings.Contains(err.Error(), "want 2 arguments") {
		t.Errorf("bad arguments: %v", err)
	}
	if _, _, err := parsePutGet("get", "get KEYPATH FILE", []string{"--excl", "k", "f"}, false); err == nil {
		t.Error("get accepted --excl")
	}
}
