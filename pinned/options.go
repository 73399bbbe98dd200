package pinned

import (
	"errors"
	"fmt"
	"path/filepath"
)

// HugeMode says which pages back a Region.
type HugeMode int

const (
	// HugeAuto (the zero value) tries hugetlb pages and falls back to
	// 4 KiB pages with MADV_HUGEPAGE, adding a warning to Info.
	HugeAuto HugeMode = iota
	// HugeRequire fails with ErrNoHugepages unless hugetlb pages back the
	// whole region.
	HugeRequire
	// HugeOff maps 4 KiB pages and advises transparent hugepages.
	HugeOff
)

func (m HugeMode) String() string {
	switch m {
	case HugeAuto:
		return "auto"
	case HugeRequire:
		return "require"
	case HugeOff:
		return "off"
	}
	return fmt.Sprintf("HugeMode(%d)", int(m))
}

// MaxSize is the largest region Map accepts: the 47-bit user address space
// of x86-64 without 5-level paging.
const MaxSize = 1 << 47

// Options configure Map. Start from DefaultOptions and set Size; the zero
// Options differs from the defaults in Reserve and Lock (both false).
type Options struct {
	// Size of the region in bytes, rounded up to the page size used
	// (2 MiB for hugetlb, 4 KiB otherwise). Required: 0 is invalid.
	Size uint64
	// Huge picks the pages; zero is HugeAuto.
	Huge HugeMode
	// Reserve lets Map raise /proc/sys/vm/nr_hugepages by the shortfall
	// when running as root and too few hugepages are free; Close lowers it
	// again by what was added. Zero (false) never touches the pool.
	// Default true.
	Reserve bool
	// Lock mlocks the region. A failure (RLIMIT_MEMLOCK) is a warning in
	// Info, not an error. Default true.
	Lock bool
	// PrefaultWorkers is the number of goroutines touching the pages at
	// map time; 0 means runtime.NumCPU(). Negative is invalid.
	PrefaultWorkers int
	// ProcRoot is where procfs is mounted; "" means "/proc". Only parsing
	// tests point it elsewhere: the mapping itself always comes from the
	// real kernel. Must be absolute.
	ProcRoot string
}

// DefaultOptions returns the defaults: HugeAuto, Reserve and Lock on, one
// prefault worker per CPU, /proc. Size is left 0 for the caller to set.
func DefaultOptions() Options {
	return Options{
		Huge:     HugeAuto,
		Reserve:  true,
		Lock:     true,
		ProcRoot: "/proc",
	}
}

// Validate reports every bad field at once, each wrapping ErrInvalidOptions.
func (o Options) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOptions}, args...)...))
	}
	if o.Size == 0 {
		bad("Size is 0")
	} else if o.Size > MaxSize {
		bad("Size %d B exceeds %d B", o.Size, uint64(MaxSize))
	}
	switch o.Huge {
	case HugeAuto, HugeRequire, HugeOff:
	default:
		bad("Huge is %v, want HugeAuto, HugeRequire or HugeOff", o.Huge)
	}
	if o.PrefaultWorkers < 0 {
		bad("PrefaultWorkers is %d, want >= 0", o.PrefaultWorkers)
	}
	if o.ProcRoot != "" && !filepath.IsAbs(o.ProcRoot) {
		bad("ProcRoot %q is not an absolute path", o.ProcRoot)
	}
	return errors.Join(errs...)
}

func (o Options) procRoot() string {
	if o.ProcRoot == "" {
		return "/proc"
	}
	return o.ProcRoot
}
