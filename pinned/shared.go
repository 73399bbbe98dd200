package pinned

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Shared is a client's shared memory (a memfd or shm file) mapped into the
// daemon with MAP_SHARED: the registered-buffer side of zero-copy ioctls.
// Bytes written here are the client's bytes, with no copy in between.
type Shared struct {
	mu  sync.Mutex
	mem []byte
}

// MapShared maps length bytes of fd at off (page aligned) read-write and
// shared. The caller keeps ownership of fd and may close it afterwards:
// the mapping holds its own reference to the file.
//
// fd must be shmem (a memfd, a tmpfs or /dev/shm file) or hugetlbfs
// memory, whose pages fault in without any file system server: a file of
// a FUSE mount (the daemon's own, above all) would make a copy from the
// mapping wait on that mount's daemon, and an ordinary file on disk would
// make it wait on I/O. Anything else fails with ErrNotShmem before the
// file is touched.
func MapShared(fd int, off, length uint64) (*Shared, error) {
	page := uint64(unix.Getpagesize())
	if length == 0 || off%page != 0 || off+length < off {
		return nil, fmt.Errorf("pinned: map %d B at %d: %w", length, off, ErrInvalidOptions)
	}
	if err := CheckShmem(fd); err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("pinned: fstat shared fd: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("pinned: shared fd is not a memfd or shm file (mode %#o): %w", st.Mode, ErrInvalidOptions)
	}
	if uint64(st.Size) < off+length {
		return nil, fmt.Errorf("pinned: shared file has %d B, want %d at %d: %w", st.Size, length, off, ErrInvalidOptions)
	}
	mem, err := unix.Mmap(fd, int64(off), int(length), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("pinned: map shared %d B: %w", length, err)
	}
	return &Shared{mem: mem}, nil
}

// CheckShmem fails with ErrNotShmem unless fd is shmem or hugetlbfs
// memory. It asks the kernel for the file's seals, which only those file
// systems keep: an answer that no file system server takes part in, so a
// file of a hung FUSE mount cannot stall the check itself (fstat would).
func CheckShmem(fd int) error {
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); err != nil {
		return fmt.Errorf("pinned: fd is not a memfd, shmem or hugetlbfs file (F_GET_SEALS: %v): %w", err, ErrNotShmem)
	}
	return nil
}

// Bytes returns the mapping; nil after Close.
func (s *Shared) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mem
}

// Close unmaps. The caller must make sure no copy uses the memory.
func (s *Shared) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mem == nil {
		return nil
	}
	err := unix.Munmap(s.mem)
	s.mem = nil
	return err
}

// DmabufSize returns the size of dma-buf fd, from what the kernel shows
// of it (/proc/self/fdinfo: a dma-buf's names its exporter and its
// size); an error for a descriptor that is no dma-buf.
func DmabufSize(fd int) (uint64, error) {
	return dmabufSize("/proc/self/fdinfo/"+strconv.Itoa(fd), fd)
}

// DmabufSizeOf is DmabufSize for descriptor fd of process pid, looked at
// without taking it.
func DmabufSizeOf(pid, fd int) (uint64, error) {
	if fd < 0 {
		return 0, fmt.Errorf("pinned: fd %d is not a dma-buf", fd)
	}
	return dmabufSize("/proc/"+strconv.Itoa(pid)+"/fdinfo/"+strconv.Itoa(fd), fd)
}

func dmabufSize(path string, fd int) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		// Not the read's errno: what the caller hears is that fd is no
		// dma-buf it can use.
		return 0, fmt.Errorf("pinned: fd %d: no dma-buf to read (%v)", fd, err)
	}
	var size uint64
	exporter := false
	for line := range strings.SplitSeq(string(b), "\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "exp_name":
			exporter = true
		case "size":
			size, _ = strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
	}
	if !exporter {
		return 0, fmt.Errorf("pinned: fd %d is not a dma-buf", fd)
	}
	return size, nil
}
