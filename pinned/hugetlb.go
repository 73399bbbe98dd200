package pinned

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// HugeStats is the hugetlb part of /proc/meminfo for the default hugepage
// size. Counts are in pages.
type HugeStats struct {
	Total    int    // HugePages_Total: pool size, surplus included
	Free     int    // HugePages_Free: not faulted in by anyone
	Rsvd     int    // HugePages_Rsvd: free but promised to existing mappings
	Surp     int    // HugePages_Surp: above nr_hugepages (overcommit)
	PageSize uint64 // Hugepagesize, in bytes
}

// Available is the number of pages a new mapping can still get from the
// pool: free pages not promised to a mapping already made.
func (s HugeStats) Available() int { return max(s.Free-s.Rsvd, 0) }

// HugepageStatus reads /proc/meminfo.
func HugepageStatus() (HugeStats, error) {
	return readMeminfo("/proc")
}

func readMeminfo(procRoot string) (HugeStats, error) {
	path := filepath.Join(procRoot, "meminfo")
	f, err := os.Open(path)
	if err != nil {
		return HugeStats{}, fmt.Errorf("%w: %w", ErrMeminfo, err)
	}
	defer f.Close()
	st, err := parseMeminfo(f)
	if err != nil {
		return HugeStats{}, fmt.Errorf("%s: %w", path, err)
	}
	return st, nil
}

// parseMeminfo reads the hugetlb fields from meminfo text. All five must
// be present: a kernel without hugetlb support omits them.
func parseMeminfo(r io.Reader) (HugeStats, error) {
	var st HugeStats
	fields := map[string]*int{
		"HugePages_Total": &st.Total,
		"HugePages_Free":  &st.Free,
		"HugePages_Rsvd":  &st.Rsvd,
		"HugePages_Surp":  &st.Surp,
	}
	seen := make(map[string]bool, len(fields)+1)
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		key, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		val := strings.Fields(rest)
		if p, ok := fields[key]; ok {
			if len(val) != 1 {
				return HugeStats{}, fmt.Errorf("%w: %s: want a page count, got %q", ErrMeminfo, key, rest)
			}
			n, err := strconv.Atoi(val[0])
			if err != nil || n < 0 {
				return HugeStats{}, fmt.Errorf("%w: %s: bad count %q", ErrMeminfo, key, val[0])
			}
			*p = n
			seen[key] = true
		} else if key == "Hugepagesize" {
			if len(val) != 2 || val[1] != "kB" {
				return HugeStats{}, fmt.Errorf("%w: Hugepagesize: want \"N kB\", got %q", ErrMeminfo, rest)
			}
			kb, err := strconv.ParseUint(val[0], 10, 64)
			if err != nil || kb == 0 || kb > 1<<30 {
				return HugeStats{}, fmt.Errorf("%w: Hugepagesize: bad size %q", ErrMeminfo, val[0])
			}
			st.PageSize = kb << 10
			seen[key] = true
		}
	}
	if err := sc.Err(); err != nil {
		return HugeStats{}, fmt.Errorf("%w: %w", ErrMeminfo, err)
	}
	var missing []string
	for _, k := range []string{"HugePages_Total", "HugePages_Free", "HugePages_Rsvd", "HugePages_Surp", "Hugepagesize"} {
		if !seen[k] {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		return HugeStats{}, fmt.Errorf("%w: missing %s (kernel without hugetlb?)", ErrMeminfo, strings.Join(missing, ", "))
	}
	return st, nil
}

// lockPath serializes changes to nr_hugepages among mooncake-fs processes.
// It does nothing against other programs writing the sysctl.
const lockPath = "/run/mooncake-fs-hugepages.lock"

// hugePool reads and resizes the kernel's persistent hugepage pool.
// Callers hold the pool lock around every read-modify-write.
type hugePool struct {
	procRoot string
	lockPath string
}

func (p hugePool) nrPath() string { return filepath.Join(p.procRoot, "sys", "vm", "nr_hugepages") }

func (p hugePool) stats() (HugeStats, error) { return readMeminfo(p.procRoot) }

// lock takes the cross-process pool lock; the returned func releases it.
func (p hugePool) lock() (unlock func(), err error) {
	f, err := os.OpenFile(p.lockPath, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("%w: lock: %w", ErrHugepagePool, err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%w: flock %s: %w", ErrHugepagePool, p.lockPath, err)
	}
	// Closing the file drops the flock.
	return func() { f.Close() }, nil
}

// nr reads nr_hugepages: the persistent pool size, surplus excluded.
func (p hugePool) nr() (int, error) {
	b, err := os.ReadFile(p.nrPath())
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrHugepagePool, err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%w: %s: bad count %q", ErrHugepagePool, p.nrPath(), b)
	}
	return n, nil
}

func (p hugePool) setNr(n int) error {
	f, err := os.OpenFile(p.nrPath(), os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrHugepagePool, err)
	}
	_, werr := f.WriteString(strconv.Itoa(n))
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		return fmt.Errorf("%w: set %s to %d: %w", ErrHugepagePool, p.nrPath(), n, err)
	}
	return nil
}

// growLocked makes n more hugepages free and reports by how much
// nr_hugepages rose (which includes surplus pages made persistent); the
// kernel may grant fewer (fragmentation, no memory). The caller holds the
// pool lock.
func (p hugePool) growLocked(n int) (added int, err error) {
	before, err := p.nr()
	if err != nil {
		return 0, err
	}
	// Pages in use above nr_hugepages are surplus; raising nr_hugepages
	// first turns them into persistent pages and adds fresh free pages only
	// beyond that, so grow from the total, surplus included. Shrinking later
	// by what was added restores the surplus as it was.
	st, err := p.stats()
	if err != nil {
		return 0, err
	}
	werr := p.setNr(max(before, st.Total) + n)
	after, err := p.nr()
	if err != nil {
		return 0, errors.Join(werr, err)
	}
	return max(after-before, 0), werr
}

// shrinkLocked lowers nr_hugepages by n, never below 0. The caller holds the
// pool lock. Pages still mapped by someone become surplus and are freed by
// the kernel when they are unmapped.
func (p hugePool) shrinkLocked(n int) error {
	cur, err := p.nr()
	if err != nil {
		return err
	}
	return p.setNr(max(cur-n, 0))
}

// shrink is shrinkLocked under the pool lock.
func (p hugePool) shrink(n int) error {
	unlock, err := p.lock()
	if err != nil {
		return err
	}
	defer unlock()
	return p.shrinkLocked(n)
}
