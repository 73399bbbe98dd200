package pinned

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Info describes a mapped Region. It does not change after Map.
type Info struct {
	Size          uint64 // bytes mapped: Options.Size rounded up to PageSize
	PageSize      uint64 // 2 MiB for hugetlb, 4 KiB otherwise
	Huge          bool   // backed by hugetlb pages
	THP           bool   // 4 KiB mapping advised MADV_HUGEPAGE
	Locked        bool   // mlock succeeded
	ReservedPages int    // pages this region added to nr_hugepages; Close removes them
	CUDAPinned    bool   // registered with CUDA (CUDAPin)
	Prefault      time.Duration
	// Warnings are for the caller to log once; the region works without
	// what they describe, only slower or swappable.
	Warnings []string
}

// Region is one anonymous private mapping, prefaulted and (by default)
// locked. Its memory is not on the Go heap, so it can be handed to hardware
// and C; it stays valid until Close. Methods are safe for concurrent use.
type Region struct {
	pool hugePool
	info Info // immutable after Map, but for CUDAPinned
	mu   struct {
		sync.Mutex
		mem        []byte // nil once closed
		cudaPinned bool
	}
}

// Map creates a region as o says. See the package doc for the steps.
func Map(o Options) (*Region, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	r := &Region{pool: hugePool{procRoot: o.procRoot(), lockPath: lockPath}}
	var mem []byte
	if o.Huge != HugeOff {
		h, err := r.pool.mapHuge(o)
		r.info.Warnings = append(r.info.Warnings, h.warnings...)
		switch {
		case err == nil:
			mem = h.mem
			r.info.PageSize = h.pageSize
			r.info.Huge = true
			r.info.ReservedPages = h.reserved
		case o.Huge == HugeRequire:
			return nil, err
		case h.pageSize == 0: // no hugetlb in this kernel, or no meminfo
			r.info.Warnings = append(r.info.Warnings, fmt.Sprintf(
				"hugepages unavailable (%v): using 4 KiB pages; copies may be slower", err))
		default:
			r.info.Warnings = append(r.info.Warnings, fmt.Sprintf(
				"hugepages unavailable (wanted %d, free %d): using 4 KiB pages; copies may be slower",
				h.wanted, h.free))
		}
	}
	if mem == nil {
		pageSize := uint64(os.Getpagesize())
		m, thp, warns, err := mapTHP(roundUp(o.Size, pageSize))
		r.info.Warnings = append(r.info.Warnings, warns...)
		if err != nil {
			return nil, err
		}
		mem = m
		r.info.PageSize = pageSize
		r.info.THP = thp
	}
	r.info.Size = uint64(len(mem))

	workers := o.PrefaultWorkers
	if workers == 0 {
		workers = runtime.NumCPU()
	}
	r.info.Prefault = prefault(mem, r.info.PageSize, workers)

	if o.Lock {
		if err := unix.Mlock(mem); err != nil {
			r.info.Warnings = append(r.info.Warnings, fmt.Sprintf(
				"mlock %d B: %v (RLIMIT_MEMLOCK?): region may be swapped out", len(mem), err))
		} else {
			r.info.Locked = true
		}
	}
	r.mu.mem = mem
	return r, nil
}

// Bytes returns the whole mapping. The region keeps ownership: the slice is
// valid until Close, and nil after it.
func (r *Region) Bytes() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.mu.mem
}

// Info describes the region. The caller may keep and modify the copy.
func (r *Region) Info() Info {
	info := r.info
	info.Warnings = slices.Clone(r.info.Warnings)
	r.mu.Lock()
	info.CUDAPinned = r.mu.cudaPinned
	r.mu.Unlock()
	return info
}

// Close unmaps the region and lowers nr_hugepages by the pages Map added.
// Every slice from Bytes is invalid afterwards. Close after Close does
// nothing and returns nil.
func (r *Region) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	mem := r.mu.mem
	if mem == nil {
		return nil
	}
	r.mu.mem = nil
	var errs []error
	if err := unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(mem)), uintptr(len(mem))); err != nil {
		errs = append(errs, fmt.Errorf("pinned: munmap %d B: %w: %w", len(mem), ErrMap, err))
	}
	if n := r.info.ReservedPages; n > 0 {
		if err := r.pool.shrink(n); err != nil {
			errs = append(errs, fmt.Errorf("pinned: give back %d hugepages: %w", n, err))
		}
	}
	return errors.Join(errs...)
}

