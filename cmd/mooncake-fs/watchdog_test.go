package main

import (
	"os"
	"strings"
	"testing"
)

// TestProcState: this process reads as running or sleeping, with a start
// time; a process that does not exist is an error (the watchdog's "gone").
func TestProcState(t *testing.T) {
	state, start, err := procState(os.Getpid())
	if err != nil || start == 0 || !strings.ContainsRune("RS", rune(state)) {
		t.Fatalf("procState(self) = %q, %d, %v", state, start, err)
	}
	again, err := startTime(os.Getpid())
	if err != nil || again != start {
		t.Fatalf("startTime(self) = %d, %v; want %d", again, err, start)
	}
	if _, _, err := procState(1 << 30); err == nil {
		t.Fatal("procState of a pid that cannot exist succeeded")
	}
}

// TestStillMounted: a mount of mountinfo is found by its device and path,
// and not by either with the other's wrong.
func TestStillMounted(t *testing.T) {
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Skip(err)
	}
	f := strings.Fields(strings.SplitN(string(info), "\n", 2)[0])
	dev, dir := f[2], f[4]
	if !stillMounted(dev, dir) {
		t.Fatalf("%s at %s not found", dev, dir)
	}
	if stillMounted("4095:1048575", dir) || stillMounted(dev, dir+"/no-such-mount") {
		t.Fatal("found a mount that is not there")
	}
}
