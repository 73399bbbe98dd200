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
	if _, err := MapShared(p, 0, 4096); !errors.Is(err, ErrNotShmem) {
		t.Errorf("directory fd accepted: %v", err)
	}
	if d, err := unix.Open("/dev/shm", unix.O_RDONLY|unix.O_DIRECTORY, 0); err == nil {
		defer unix.Close(d)
		if _, err := MapShared(d, 0, 4096); err == nil {
			t.Error("shm directory fd accepted")
		}
	}
}

// TestMapSharedRefusesFiles: only memory that faults in without a file
// system server may be mapped; files on disk (and pipes) are refused
// before anything reads them, shm files are taken.
func TestMapSharedRefusesFiles(t *testing.T) {
	path := t.TempDir() + "/f"
	f, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(f)
	if err := unix.Ftruncate(f, 4096); err != nil {
		t.Fatal(err)
	}
	var sfs unix.Statfs_t
	if unix.Fstatfs(f, &sfs) == nil && sfs.Type == unix.TMPFS_MAGIC {
		t.Skip("the test's temporary directory is on tmpfs")
	}
	if _, err := MapShared(f, 0, 4096); !errors.Is(err, ErrNotShmem) {
		t.Errorf("file on disk: %v, want ErrNotShmem", err)
	}
	var pp [2]int
	if err := unix.Pipe(pp[:]); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pp[0])
	defer unix.Close(pp[1])
	if _, err := MapShared(pp[0], 0, 4096); !errors.Is(err, ErrNotShmem) {
		t.Errorf("pipe: %v, want ErrNotShmem", err)
	}
	shm := "/dev/shm/mooncake-test-" + t.Name()
	s, err := unix.Open(shm, unix.O_RDWR|unix.O_CREAT|unix.O_TRUNC, 0o600)
	if err != nil {
		t.Skip(err)
	}
	defer unix.Unlink(shm)
	defer unix.Close(s)
	if err := unix.Ftruncate(s, 4096); err != nil {
		t.Fatal(err)
	}
	m, err := MapShared(s, 0, 4096)
	if err != nil {
		t.Fatalf("shm file refused: %v", err)
	}
	_ = m.Close()
}
