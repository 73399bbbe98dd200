package cuda_test

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/cuda"
)

// The test binary re-executes itself as a child process with one of these
// set, to do what must happen in another process (open an IPC handle) or
// with another environment (a library override).
const (
	envIPCChild     = "MOONCAKE_CUDA_TEST_IPC"
	envLibraryChild = "MOONCAKE_CUDA_TEST_LIBRARY"
	childOK         = "CHILD-OK"
)

const MiB = 1 << 20

// TestUnavailable runs where there is no CUDA (no cgo, no libcuda.so.1, no
// device): every entry point answers an error wrapping ErrUnavailable and
// nothing panics.
func TestUnavailable(t *testing.T) {
	if cuda.Available() {
		t.Skip("CUDA is available here")
	}
	err := cuda.Init()
	if !errors.Is(err, cuda.ErrUnavailable) {
		t.Fatalf("Init: %v, want ErrUnavailable", err)
	}
	if !strings.HasPrefix(err.Error(), "cuda: CUDA unavailable: ") {
		t.Errorf("Init error %q lacks the prefix", err)
	}
	t.Logf("Init: %v", err)
	if !errors.Is(cuda.Init(), cuda.ErrUnavailable) {
		t.Error("second Init changed its answer")
	}
	if cuda.Library() != "" {
		t.Errorf("Library() = %q, want empty", cuda.Library())
	}

	var nilCtx *cuda.Context
	var nilStream *cuda.Stream
	mem := make([]byte, 4096)
	calls := map[string]func() error{
		"DriverVersion":    func() error { _, err := cuda.DriverVersion(); return err },
		"DeviceCount":      func() error { _, err := cuda.DeviceCount(); return err },
		"Devices":          func() error { _, err := cuda.Devices(); return err },
		"Retain":           func() error { _, err := cuda.Retain(0); return err },
		"Release":          nilCtx.Release,
		"MakeCurrent":      nilCtx.MakeCurrent,
		"HostRegister":     func() error { return nilCtx.HostRegister(mem, cuda.HostRegisterPortable) },
		"HostUnregister":   func() error { return nilCtx.HostUnregister(mem) },
		"MemAlloc":         func() error { _, err := nilCtx.MemAlloc(MiB); return err },
		"MemFree":          func() error { return nilCtx.MemFree(1) },
		"AddressRange":     func() error { _, _, err := nilCtx.AddressRange(1); return err },
		"IpcGetHandle":     func() error { _, err := nilCtx.IpcGetHandle(1); return err },
		"IpcOpen":          func() error { _, err := nilCtx.IpcOpen([cuda.IpcHandleSize]byte{}); return err },
		"IpcClose":         func() error { return nilCtx.IpcClose(1) },
		"CopyHtoD":         func() error { return nilCtx.CopyHtoD(1, mem) },
		"CopyDtoH":         func() error { return nilCtx.CopyDtoH(mem, 1) },
		"NewStream":        func() error { _, err := nilCtx.NewStream(); return err },
		"Stream.Sync":      nilStream.Sync,
		"Stream.SyncAfter": func() error { return nilStream.SyncAfter(time.Microsecond) },
		"Stream.Close":     nilStream.Close,
		"CopyHtoDAsync":    func() error { return cuda.CopyHtoDAsync(1, mem, nilStream) },
		"CopyDtoHAsync":    func() error { return cuda.CopyDtoHAsync(mem, 1, nilStream) },
		"PointerIsDevice": func() error {
			_, err := cuda.PointerIsDevice(uintptr(unsafe.Pointer(&mem[0])))
			return err
		},
	}
	for name, f := range calls {
		if err := f(); !errors.Is(err, cuda.ErrUnavailable) {
			t.Errorf("%s: %v, want ErrUnavailable", name, err)
		}
	}
	if nilCtx.Ordinal() != -1 || nilStream.Context() != nil {
		t.Error("nil Context/Stream accessors")
	}
}

