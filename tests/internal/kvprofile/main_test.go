package main

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMinorFaults: first touches of fresh anonymous memory, in small
// pages, are counted, a fault a page at most (the kernel may map a few
// pages around each fault), and reading the count costs none of its own
// beyond a few.
func TestMinorFaults(t *testing.T) {
	const pages = 4096
	size := pages * os.Getpagesize()
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	if err := unix.Madvise(mem, unix.MADV_NOHUGEPAGE); err != nil {
		t.Fatal(err)
	}
	before, err := minorFaults(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < size; i += os.Getpagesize() {
		mem[i] = 1
	}
	after, err := minorFaults(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if got := after - before; got < pages/16 || got > pages+64 {
		t.Fatalf("%d faults for %d fresh pages", got, pages)
	}
	if _, err := minorFaults(-1); err == nil {
		t.Fatal("no error for a process that cannot be")
	}
}
