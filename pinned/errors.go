package pinned

import "errors"

// Sentinel errors. Every error this package returns wraps one of these (or,
// for failed system calls, also the unix.Errno), so callers test them with
// errors.Is and never by their text.
var (
	// ErrInvalidOptions: an Options field is out of range. Validate joins
	// one wrapped ErrInvalidOptions per bad field.
	ErrInvalidOptions = errors.New("pinned: invalid options")

	// ErrNoHugepages: HugeRequire was asked for and the kernel could not
	// back the region with hugetlb pages (none free, could not reserve, or
	// the hugetlb mmap failed).
	ErrNoHugepages = errors.New("pinned: hugepages unavailable")

	// ErrMap: mmap, madvise or munmap of the region failed.
	ErrMap = errors.New("pinned: map failed")

	// ErrHugepagePool: reading or changing the kernel's hugepage pool
	// (/proc/sys/vm/nr_hugepages, its lock file) failed.
	ErrHugepagePool = errors.New("pinned: hugepage pool")

	// ErrNotShmem: a client's file offered for a shared mapping is not
	// shmem or hugetlbfs memory (MapShared, CheckShmem).
	ErrNotShmem = errors.New("pinned: not shmem or hugetlbfs memory")

	// ErrMeminfo: /proc/meminfo could not be read or parsed.
	ErrMeminfo = errors.New("pinned: meminfo")
)
