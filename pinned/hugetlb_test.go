package pinned

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const meminfoFixture = `MemTotal:       24568812 kB
MemFree:        20123456 kB
AnonHugePages:         0 kB
ShmemHugePages:        0 kB
HugePages_Total:      12
HugePages_Free:        7
HugePages_Rsvd:        3
HugePages_Surp:        1
Hugepagesize:       2048 kB
Hugetlb:           24576 kB
`

func TestParseMeminfo(t *testing.T) {
	st, err := parseMeminfo(strings.NewReader(meminfoFixture))
	if err != nil {
		t.Fatal(err)
	}
	want := HugeStats{Total: 12, Free: 7, Rsvd: 3, Surp: 1, PageSize: 2 << 20}
	if st != want {
		t.Errorf("parseMeminfo = %+v, want %+v", st, want)
	}
	if got := st.Available(); got != 4 {
		t.Errorf("Available() = %d, want 4", got)
	}
}

func TestParseMeminfoErrors(t *testing.T) {
	for name, text := range map[string]string{
		"no hugetlb":   "MemTotal: 1 kB\nAnonHugePages: 0 kB\n",
		"missing one":  strings.Replace(meminfoFixture, "HugePages_Rsvd:        3\n", "", 1),
		"bad count":    strings.Replace(meminfoFixture, "HugePages_Free:        7", "HugePages_Free: x", 1),
		"negative":     strings.Replace(meminfoFixture, "HugePages_Free:        7", "HugePages_Free: -7", 1),
		"extra field":  strings.Replace(meminfoFixture, "HugePages_Free:        7", "HugePages_Free: 7 kB", 1),
		"bad unit":     strings.Replace(meminfoFixture, "2048 kB", "2048 MB", 1),
		"zero size":    strings.Replace(meminfoFixture, "2048 kB", "0 kB", 1),
		"huge size":    strings.Replace(meminfoFixture, "2048 kB", "99999999999999999999 kB", 1),
		"empty":        "",
		"colon only":   ":\n::\n",
		"size no unit": strings.Replace(meminfoFixture, "2048 kB", "2048", 1),
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := parseMeminfo(strings.NewReader(text)); !errors.Is(err, ErrMeminfo) {
				t.Errorf("parseMeminfo = %v, want ErrMeminfo", err)
			}
		})
	}
}

func TestReadMeminfoProcRoot(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "meminfo"), []byte(meminfoFixture), 0o644); err != nil {
		t.Fatal(err)
	}
	st, err := readMeminfo(dir)
	if err != nil || st.Total != 12 {
		t.Errorf("readMeminfo(%s) = %+v, %v", dir, st, err)
	}
	if _, err := readMeminfo(t.TempDir()); !errors.Is(err, ErrMeminfo) || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("readMeminfo(empty dir) = %v, want ErrMeminfo and ErrNotExist", err)
	}
}

func TestHugepageStatus(t *testing.T) {
	st, err := HugepageStatus()
	if err != nil {
		t.Skipf("no hugetlb on this kernel: %v", err)
	}
	if st.PageSize == 0 || st.Free > st.Total {
		t.Errorf("HugepageStatus() = %+v", st)
	}
}

// fakePool is a pool over a temp procfs whose nr_hugepages is a plain file,
// so the read-modify-write logic runs without touching the kernel.
func fakePool(t *testing.T, nr string) hugePool {
	return fakePoolTotal(t, nr, 0)
}

// fakePoolTotal also writes a meminfo whose HugePages_Total is total
// (persistent plus surplus pages).
func fakePoolTotal(t *testing.T, nr string, total int) hugePool {
	t.Helper()
	dir := t.TempDir()
	p := hugePool{procRoot: dir, lockPath: filepath.Join(dir, "lock")}
	if err := os.MkdirAll(filepath.Dir(p.nrPath()), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p.nrPath(), []byte(nr), 0o644); err != nil {
		t.Fatal(err)
	}
	mi := fmt.Sprintf("HugePages_Total: %d\nHugePages_Free: 0\nHugePages_Rsvd: 0\nHugePages_Surp: 0\nHugepagesize: 2048 kB\n", total)
	if err := os.WriteFile(filepath.Join(dir, "meminfo"), []byte(mi), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestHugePoolGrowShrink(t *testing.T) {
	p := fakePool(t, "5\n")
	unlock, err := p.lock()
	if err != nil {
		t.Fatal(err)
	}
	added, err := p.growLocked(3)
	unlock()
	if err != nil || added != 3 {
		t.Fatalf("growLocked(3) = %d, %v; want 3", added, err)
	}
	if n, err := p.nr(); err != nil || n != 8 {
		t.Fatalf("nr() = %d, %v; want 8", n, err)
	}
	if err := p.shrink(3); err != nil {
		t.Fatal(err)
	}
	if n, _ := p.nr(); n != 5 {
		t.Errorf("after shrink(3): nr() = %d, want 5", n)
	}
	if err := p.shrink(100); err != nil {
		t.Fatal(err)
	}
	if n, _ := p.nr(); n != 0 {
		t.Errorf("after shrink(100): nr() = %d, want 0 (never below)", n)
	}
}

// Surplus pages (in use above nr_hugepages) are made persistent first when
// nr_hugepages rises, so growth must start from the total.
func TestHugePoolGrowOverSurplus(t *testing.T) {
	p := fakePoolTotal(t, "0\n", 4)
	unlock, err := p.lock()
	if err != nil {
		t.Fatal(err)
	}
	added, err := p.growLocked(3)
	unlock()
	if err != nil || added != 7 {
		t.Fatalf("growLocked(3) over 4 surplus = %d, %v; want nr raised by 7", added, err)
	}
	if err := p.shrink(added); err != nil {
		t.Fatal(err)
	}
	if n, _ := p.nr(); n != 0 {
		t.Errorf("after shrink: nr() = %d, want 0", n)
	}
}

func TestHugePoolBadFile(t *testing.T) {
	p := fakePool(t, "lots")
	if _, err := p.growLocked(1); !errors.Is(err, ErrHugepagePool) {
		t.Errorf("growLocked on garbage = %v, want ErrHugepagePool", err)
	}
	p.procRoot = t.TempDir()
	if err := p.shrinkLocked(1); !errors.Is(err, ErrHugepagePool) {
		t.Errorf("shrinkLocked on missing file = %v, want ErrHugepagePool", err)
	}
	p.lockPath = filepath.Join(t.TempDir(), "no", "such", "dir", "lock")
	if _, err := p.lock(); !errors.Is(err, ErrHugepagePool) {
		t.Errorf("lock in missing dir = %v, want ErrHugepagePool", err)
	}
}
