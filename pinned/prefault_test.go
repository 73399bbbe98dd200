package pinned

import (
	"fmt"
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestPrefaultTouchesEveryPageOnce(t *testing.T) {
	const ps = 64 // a fake page size: prefault only needs len%ps == 0
	for _, pages := range []int{1, 2, 7, 64} {
		for _, workers := range []int{1, 3, 8, 100} {
			mem := make([]byte, pages*ps)
			for i := range mem {
				mem[i] = 1
			}
			prefault(mem, ps, workers)
			for i, b := range mem {
				if want := byte(1); i%ps == 0 {
					want = 0
					if b != want {
						t.Fatalf("pages=%d workers=%d: byte %d = %d, want %d", pages, workers, i, b, want)
					}
				} else if b != want {
					t.Fatalf("pages=%d workers=%d: byte %d = %d, want %d", pages, workers, i, b, want)
				}
			}
		}
	}
}

// BenchmarkPrefault times prefault alone on fresh mappings: the 4 KiB
// pages + THP fallback, and hugetlb pages when root (the pool is grown once
// for the whole run and shrunk after it). Mapping and unmapping are outside
// the timer. path=memclr is the ceiling: clearing the same bytes of an
// already-faulted mapping, which is the zeroing a fault does anyway.
func BenchmarkPrefault(b *testing.B) {
	const size = 64 << 20
	mapFn := map[string]func(b *testing.B) ([]byte, uint64){
		"thp": func(b *testing.B) ([]byte, uint64) {
			mem, _, _, err := mapTHP(size)
			if err != nil {
				b.Fatal(err)
			}
			return mem, 4096
		},
		"hugetlb": func(b *testing.B) ([]byte, uint64) {
			p, err := unix.MmapPtr(-1, 0, nil, size, unix.PROT_READ|unix.PROT_WRITE,
				unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_HUGETLB)
			if err != nil {
				b.Fatal(err)
			}
			return unsafe.Slice((*byte)(p), size), 2 << 20
		},
	}
	unmap := func(b *testing.B, mem []byte) {
		if err := unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(mem)), uintptr(len(mem))); err != nil {
			b.Fatal(err)
		}
	}
	gbps := func(b *testing.B, n int) {
		b.ReportMetric(float64(size)*float64(n)/b.Elapsed().Seconds()/1e9, "GB/s")
	}

	b.Run("path=memclr/size=64MiB", func(b *testing.B) {
		mem, _ := mapFn["thp"](b)
		defer unmap(b, mem)
		prefault(mem, 4096, 1)
		b.SetBytes(size)
		n := 0
		for b.Loop() {
			n++
			clear(mem)
		}
		gbps(b, n)
	})

	for _, path := range []string{"thp", "hugetlb"} {
		for _, workers := range []int{1, 2, 4} {
			b.Run(fmt.Sprintf("path=%s/workers=%d/size=64MiB", path, workers), func(b *testing.B) {
				if path == "hugetlb" {
					growForBench(b, size/(2<<20))
				}
				b.SetBytes(size)
				n := 0
				for b.Loop() {
					n++
					b.StopTimer()
					mem, ps := mapFn[path](b)
					b.StartTimer()
					prefault(mem, ps, workers)
					b.StopTimer()
					unmap(b, mem)
					b.StartTimer()
				}
				gbps(b, n)
			})
		}
	}
}

// growForBench makes pages hugepages available for one benchmark and gives
// back what it added when the benchmark ends.
func growForBench(b *testing.B, pages int) {
	st, err := HugepageStatus()
	if err != nil {
		b.Skipf("no hugetlb: %v", err)
	}
	short := pages - st.Available()
	if short <= 0 {
		return
	}
	if os.Geteuid() != 0 {
		b.Skipf("needs root to add %d pages to nr_hugepages", short)
	}
	p := hugePool{procRoot: "/proc", lockPath: lockPath}
	unlock, err := p.lock()
	if err != nil {
		b.Fatal(err)
	}
	added, err := p.growLocked(short)
	unlock()
	b.Cleanup(func() {
		if err := p.shrink(added); err != nil {
			b.Error(err)
		}
	})
	if err != nil || added < short {
		b.Skipf("kernel granted %d of %d hugepages: %v", added, short, err)
	}
}