// TestDiscover lists GPUs through NVML. Where NVML is missing it must say
// so with ErrUnavailable.
func TestDiscover(t *testing.T) {
	gpus, err := cuda.Discover()
	if err != nil {
		if !errors.Is(err, cuda.ErrUnavailable) {
			t.Fatalf("Discover: %v, want nil or ErrUnavailable", err)
		}
		t.Skipf("NVML unavailable: %v", err)
	}
	devs, derr := cuda.Devices()
	for _, g := range gpus {
		t.Logf("nvml %d: %q %s bus %s memory %d MiB total, %d MiB used, CUDA ordinal %d",
			g.Index, g.Name, g.UUID, g.PCIBusID, g.MemoryTotal/MiB, g.MemoryUsed/MiB, g.Ordinal)
		if g.Name == "" || !uuidRE.MatchString(g.UUID) || g.MemoryTotal == 0 {
			t.Errorf("GPU %d incomplete: %+v", g.Index, g)
		}
	}
	if derr != nil {
		return
	}
	// Every CUDA device is one of NVML's, found by UUID, at the same bus.
	for _, d := range devs {
		found := false
		for _, g := range gpus {
			if g.Ordinal == d.Ordinal {
				found = true
				if g.UUID != d.UUID || g.PCIBusID != d.PCIBusID {
					t.Errorf("ordinal %d: CUDA %s %s, NVML %s %s", d.Ordinal, d.UUID, d.PCIBusID, g.UUID, g.PCIBusID)
				}
			}
		}
		if !found {
			t.Errorf("CUDA device %d (%s) not matched by NVML", d.Ordinal, d.UUID)
		}
	}
}

