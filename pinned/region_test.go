package pinned

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"unsafe"
)

const mib = 1 << 20

// keepHugepages fails the test, and puts nr_hugepages back, if the test
// leaves the pool at another size than it found it.
func keepHugepages(t *testing.T) {
	t.Helper()
	p := hugePool{procRoot: "/proc", lockPath: lockPath}
	before, err := p.nr()
	if err != nil {
		t.Skipf("no hugetlb pool: %v", err)
	}
	t.Cleanup(func() {
		after, err := p.nr()
		if err != nil {
			t.Errorf("reading nr_hugepages: %v", err)
			return
		}
		if after != before {
			t.Errorf("nr_hugepages is %d after the test, was %d: restoring", after, before)
			if err := p.setNr(before); err != nil {
				t.Errorf("restoring nr_hugepages: %v", err)
			}
		}
	})
}

func hugeStats(t *testing.T) HugeStats {
	t.Helper()
	st, err := HugepageStatus()
	if err != nil {
		t.Skipf("no hugetlb: %v", err)
	}
	return st
}

// smaps returns the /proc/self/smaps fields of the mapping starting at mem.
func smaps(t *testing.T, mem []byte) map[string]string {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	start := fmt.Sprintf("%x-", uintptr(unsafe.Pointer(unsafe.SliceData(mem))))
	var fields map[string]string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		key, val, ok := strings.Cut(line, ":")
		switch {
		case strings.HasPrefix(line, start):
			fields = map[string]string{"range": strings.Fields(line)[0]}
		case fields != nil && ok && !strings.Contains(key, " "):
			fields[key] = strings.TrimSpace(val)
			if key == "VmFlags" {
				return fields
			}
		}
	}
	t.Fatalf("no mapping at %s in /proc/self/smaps", start)
	return nil
}

func hasFlag(vmflags, flag string) bool {
	for _, f := range strings.Fields(vmflags) {
		if f == flag {
			return true
		}
	}
	return false
}

func TestMapHugeAutoReservesAndGivesBack(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to raise /proc/sys/vm/nr_hugepages")
	}
	keepHugepages(t)
	before := hugeStats(t)
	o := DefaultOptions()
	o.Size = 16 * mib
	r, err := Map(o)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	info := r.Info()
	t.Logf("before %+v; Info %+v", before, info)
	if !info.Huge || info.THP || info.PageSize != before.PageSize || info.Size != 16*mib {
		t.Fatalf("Info() = %+v, want hugetlb pages of %d B", info, before.PageSize)
	}
	if !info.Locked {
		t.Errorf("Info().Locked = false as root: %q", info.Warnings)
	}
	wanted := int(16 * mib / before.PageSize)
	if short := wanted - before.Available(); short > 0 && info.ReservedPages < short {
		t.Errorf("ReservedPages = %d, want >= %d (free was %d)", info.ReservedPages, short, before.Available())
	}
	during := hugeStats(t)
	if during.Total != before.Total+info.ReservedPages {
		t.Errorf("HugePages_Total = %d while mapped, want %d + %d", during.Total, before.Total, info.ReservedPages)
	}
	if info.ReservedPages > 0 && during.Total <= before.Total {
		t.Errorf("HugePages_Total did not go up: %d -> %d", before.Total, during.Total)
	}
	sm := smaps(t, r.Bytes())
	if got, want := sm["KernelPageSize"], fmt.Sprintf("%d kB", before.PageSize>>10); got != want {
		t.Errorf("smaps KernelPageSize = %q, want %q", got, want)
	}
	if !hasFlag(sm["VmFlags"], "ht") {
		t.Errorf("smaps VmFlags %q lack ht (hugetlb)", sm["VmFlags"])
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if after := hugeStats(t); after.Total != before.Total {
		t.Errorf("HugePages_Total = %d after Close, want %d", after.Total, before.Total)
	}
}

func TestMapHugeOffAdvisesTHP(t *testing.T) {
	keepHugepages(t)
	before := hugeStats(t)
	o := DefaultOptions()
	o.Size = 16*mib + 1
	o.Huge = HugeOff
	r, err := Map(o)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	info := r.Info()
	if info.Huge || !info.THP || info.PageSize != 4096 || info.ReservedPages != 0 {
		t.Fatalf("Info() = %+v, want THP-advised 4 KiB pages", info)
	}
	if info.Size != 16*mib+4096 {
		t.Errorf("Info().Size = %d, want %d (rounded up to 4 KiB)", info.Size, 16*mib+4096)
	}
	mem := r.Bytes()
	if uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%thpAlign != 0 {
		t.Errorf("mapping at %p is not 2 MiB aligned", unsafe.SliceData(mem))
	}
	sm := smaps(t, mem)
	if !hasFlag(sm["VmFlags"], "hg") {
		t.Errorf("smaps VmFlags %q lack hg (MADV_HUGEPAGE)", sm["VmFlags"])
	}
	if sm["KernelPageSize"] != "4 kB" {
		t.Errorf("smaps KernelPageSize = %q, want 4 kB", sm["KernelPageSize"])
	}
	if os.Geteuid() == 0 && (!info.Locked || !hasFlag(sm["VmFlags"], "lo")) {
		t.Errorf("not locked as root: Locked=%v VmFlags %q warnings %q", info.Locked, sm["VmFlags"], info.Warnings)
	}
	if during := hugeStats(t); during.Total != before.Total {
		t.Errorf("HugeOff changed HugePages_Total: %d -> %d", before.Total, during.Total)
	}
}

