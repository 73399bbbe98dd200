package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// TestRegistrationLimits: registrations are bounded per open file and
// for the whole mount, by count and by the address space they map; a
// refused one changes nothing.
func TestRegistrationLimits(t *testing.T) {
	f := &FS{opts: DefaultOptions()}
	f.opts.MaxRegistrations, f.opts.MaxRegistrationsTotal, f.opts.MaxRegisteredBytes = 2, 3, 10<<10
	f.initCounts()
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
		_, err := c.t.add(0, reg(c.size))
		if (err == nil) != c.ok || err != nil && !errors.Is(err, errTooManyRegs) {
			t.Errorf("registration %d (%d B): %v, want ok=%v", i, c.size, err, c.ok)
		}
	}
	if live, bytes := f.regs.live.count(), f.regs.bytes.count(); live != 3 || bytes != 6<<10 {
		t.Errorf("live %d, %d B after the refusals; want 3, %d B", live, bytes, 6<<10)
	}
	// A user but root holds a quarter of the mount's registrations and
	// of their bytes, rounded down (at least one).
	f.opts.MaxRegistrationsTotal, f.opts.MaxRegisteredBytes = 8, 16<<10
	f.initCounts()
	c := &regTable{fs: f}
	id, err := c.add(1000, reg(3<<10))
	if err != nil {
		t.Fatalf("user 1000 within its share: %v", err)
	}
	if _, err := c.add(1000, reg(2<<10)); !errors.Is(err, errTooManyRegs) {
		t.Errorf("user 1000 past its 4 KiB of bytes: %v, want EMFILE", err)
	}
	if _, err := c.add(1001, reg(4<<10)); err != nil {
		t.Errorf("user 1001 while 1000 holds its share: %v", err)
	}
	if err := c.remove(id); err != nil {
		t.Fatal(err)
	}
	d := &regTable{fs: f}
	for i := range 2 {
		if _, err := d.add(1000, reg(1)); err != nil {
			t.Fatalf("user 1000's registration %d after a removal: %v", i, err)
		}
	}
	if _, err := d.add(1000, reg(1)); !errors.Is(err, errTooManyRegs) {
		t.Errorf("user 1000's third registration of 8: %v, want EMFILE", err)
	}
	c.closeAll()
	d.closeAll()
	if live, bytes := f.regs.live.count(), f.regs.bytes.count(); live != 0 || bytes != 0 {
		t.Errorf("live %d, %d B after every file closed", live, bytes)
	}
}

// TestCUDARegistrationRefusals: a CUDA registration with flags it does
// not know, or with RegisterDmabuf and no descriptor of the caller, is
// EINVAL before any GPU is asked (the GPU host's gpucheck registers real
// dma-bufs); a descriptor that is no dma-buf is told apart.
func TestCUDARegistrationRefusals(t *testing.T) {
	fx := newFuzzFixture(t)
	me := callerCtx(os.Getpid())
	before := fx.root.fs.regs.live.count()
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
	if live := fx.root.fs.regs.live.count(); live != before {
		t.Errorf("%d registrations after the refusals, %d before", live, before)
	}
	if err := checkDmabuf(memfd, 0); err == nil || !strings.Contains(err.Error(), "not a dma-buf") {
		t.Errorf("a memfd as a dma-buf: %v", err)
	}
}