var uuidRE = regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
var busRE = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$`)

// TestLibraryOverride: MOONCAKE_LIBCUDA names the only library tried, and a
// bad one makes CUDA unavailable with the path in the message (child
// process, since Init runs once per process).
func TestLibraryOverride(t *testing.T) {
	if os.Getenv(envLibraryChild) != "" {
		err := cuda.Init()
		if cuda.Available() || !errors.Is(err, cuda.ErrUnavailable) {
			t.Fatalf("Init with %s=%s: %v", cuda.LibraryEnv, os.Getenv(cuda.LibraryEnv), err)
		}
		if _, err := cuda.Retain(0); !errors.Is(err, cuda.ErrUnavailable) {
			t.Fatalf("Retain: %v", err)
		}
		fmt.Printf("%s %v\n", childOK, err)
		return
	}
	for _, tc := range []struct{ lib, want string }{
		{"/nonexistent/libcuda.so.1", "/nonexistent/libcuda.so.1"},
		{"libc.so.6", "missing symbol cuInit"}, // loads, but is no driver
	} {
		out := runChild(t, "TestLibraryOverride", envLibraryChild+"=1", cuda.LibraryEnv+"="+tc.lib)
		if haveCgo && !strings.Contains(out, tc.want) {
			t.Errorf("%s=%s: the error does not say %q:\n%s", cuda.LibraryEnv, tc.lib, tc.want, out)
		}
	}
}

// runChild re-executes the test binary to run one test with extra
// environment, and returns its output; the child must print childOK.
func runChild(t *testing.T, test string, env ...string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte(childOK)) {
		t.Fatalf("child %s: %v\n%s", test, err, out)
	}
	return string(out)
}

func needGPU(tb testing.TB) {
	tb.Helper()
	if err := cuda.Init(); err != nil {
		tb.Skipf("no GPU: %v", err)
	}
}

func retain(tb testing.TB) *cuda.Context {
	tb.Helper()
	needGPU(tb)
	c, err := cuda.Retain(0)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := c.Release(); err != nil {
			tb.Error(err)
		}
	})
	return c
}

// mmapRegion maps n bytes of anonymous memory, asking for transparent
// hugepages, and writes every page so it is present: the kind of memory
// pinned/ hands out.
func mmapRegion(tb testing.TB, n int) []byte {
	tb.Helper()
	mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		tb.Fatal(err)
	}
	_ = unix.Madvise(mem, unix.MADV_HUGEPAGE) // a speed hint; fine to fail
	for i := 0; i < n; i += 4096 {
		mem[i] = 1
	}
	tb.Cleanup(func() { _ = unix.Munmap(mem) })
	return mem
}

func register(tb testing.TB, c *cuda.Context, mem []byte) {
	tb.Helper()
	if err := c.HostRegister(mem, cuda.HostRegisterPortable); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := c.HostUnregister(mem); err != nil {
			tb.Error(err)
		}
	})
}

func alloc(tb testing.TB, c *cuda.Context, n uint64) cuda.DevicePtr {
	tb.Helper()
	p, err := c.MemAlloc(n)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := c.MemFree(p); err != nil {
			tb.Error(err)
		}
	})
	return p
}

func fill(b []byte, seed uint64) {
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), 7})
	_, _ = r.Read(b)
}

func TestDevices(t *testing.T) {
	needGPU(t)
	v, err := cuda.DriverVersion()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("libcuda %s, driver supports CUDA %d.%d", cuda.Library(), v/1000, v%1000/10)
	n, err := cuda.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	devs, err := cuda.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != n || n == 0 {
		t.Fatalf("%d devices listed, count %d", len(devs), n)
	}
	for i, d := range devs {
		t.Logf("device %d: %q %s bus %s memory %d MiB", d.Ordinal, d.Name, d.UUID, d.PCIBusID, d.MemoryBytes/MiB)
		if d.Ordinal != i || d.Name == "" || !uuidRE.MatchString(d.UUID) || !busRE.MatchString(d.PCIBusID) || d.MemoryBytes == 0 {
			t.Errorf("device %d incomplete: %+v", i, d)
		}
	}
	if _, err := cuda.Retain(n); !errors.Is(err, cuda.ErrInvalid) {
		t.Errorf("Retain(%d): %v, want ErrInvalid", n, err)
	}
	if _, err := cuda.Retain(-1); !errors.Is(err, cuda.ErrInvalid) {
		t.Errorf("Retain(-1): %v, want ErrInvalid", err)
	}
}

// TestRoundTrip: 64 MiB from registered (pinned) host memory to the device
// and back on a stream, bit-exact; then the synchronous copies from
// pageable memory, address ranges and pointer kinds.
func TestRoundTrip(t *testing.T) {
	c := retain(t)
	const n = 64 * MiB
	dptr := alloc(t, c, n)
	src, dst := mmapRegion(t, n), mmapRegion(t, n)
	fill(src, 1)
	start := time.Now()
	register(t, c, src)
	register(t, c, dst)
	t.Logf("HostRegister 2 x %d MiB: %v", n/MiB, time.Since(start))

	s, err := c.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
		if err := s.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
		if err := s.Sync(); !errors.Is(err, cuda.ErrClosed) {
			t.Errorf("Sync after Close: %v, want ErrClosed", err)
		}
		if err := s.SyncAfter(time.Microsecond); !errors.Is(err, cuda.ErrClosed) {
			t.Errorf("SyncAfter after Close: %v, want ErrClosed", err)
		}
	}()
	if s.Context() != c {
		t.Error("Stream.Context")
	}
	if err := cuda.CopyHtoDAsync(dptr, src, s); err != nil {
		t.Fatal(err)
	}
	if err := cuda.CopyDtoHAsync(dst, dptr, s); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, dst) {
		t.Fatal("async round trip through the device is not bit-exact")
	}
	// Again, waited for by sleeping first: many copies queued, waited for
	// after sleeping less than they take, as long, longer, and not at all.
	for i, d := range []time.Duration{50 * time.Microsecond, time.Millisecond, 20 * time.Millisecond, -1} {
		fill(src, uint64(3+i))
		for off := 0; off < n; off += 4 * MiB {
			if err := cuda.CopyHtoDAsync(dptr+cuda.DevicePtr(off), src[off:off+4*MiB], s); err != nil {
				t.Fatal(err)
			}
		}
		clear(dst)
		if err := cuda.CopyDtoHAsync(dst, dptr, s); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		if err := s.SyncAfter(d); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(t0); took < d {
			t.Errorf("SyncAfter(%v) returned after %v", d, took)
		}
		if !bytes.Equal(src, dst) {
			t.Fatalf("round %d: async round trip waited for by SyncAfter(%v) is not bit-exact", i, d)
		}
	}

	// Synchronous copies, pageable Go memory, at an offset inside the
	// allocation.
	small := make([]byte, MiB+123)
	fill(small, 2)
	back := make([]byte, len(small))
	off := cuda.DevicePtr(3*MiB + 5)
	if err := c.CopyHtoD(dptr+off, small); err != nil {
		t.Fatal(err)
	}
	if err := c.CopyDtoH(back, dptr+off); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(small, back) {
		t.Fatal("sync round trip is not bit-exact")
	}

	base, size, err := c.AddressRange(dptr + off)
	if err != nil {
		t.Fatal(err)
	}
	if base != dptr || size < n {
		t.Errorf("AddressRange(base+%d) = %#x, %d; want %#x, >= %d", off, base, size, dptr, n)
	}

	for _, tc := range []struct {
		name string
		addr uintptr
		want bool
	}{
		{"device", uintptr(dptr), true},
		{"device+off", uintptr(dptr + off), true},
		{"registered host", uintptr(unsafe.Pointer(&src[0])), false},
		{"pageable host", uintptr(unsafe.Pointer(&small[0])), false},
		{"null", 0, false},
	} {
		got, err := cuda.PointerIsDevice(tc.addr)
		if err != nil || got != tc.want {
			t.Errorf("PointerIsDevice(%s) = %v, %v; want %v", tc.name, got, err, tc.want)
		}
	}

	// Driver errors carry the CUresult.
	err = c.HostRegister(src, cuda.HostRegisterPortable)
	var res *cuda.Result
	if !errors.As(err, &res) || res.Code != cuda.ResultHostMemoryAlreadyRegistered || !errors.Is(err, cuda.ErrDriver) {
		t.Errorf("registering twice: %v, want CUresult %d", err, cuda.ResultHostMemoryAlreadyRegistered)
	} else {
		t.Logf("registering twice: %v", err)
	}
	if _, err := c.MemAlloc(1 << 40); !errors.Is(err, cuda.ErrOutOfMemory) {
		t.Errorf("MemAlloc(1 TiB): %v, want ErrOutOfMemory", err)
	}
	if _, err := c.MemAlloc(0); !errors.Is(err, cuda.ErrInvalid) {
		t.Errorf("MemAlloc(0): %v, want ErrInvalid", err)
	}
}

// TestReleased: a released context refuses further use; Release twice is
// harmless.
func TestReleased(t *testing.T) {
	needGPU(t)
	c, err := cuda.Retain(0)
	if err != nil {
		t.Fatal(err)
	}
	// MakeCurrent leaves the context current on this thread after Release:
	// keep the thread to this goroutine, which ends it on return.
	runtime.LockOSThread()
	if err := c.MakeCurrent(); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(); err != nil {
		t.Errorf("second Release: %v", err)
	}
	if _, err := c.MemAlloc(MiB); !errors.Is(err, cuda.ErrClosed) {
		t.Errorf("MemAlloc after Release: %v, want ErrClosed", err)
	}
	var zero cuda.Context
	if _, err := zero.MemAlloc(MiB); !errors.Is(err, cuda.ErrInvalid) {
		t.Errorf("MemAlloc on a zero Context: %v, want ErrInvalid", err)
	}
}

// TestIPC exports an allocation, has a child process open the handle, check
// the bytes and write its own, and checks them here. Opening our own handle
// in this process is refused by the driver; the result is only logged.
func TestIPC(t *testing.T) {
	c := retain(t)
	const n = 8 * MiB
	p := alloc(t, c, n)
	data := make([]byte, n)
	fill(data, 3)
	if err := c.CopyHtoD(p, data); err != nil {
		t.Fatal(err)
	}
	h, err := c.IpcGetHandle(p)
	if err != nil {
		t.Fatal(err)
	}
	if q, err := c.IpcOpen(h); err != nil {
		t.Logf("IpcOpen of our own handle, as expected: %v", err)
	} else {
		t.Logf("IpcOpen of our own handle succeeded at %#x", q)
		_ = c.IpcClose(q)
	}
	out := runChild(t, "TestIPCChild", fmt.Sprintf("%s=%s:%d:%d", envIPCChild, hex.EncodeToString(h[:]), n, 3))
	t.Logf("child:\n%s", out)
	back := make([]byte, n)
	if err := c.CopyDtoH(back, p); err != nil {
		t.Fatal(err)
	}
	fill(data, 4)
	if !bytes.Equal(back, data) {
		t.Fatal("the child's write through the IPC mapping is not visible here")
	}
}

// TestIPCChild is the child side of TestIPC.
func TestIPCChild(t *testing.T) {
	arg := os.Getenv(envIPCChild)
	if arg == "" {
		t.Skip("run by TestIPC")
	}
	parts := strings.Split(arg, ":")
	raw, err := hex.DecodeString(parts[0])
	if len(parts) != 3 || err != nil || len(raw) != cuda.IpcHandleSize {
		t.Fatalf("bad %s=%q", envIPCChild, arg)
	}
	n, _ := strconv.Atoi(parts[1])
	seed, _ := strconv.ParseUint(parts[2], 10, 64)
	c := retain(t)
	p, err := c.IpcOpen([cuda.IpcHandleSize]byte(raw))
	if err != nil {
		t.Fatal(err)
	}
	base, size, err := c.AddressRange(p)
	if err != nil || base != p || size < uint64(n) {
		t.Errorf("AddressRange of the mapping: %#x %d %v", base, size, err)
	}
	if ok, err := cuda.PointerIsDevice(uintptr(p)); !ok || err != nil {
		t.Errorf("PointerIsDevice(ipc mapping) = %v, %v", ok, err)
	}
	got, want := make([]byte, n), make([]byte, n)
	fill(want, seed)
	if err := c.CopyDtoH(got, p); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("bytes read through the IPC mapping differ")
	}
	fill(want, seed+1)
	if err := c.CopyHtoD(p, want); err != nil {
		t.Fatal(err)
	}
	if err := c.IpcClose(p); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("%s opened %d MiB at %#x\n", childOK, n/MiB, p)
}

// BenchmarkCopy measures host<->device copies of one buffer on one stream:
// mem=pinned (registered mmap memory, the line rate the transfer layer
// should reach) against mem=pageable (the same memory unregistered).
func BenchmarkCopy(b *testing.B) {
	c := retain(b)
	s, err := c.NewStream()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = s.Close() })
	for _, size := range []int{64 * MiB, 1024 * MiB} {
		host := mmapRegion(b, size)
		dev := alloc(b, c, uint64(size))
		label := fmt.Sprintf("%dMiB", size/MiB)
		if size >= 1024*MiB {
			label = fmt.Sprintf("%dGiB", size/(1024*MiB))
		}
		for _, mem := range []string{"pinned", "pageable"} {
			if mem == "pinned" {
				start := time.Now()
				if err := c.HostRegister(host, cuda.HostRegisterPortable); err != nil {
					b.Fatal(err)
				}
				b.Logf("HostRegister %s: %v", label, time.Since(start))
			}
			for _, dir := range []string{"htod", "dtoh"} {
				b.Run(fmt.Sprintf("size=%s/mem=%s/dir=%s", label, mem, dir), func(b *testing.B) {
					copyOnce := func() error {
						if dir == "htod" {
							return cuda.CopyHtoDAsync(dev, host, s)
						}
						return cuda.CopyDtoHAsync(host, dev, s)
					}
					if err := copyOnce(); err != nil { // warm up
						b.Fatal(err)
					}
					if err := s.Sync(); err != nil {
						b.Fatal(err)
					}
					b.SetBytes(int64(size))
					b.ResetTimer()
					for range b.N {
						if err := copyOnce(); err != nil {
							b.Fatal(err)
						}
						if err := s.Sync(); err != nil {
							b.Fatal(err)
						}
					}
					b.StopTimer()
					b.ReportMetric(float64(size)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
				})
			}
			if mem == "pinned" {
				if err := c.HostUnregister(host); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
}
