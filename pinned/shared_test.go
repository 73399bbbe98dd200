package pinned

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMapShared(t *testing.T) {
	fd, err := unix.MemfdCreate("t", 0)
	if err != nil {
		t.Skip(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 3*4096); err != nil {
		t.Fatal(err)
	}
	s, err := MapShared(fd, 4096, 8192)
	if err != nil {
		t.Fatal(err)
	}
	s.Bytes()[0] = 42
	got := make([]byte, 1)
	if _, err := unix.Pread(fd, got, 4096); err != nil || got[0] != 42 {
		t.Fatalf("write through the mapping not seen in the file: %v %v", got, err)
	}
	if err := s.Close(); err != nil || s.Bytes() != nil || s.Close() != nil {
		t.Fatal("close")
	}
	for _, c := range []struct{ off, n uint64 }{{1, 4096}, {0, 0}, {8192, 8192}, {^uint64(0) &^ 4095, 8192}} {
		if _, err := MapShared(fd, c.off, c.n); !errors.Is(err, ErrInvalidOptions) {
			t.Errorf("MapShared(off %d, %d) = %v", c.off, c.n, err)
		}
	}
	p, _ := unix.Open("/", unix.O_RDONLY|unix.O_DIRECTORY, 0)
	defer unix.Close(p)
	if _, err := MapShared(p, 0, 4096); !errors.Is(err, ErrInvalidOptions) {
		t.Errorf("directory fd accepted: %v", err)
	}
}
