package fs

import (
	"context"
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// TestRegistrationLimits: registrations are bounded per open file and
// for the whole mount, by count and by the address space they map; a
// refused one changes nothing.
func TestRegistrationLimits(t *testing.T) {
	f := &FS{opts: DefaultOptions()}
	f.opts.MaxRegistrations, f.opts.MaxRegistrationsTotal, f.opts.MaxRegisteredBytes = 2, 3, 10<<10
	a, b := &regTable{fs: f}, &regTable{fs: f}
	reg := func(n int) *registration { return &registration{mem: make([]byte, n)} }
	for i, c := range []struct {
		t    *regTable
		size int
		ok   bool
	}{
		{a, 4 << 10, true},
		{a, 1 << 10, true},
		{a, 1 << 10, false}, // a third on one file
		{b, 6 << 10, false}, // 11 KiB on the mount
		{b, 1 << 10, true},
		{b, 1 << 10, false}, // a fourth on the mount
	} {
		_, err := c.t.add(reg(c.size))
		if (err == nil) != c.ok || err != nil && !errors.Is(err, errTooManyRegs) {
			t.Errorf("registration %d (%d B): %v, want ok=%v", i, c.size, err, c.ok)
		}
	}
	if live, bytes := f.regs.live.Load(), f.regs.bytes.Load(); live != 3 || bytes != 6<<10 {
		t.Errorf("live %d, %d B after the refusals; want 3, %d B", live, bytes, 6<<10)
	}
}

// TestCUDARegistrationRefusals: a CUDA registration with flags it does
// not know, or with RegisterDmabuf and no descriptor of the caller, is
// EINVAL before any GPU is asked (the GPU host's gpucheck registers real
// dma-bufs); a descriptor that is no dma-buf is told apart.
func TestCUDARegistrationRefusals(t *testing.T) {
	fx := newFuzzFixture(t)
	me := callerCtx(os.Getpid())
	before := fx.root.fs.regs.live.Load()
	memfd, err := unix.MemfdCreate("not-a-dmabuf", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(memfd)
	for _, c := range []struct {
		a    ioctl.RegisterArg
		want syscall.Errno
	}{
		{ioctl.RegisterArg{Header: ioctl.Header{Flags: 1 << 7}, Fd: -1, Kind: ioctl.KindCUDA, Len: 4096}, syscall.EINVAL},
		{ioctl.RegisterArg{Header: ioctl.Header{Flags: ioctl.RegisterDmabuf}, Fd: -1, Kind: ioctl.KindCUDA, Len: 4096}, syscall.EINVAL},
		{ioctl.RegisterArg{Header: ioctl.Header{Flags: ioctl.RegisterDmabuf}, Fd: 1 << 20, Kind: ioctl.KindCUDA, Len: 4096}, syscall.EINVAL},
		// No dma-buf: refused before the daemon takes it.
		{ioctl.RegisterArg{Header: ioctl.Header{Flags: ioctl.RegisterDmabuf}, Fd: int32(memfd), Kind: ioctl.KindCUDA, Len: 4096}, syscall.EINVAL},
	} {
		out := make([]byte, ioctl.SizeRegisterArg)
		if _, e := fx.root.Ioctl(me, fx.dh, ioctl.CmdRegisterBuffer, 0, c.a.Marshal(), out); e != c.want {
			t.Errorf("register %+v: %v, want %v", c.a, e, c.want)
		}
	}
	if live := fx.root.fs.regs.live.Load(); live != before {
		t.Errorf("%d registrations after the refusals, %d before", live, before)
	}
	if err := checkDmabuf(memfd, 0); err == nil || !strings.Contains(err.Error(), "not a dma-buf") {
		t.Errorf("a memfd as a dma-buf: %v", err)
	}
}

// TestOpenDirsCounted: the mount counts a directory handle from its open
// to its release, once however often it is released.
func TestOpenDirsCounted(t *testing.T) {
	fx := newFuzzFixture(t)
	m := &Mount{fs: fx.root.fs}
	base := m.OpenDirs()
	fh, _, errno := fx.root.OpendirHandle(context.Background(), 0)
	if errno != 0 {
		t.Fatal(errno)
	}
	dh := fh.(*dirHandle)
	if n := m.OpenDirs(); n != base+1 {
		t.Fatalf("%d directories open with one more handle, want %d", n, base+1)
	}
	dh.Releasedir(context.Background(), 0)
	dh.Releasedir(context.Background(), 0)
	if n := m.OpenDirs(); n != base {
		t.Fatalf("%d directories open after the release, want %d", n, base)
	}
}
