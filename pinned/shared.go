package pinned

import (
	"fmt"
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
func MapShared(fd int, off, length uint64) (*Shared, error) {
	page := uint64(unix.Getpagesize())
	if length == 0 || off%page != 0 || off+length < off {
		return nil, fmt.Errorf("pinned: map %d B at %d: %w", length, off, ErrInvalidOptions)
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
