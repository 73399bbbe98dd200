package main

import (
	"runtime"
	"slices"
	"strings"
	"testing"
)

func TestParseCPUList(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []int
		back string
	}{
		{"3", []int{3}, "3"},
		{"2,3", []int{2, 3}, "2-3"},
		{"0-3,8", []int{0, 1, 2, 3, 8}, "0-3,8"},
		{" 5 , 1-2 ,2", []int{1, 2, 5}, "1-2,5"},
		{"7-7", []int{7}, "7"},
	} {
		got, err := parseCPUList(c.in)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("parseCPUList(%q) = %v, %v; want %v", c.in, got, err, c.want)
			continue
		}
		if s := formatCPUList(got); s != c.back {
			t.Errorf("formatCPUList(%v) = %q, want %q", got, s, c.back)
		}
	}
	for _, bad := range []string{"", " ", "x", "1,", "-1", "3-1", "1-", "1-x", "2,,3", "70000", "0-70000"} {
		if got, err := parseCPUList(bad); err == nil {
			t.Errorf("parseCPUList(%q) = %v, want an error", bad, got)
		}
	}
}

func TestMountFlagsCPUs(t *testing.T) {
	c, err := parseMountFlags([]string{"--cpus", "0-1,4", "/mnt/x"})
	if err != nil || !slices.Equal(c.cpus, []int{0, 1, 4}) {
		t.Fatalf("--cpus 0-1,4: %v, %v", c.cpus, err)
	}
	if c, err = parseMountFlags([]string{"/mnt/x"}); err != nil || c.cpus != nil {
		t.Fatalf("no --cpus: %v, %v", c.cpus, err)
	}
	t.Setenv("MOONCAKE_CPUS", "2")
	if c, err = parseMountFlags([]string{"/mnt/x"}); err != nil || !slices.Equal(c.cpus, []int{2}) {
		t.Fatalf("MOONCAKE_CPUS=2: %v, %v", c.cpus, err)
	}
	if c, err = parseMountFlags([]string{"--cpus", "3", "/mnt/x"}); err != nil || !slices.Equal(c.cpus, []int{3}) {
		t.Fatalf("--cpus overrides MOONCAKE_CPUS: %v, %v", c.cpus, err)
	}
	if _, err = parseMountFlags([]string{"--cpus", "3-1", "/mnt/x"}); err == nil || !strings.Contains(err.Error(), "--cpus") {
		t.Fatalf("--cpus 3-1: %v, want an error naming --cpus", err)
	}
}

func TestConfineRefusesUnavailableCPU(t *testing.T) {
	before, err := allowedCPUs()
	if err != nil {
		t.Fatal(err)
	}
	procs := runtime.GOMAXPROCS(0)
	if err := confineToCPUs([]int{before[0], 65000}); err == nil || !strings.Contains(err.Error(), "65000") {
		t.Fatalf("confine to CPU 65000: %v, want an error naming it", err)
	}
	after, err := allowedCPUs()
	if err != nil || !slices.Equal(before, after) || runtime.GOMAXPROCS(0) != procs {
		t.Fatalf("a refused confinement changed the affinity %v -> %v (%v) or GOMAXPROCS %d -> %d",
			before, after, err, procs, runtime.GOMAXPROCS(0))
	}
}