// With no free hugepages and Reserve off, HugeRequire fails and HugeAuto
// falls back with a warning; neither touches the pool.
func TestMapWithoutReserve(t *testing.T) {
	keepHugepages(t)
	st := hugeStats(t)
	if st.Available() >= 8 {
		t.Skipf("%d hugepages free: cannot provoke a shortage", st.Available())
	}
	if b, err := os.ReadFile("/proc/sys/vm/nr_overcommit_hugepages"); err != nil || strings.TrimSpace(string(b)) != "0" {
		t.Skipf("nr_overcommit_hugepages is %q (%v): surplus pages may satisfy the mapping", b, err)
	}
	o := DefaultOptions()
	o.Size = 16 * mib
	o.Reserve = false

	o.Huge = HugeRequire
	r, err := Map(o)
	if !errors.Is(err, ErrNoHugepages) {
		if r != nil {
			r.Close()
		}
		t.Fatalf("HugeRequire: Map = %v, want ErrNoHugepages", err)
	}

	o.Huge = HugeAuto
	r, err = Map(o)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	info := r.Info()
	if info.Huge || !info.THP || info.ReservedPages != 0 {
		t.Errorf("HugeAuto fallback: Info() = %+v", info)
	}
	if !strings.Contains(strings.Join(info.Warnings, "\n"), "hugepages unavailable (wanted 8, free") {
		t.Errorf("HugeAuto fallback: warnings %q lack the fallback", info.Warnings)
	}
}

func TestRegionReadWriteEndToEnd(t *testing.T) {
	keepHugepages(t)
	for _, mode := range []HugeMode{HugeAuto, HugeOff} {
		t.Run(mode.String(), func(t *testing.T) {
			o := DefaultOptions()
			o.Size = 32 * mib
			o.Huge = mode
			o.PrefaultWorkers = 3
			r, err := Map(o)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			t.Logf("Info %+v", r.Info())
			mem := r.Bytes()
			if uint64(len(mem)) != r.Info().Size || len(mem) < 32*mib {
				t.Fatalf("len(Bytes()) = %d, Info().Size = %d", len(mem), r.Info().Size)
			}
			for i, b := range mem {
				if b != 0 {
					t.Fatalf("fresh byte %d = %d, want 0", i, b)
				}
			}
			for off := 0; off < len(mem); off += 8 {
				binary.LittleEndian.PutUint64(mem[off:], uint64(off)^0x9e3779b97f4a7c15)
			}
			for off := 0; off < len(mem); off += 8 {
				if got, want := binary.LittleEndian.Uint64(mem[off:]), uint64(off)^0x9e3779b97f4a7c15; got != want {
					t.Fatalf("word at %d = %#x, want %#x", off, got, want)
				}
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestCloseTwice(t *testing.T) {
	keepHugepages(t)
	before := hugeStats(t)
	o := DefaultOptions()
	o.Size = 4 * mib
	r, err := Map(o)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("first Close: %v", err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if r.Bytes() != nil {
		t.Errorf("Bytes() after Close is not nil")
	}
	if after := hugeStats(t); after.Total != before.Total {
		t.Errorf("HugePages_Total = %d after two Closes, want %d", after.Total, before.Total)
	}
}

func TestInfoIsACopy(t *testing.T) {
	o := DefaultOptions()
	o.Size = 4096
	o.Huge = HugeOff
	o.Lock = false
	r, err := Map(o)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	info := r.Info()
	info.Warnings = append(info.Warnings[:0], "mine")
	info.Size = 1
	if got := r.Info(); got.Size != 4096 || (len(got.Warnings) > 0 && got.Warnings[0] == "mine") {
		t.Errorf("Info() shares state with an earlier copy: %+v", got)
	}
	if r.Info().Locked {
		t.Errorf("Locked with Lock=false")
	}
}

// Concurrent Maps each reserve their own shortfall under the pool lock (one
// flock per open file, so goroutines serialize like processes do) and every
// one gets hugepages; the pool ends where it started.
func TestConcurrentMapsShareThePool(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to raise /proc/sys/vm/nr_hugepages")
	}
	keepHugepages(t)
	before := hugeStats(t)
	const n = 4
	regions := make([]*Region, n)
	errs := make([]error, n)
	done := make(chan struct{})
	for i := range n {
		go func() {
			defer func() { done <- struct{}{} }()
			o := DefaultOptions()
			o.Size = 8 * mib
			o.Huge = HugeRequire
			o.PrefaultWorkers = 1
			regions[i], errs[i] = Map(o)
		}()
	}
	for range n {
		<-done
	}
	reserved := 0
	for i, r := range regions {
		if errs[i] != nil {
			t.Errorf("Map %d: %v", i, errs[i])
			continue
		}
		reserved += r.Info().ReservedPages
	}
	if during := hugeStats(t); during.Total != before.Total+reserved {
		t.Errorf("HugePages_Total = %d with %d regions, want %d + %d", during.Total, n, before.Total, reserved)
	}
	for _, r := range regions {
		if r != nil {
			if err := r.Close(); err != nil {
				t.Error(err)
			}
		}
	}
	if after := hugeStats(t); after.Total != before.Total {
		t.Errorf("HugePages_Total = %d after Close, want %d", after.Total, before.Total)
	}
}