// hugeMapping is what mapHuge got, and on failure what it saw.
type hugeMapping struct {
	mem      []byte
	pageSize uint64
	reserved int // pages added to nr_hugepages and kept for this mapping
	wanted   int
	free     int // pages available to us when mmap was tried
	warnings []string
}

// mapHuge maps o.Size bytes of hugetlb pages, first growing the pool by the
// shortfall when o.Reserve allows and we are root. The pool lock is held
// from reading the free count until mmap has taken its reservation, so
// concurrent daemons never count the same free pages twice. Every error
// wraps ErrNoHugepages; on error nothing is left added to the pool.
func (p hugePool) mapHuge(o Options) (h hugeMapping, err error) {
	root := os.Geteuid() == 0
	locked := false
	if o.Reserve && root {
		unlock, err := p.lock()
		if err != nil {
			h.warnings = append(h.warnings, fmt.Sprintf("cannot reserve hugepages: %v", err))
		} else {
			defer unlock()
			locked = true
		}
	}
	st, err := p.stats()
	if err != nil {
		return h, fmt.Errorf("pinned: hugetlb: %w: %w", ErrNoHugepages, err)
	}
	length := roundUp(o.Size, st.PageSize)
	h.pageSize = st.PageSize
	h.wanted = int(length / st.PageSize)
	h.free = st.Available()

	if short := h.wanted - h.free; short > 0 && o.Reserve {
		if !root {
			h.warnings = append(h.warnings, fmt.Sprintf("not root: cannot add %d pages to nr_hugepages", short))
		} else if locked {
			added, gerr := p.growLocked(short)
			h.reserved = added
			if gerr != nil {
				h.warnings = append(h.warnings, fmt.Sprintf("reserving %d hugepages: %v", short, gerr))
			}
			if st, err := p.stats(); err == nil {
				h.free = st.Available()
			}
		}
	}

	ptr, merr := unix.MmapPtr(-1, 0, nil, uintptr(length),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_HUGETLB)
	if merr != nil {
		err = fmt.Errorf("pinned: hugetlb mmap %d B (wanted %d pages, free %d): %w: %w",
			length, h.wanted, h.free, ErrNoHugepages, merr)
		if h.reserved > 0 {
			if serr := p.shrinkLocked(h.reserved); serr != nil {
				err = errors.Join(err, fmt.Errorf("pinned: give back %d hugepages: %w", h.reserved, serr))
			}
			h.reserved = 0
		}
		return h, err
	}
	h.mem = unsafe.Slice((*byte)(ptr), int(length))
	return h, nil
}

// thpAlign is the PMD size on x86-64: a transparent hugepage can only back
// a 2 MiB-aligned 2 MiB range, so the mapping starts on that boundary.
const thpAlign = 2 << 20

// mapTHP maps length bytes of 4 KiB pages aligned to thpAlign and advises
// MADV_HUGEPAGE. A failed madvise is a warning: the mapping still works.
func mapTHP(length uint64) (mem []byte, thp bool, warnings []string, err error) {
	span := length
	if length >= thpAlign {
		span += thpAlign
	}
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(span),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, false, nil, fmt.Errorf("pinned: mmap %d B: %w: %w", length, ErrMap, err)
	}
	head := uint64(0)
	if span > length {
		head = roundUp(uint64(uintptr(p)), thpAlign) - uint64(uintptr(p))
	}
	start := unsafe.Add(p, head)
	// Trim the alignment slack; these cannot fail on ranges we just mapped.
	if head > 0 {
		_ = unix.MunmapPtr(p, uintptr(head))
	}
	if tail := span - head - length; tail > 0 {
		_ = unix.MunmapPtr(unsafe.Add(start, length), uintptr(tail))
	}
	mem = unsafe.Slice((*byte)(start), int(length))

	if err := unix.Madvise(mem, unix.MADV_HUGEPAGE); err != nil {
		warnings = append(warnings, fmt.Sprintf("madvise(MADV_HUGEPAGE) %d B: %v: 4 KiB pages only", length, err))
		return mem, false, warnings, nil
	}
	if mode, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err == nil &&
		strings.Contains(string(mode), "[never]") {
		warnings = append(warnings, "transparent hugepages are disabled ([never]): 4 KiB pages only")
	}
	return mem, true, warnings, nil
}

func roundUp(n, to uint64) uint64 { return (n + to - 1) / to * to }