// testDirHandle opens a directory handle of n, as OpendirHandle does.
func testDirHandle(t testing.TB, n *node) *dirHandle {
	t.Helper()
	h, errno := newDirHandle(n, 0)
	if errno != 0 {
		t.Fatalf("open directory: %v", errno)
	}
	return h
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

// TestDirHandlePages: an open directory lists its entries a page at a
// time (".", "..", then every child once), holds at most one page of
// them, lists from any offset after a Seekdir as it would have
// continued.
func TestDirHandlePages(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	const n = 3*dirPage + 17
	_, h := subdirOn(t, fx, "big")
	var entries []batchEntry
	for i := range n {
		entries = append(entries, batchEntry{key: fmt.Sprintf("big/k%04d", i), data: []byte("v")})
	}
	for i := 0; i < n; i += ioctl.MaxBatch {
		for _, r := range runBatch(t, fx, true, entries[i:min(n, i+ioctl.MaxBatch)]) {
			if r != 1 {
				t.Fatalf("put: %d", r)
			}
		}
	}
	defer h.Releasedir(ctx, 0)
	read := func() []string {
		var names []string
		for {
			e, errno := h.Readdirent(ctx)
			if errno != 0 {
				t.Fatal(errno)
			}
			if len(h.page) > dirPage {
				t.Fatalf("the handle holds %d entries, a page is %d", len(h.page), dirPage)
			}
			if e == nil {
				return names
			}
			names = append(names, e.Name)
		}
	}
	all := read()
	if len(all) != n+2 || all[0] != "." || all[1] != ".." {
		t.Fatalf("%d entries (%v...), want %d", len(all), all[:min(3, len(all))], n+2)
	}
	seen := map[string]bool{}
	for _, name := range all[2:] {
		if seen[name] || !strings.HasPrefix(name, "k") {
			t.Fatalf("entry %q twice or foreign", name)
		}
		seen[name] = true
	}
	for _, off := range []uint64{0, 1, 2, 5, dirPage + 2, 2*dirPage + 1, n + 2, n + 10} {
		if errno := h.Seekdir(ctx, off); errno != 0 {
			t.Fatal(errno)
		}
		got := read()
		if want := all[min(int(off), len(all)):]; !slices.Equal(got, want) {
			t.Fatalf("from offset %d: %d entries, want %d", off, len(got), len(want))
		}
	}
}

// TestOpenShare: open directories count with the open files against the
// mount's bound, and a user other than root holds at most a share of it:
// past it that user gets ENFILE while root and other users still open;
// a handle released (once, however often released) gives its place back.
func TestOpenShare(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	m := &Mount{fs: fx.root.fs}
	open, _ := m.OpenFiles()
	opens := &fx.root.fs.opens
	opens.total, opens.perUser = int(open)+6, 2
	as := func(uid uint32) context.Context { return callerAs(os.Getpid(), uid, uid) }
	openAs := func(uid uint32) (*dirHandle, syscall.Errno) {
		fh, _, errno := fx.root.OpendirHandle(as(uid), 0)
		if errno != 0 {
			return nil, errno
		}
		return fh.(*dirHandle), 0
	}
	var held []*dirHandle
	hold := func(uid uint32, when string) {
		t.Helper()
		h, errno := openAs(uid)
		if errno != 0 {
			t.Fatalf("user %d %s: %v", uid, when, errno)
		}
		held = append(held, h)
	}
	hold(1000, "within its share")
	hold(1000, "within its share")
	if _, errno := openAs(1000); errno != syscall.ENFILE {
		t.Fatalf("user 1000 past its share: %v, want ENFILE", errno)
	}
	// A create past the share makes nothing.
	if _, _, _, errno := fx.root.Create(as(1000), "lock", syscall.O_CREAT|syscall.O_EXCL|syscall.O_RDWR, 0o644, &fuse.EntryOut{}); errno != syscall.ENFILE {
		t.Fatalf("user 1000 creating past its share: %v, want ENFILE", errno)
	}
	if _, err := fx.st.Stat(ctx, "lock"); err == nil {
		t.Fatal("a create refused past the share made its file")
	}
	for _, uid := range []uint32{1001, 0, 0} {
		hold(uid, "while 1000 holds its share")
	}
	// Files count with the directories: user 1001 holds one of each.
	fh, err := fx.file.open(as(1001), "f", nil, syscall.O_RDONLY)
	if err != nil {
		t.Fatalf("a file of user 1001 within its share: %v", err)
	}
	if _, err := fx.file.open(as(1001), "f", nil, syscall.O_RDONLY); toErrno(err) != syscall.ENFILE {
		t.Fatalf("a file of user 1001 past its share: %v, want ENFILE", err)
	}
	fx.file.Release(ctx, fh)
	// The mount's bound: root too.
	hold(0, "within the mount's bound")
	if _, errno := openAs(0); errno != syscall.ENFILE {
		t.Fatalf("past the mount's bound: %v, want ENFILE", errno)
	}
	held[0].Releasedir(ctx, 0)
	held[0].Releasedir(ctx, 0) // once counted, once given back
	held = held[1:]
	hold(1000, "after a release")
	for _, h := range held {
		h.Releasedir(ctx, 0)
	}
	if now, _ := m.OpenFiles(); now != open {
		t.Fatalf("%d open after every release, %d before", now, open)
	}
}

// TestDirHandleRenamed: a directory renamed while a handle lists it is
// listed whole and alone. The store has it at its new key from the
// rename's commit, the tree (the handle's key) only once the kernel's
// rename moves the node: pages read in between, when the old key is empty
// or holds another directory, are read again once the node has moved.
// The page's names are copies, not parts of their objects' keys.
func TestDirHandleRenamed(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	mk := func(dir, prefix string, n int) {
		var es []batchEntry
		for i := range n {
			es = append(es, batchEntry{key: fmt.Sprintf("%s/%s%03d", dir, prefix, i), data: []byte("v")})
		}
		for i := 0; i < n; i += ioctl.MaxBatch {
			runBatch(t, fx, true, es[i:min(n, i+ioctl.MaxBatch)])
		}
	}
	a, h := subdirOn(t, fx, "A")
	defer h.Releasedir(ctx, 0)
	subdirOn(t, fx, "C")
	mk("A", "a", 2*dirPage+5)
	mk("C", "c", dirPage)
	first, errno := h.Readdirent(ctx) // ".": no page yet
	if errno != 0 || first.Name != "." {
		t.Fatalf("first entry %v, %v", first, errno)
	}
	// A to T and C to A in the store; the tree follows a moment later.
	if err := fx.st.Rename(ctx, "A", "T", 0); err != nil {
		t.Fatal(err)
	}
	if err := fx.st.Rename(ctx, "C", "A", 0); err != nil {
		t.Fatal(err)
	}
	moved := make(chan struct{})
	go func() {
		defer close(moved)
		time.Sleep(2 * time.Millisecond)
		fx.root.MvChild("A", &fx.root.Inode, "T", true)
	}()
	var names []string
	for {
		e, errno := h.Readdirent(ctx)
		if errno != 0 {
			t.Fatal(errno)
		}
		if e == nil {
			break
		}
		if e.Name != ".." {
			names = append(names, e.Name)
		}
		for _, p := range h.page {
			o, err := fx.st.Lookup(ctx, "T/"+p.Name)
			if err != nil {
				t.Fatal(err)
			}
			if k := unsafe.StringData(o.Key); uintptr(unsafe.Pointer(unsafe.StringData(p.Name))) >= uintptr(unsafe.Pointer(k)) &&
				uintptr(unsafe.Pointer(unsafe.StringData(p.Name))) < uintptr(unsafe.Pointer(k))+uintptr(len(o.Key)) {
				t.Fatalf("entry %q is a part of its object's key", p.Name)
			}
		}
	}
	<-moved
	if k, _ := a.key(); k != "T" {
		t.Fatalf("the node is at %q", k)
	}
	if len(names) != 2*dirPage+5 {
		t.Fatalf("%d entries of the renamed directory (%v...), want %d", len(names), names[:min(3, len(names))], 2*dirPage+5)
	}
	for _, n := range names {
		if !strings.HasPrefix(n, "a") {
			t.Fatalf("entry %q of another directory", n)
		}
	}
}
