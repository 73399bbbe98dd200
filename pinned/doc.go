// Package pinned provides the memory behind the store's segments: one large
// anonymous mapping per Region, off the Go heap, backed by hugepages when
// the kernel can give them, prefaulted and locked so that neither a copy nor
// a device (CUDA registration, RDMA MR) ever meets a page fault.
//
// # Use
//
//	o := pinned.DefaultOptions()
//	o.Size = 1 << 30
//	r, err := pinned.Map(o)
//	if err != nil { ... }
//	defer r.Close()
//	for _, w := range r.Info().Warnings { log.Warn(w) } // once, at the caller
//	mem := r.Bytes() // valid until Close
//
// # What Map does
//
//  1. Validate the options (every bad field reported at once).
//  2. Unless Huge is HugeOff: under the pool lock (flock on
//     /run/mooncake-fs-hugepages.lock), read HugePages_Free - HugePages_Rsvd
//     from /proc/meminfo; if fewer than ceil(Size/2 MiB) pages are free,
//     Reserve is set and we are root, raise /proc/sys/vm/nr_hugepages by the
//     shortfall and re-read (the kernel may grant fewer). Then
//     mmap(MAP_PRIVATE|MAP_ANONYMOUS|MAP_HUGETLB), which takes the kernel's
//     reservation before the lock is released. If that mmap fails, the pages
//     we added are given back and Map fails with ErrNoHugepages
//     (HugeRequire) or falls back (HugeAuto) with a warning.
//  3. Fallback, or HugeOff: a 2 MiB-aligned anonymous mapping of 4 KiB
//     pages with madvise(MADV_HUGEPAGE) (Info.THP).
//  4. Prefault: PrefaultWorkers goroutines each write a zero byte to every
//     page of one contiguous run (Info.Prefault is the time taken).
//  5. mlock if Lock; failure is a warning and Info.Locked is false.
//
// Close unmaps, then under the pool lock lowers nr_hugepages by
// Info.ReservedPages (never below 0). The pool is shared by the whole
// machine: pages are counted, not owned, so another process holding its own
// pages is not disturbed.
//
// # Concurrency and lock order
//
// Region methods are safe for concurrent use. Locks, outermost first:
//
//	Region.mu
//	└── pool lock file (flock, across processes)
//
// Neither is held across anything but the syscalls and /proc reads above.
// The pool lock orders mooncake-fs processes only; programs that write
// nr_hugepages without it can still race with us.
//
// # Errors and warnings
//
// Errors wrap the sentinels in errors.go (and the unix.Errno of a failed
// system call): ErrInvalidOptions, ErrNoHugepages, ErrMap, ErrHugepagePool,
// ErrMeminfo. Conditions that only cost speed (no hugepages, no mlock, no
// THP) are not errors: they are strings in Info.Warnings, for the caller to
// log once. This package never logs.
package pinned
