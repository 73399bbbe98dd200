package tests

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// hungRoot is a file system with one file, "f", whose every flush waits
// until release closes: what a FUSE server that stops answering looks
// like to whoever closes a descriptor of it.
type hungRoot struct {
	gofs.Inode
	release chan struct{}
}

type hungFile struct {
	gofs.Inode
	release chan struct{}
}

type hungHandle struct{ release chan struct{} }

func (r *hungRoot) OnAdd(ctx context.Context) {
	ch := r.NewPersistentInode(ctx, &hungFile{release: r.release}, gofs.StableAttr{Mode: syscall.S_IFREG})
	r.AddChild("f", ch, false)
}

func (f *hungFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	return &hungHandle{f.release}, fuse.FOPEN_DIRECT_IO, 0
}

func (f *hungFile) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode, out.Size = syscall.S_IFREG|0o666, 1<<20
	return 0
}

func (h *hungHandle) Flush(ctx context.Context) syscall.Errno {
	<-h.release
	return 0
}

// TestRegisterHungFileSystem: an unprivileged client registers, as a
// buffer and as a GPU allocation's dma-buf, descriptors of a file system
// that never answers a flush (served here, by the test; the client is a
// child process). Each is refused (EINVAL) and returns: the close that
// would wait is not the request's. The mount keeps answering.
func TestRegisterHungFileSystem(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "64MiB")
	pub := d.publicDir(t)
	release := make(chan struct{})
	hung := t.TempDir()
	if err := os.Chmod(filepath.Dir(hung), 0o755); err != nil {
		t.Fatal(err)
	}
	srv, err := gofs.Mount(hung, &hungRoot{release: release}, &gofs.Options{MountOptions: fuse.MountOptions{DirectMount: true, Name: "hungfs", AllowOther: true}})
	if err != nil {
		t.Skipf("cannot mount a second FUSE file system here: %v", err)
	}
	released := false
	let := func() {
		if !released {
			released = true
			close(release)
		}
	}
	t.Cleanup(func() {
		let()
		srv.Unmount()
	})
	script := pyErrnoPrelude + `
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
from mooncake_fs import _abi
f = mc.File(sys.argv[2] + "/k", "w")
for i in range(8):
    fd = os.open(sys.argv[3] + "/f", os.O_RDWR)
    try_("buffer%d" % i, f.register, fd, 4096)
    try_("dmabuf%d" % i, f.register_cuda, bytes(64), 4096, 0, fd)
print("done", flush=True)
os._exit(0)  # its own closes of the hung files wait for the release
`
	cmd := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script, publicPythonDir(t), pub, hung)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var lines []string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if lines = append(lines, sc.Text()); sc.Text() == "done" {
			break
		}
	}
	let() // the child's exit closes its descriptors: let their flushes end
	_ = cmd.Wait()
	want := map[string]string{}
	for i := range 8 {
		want[fmt.Sprintf("buffer%d", i)], want[fmt.Sprintf("dmabuf%d", i)] = "EINVAL", "EINVAL"
	}
	checkResults(t, strings.Join(lines, "\n"), want)
	if err := os.WriteFile(d.path("after"), []byte("still here"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(d.path("after")); err != nil || string(got) != "still here" {
		t.Fatalf("after the refusals: %q, %v", got, err)
	}
	d.checkAlive(t)
}

// stallRoot is a file system with one file, "m", whose reads wait until
// release closes: its pages cannot be faulted in until then. The first
// read closes reading.
type stallRoot struct {
	gofs.Inode
	release, reading chan struct{}
	once             sync.Once
}

type stallFile struct {
	gofs.Inode
	root *stallRoot
}

const stallSize = 32 << 20

func (r *stallRoot) OnAdd(ctx context.Context) {
	ch := r.NewPersistentInode(ctx, &stallFile{root: r}, gofs.StableAttr{Mode: syscall.S_IFREG})
	r.AddChild("m", ch, false)
}

func (f *stallFile) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	return nil, 0, 0 // through the page cache: mmap works
}

func (f *stallFile) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode, out.Size = syscall.S_IFREG|0o444, stallSize
	return 0
}

func (f *stallFile) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	f.root.once.Do(func() { close(f.root.reading) })
	<-f.root.release
	n := max(0, min(int64(len(dest)), stallSize-off))
	return fuse.ReadResultData(make([]byte, n)), 0
}

// mountStalled serves a stallRoot (the test's own FUSE server) on a new
// directory. let releases its reads; the test's end does too, and then
// unmounts it.
func mountStalled(t *testing.T) (root *stallRoot, dir string, let func()) {
	root = &stallRoot{release: make(chan struct{}), reading: make(chan struct{})}
	dir = t.TempDir()
	srv, err := gofs.Mount(dir, root, &gofs.Options{MountOptions: fuse.MountOptions{DirectMount: true, Name: "stallfs", AllowOther: true}})
	if err != nil {
		t.Skipf("cannot mount a second FUSE file system here: %v", err)
	}
	var releaseOnce sync.Once
	let = func() { releaseOnce.Do(func() { close(root.release) }) }
	t.Cleanup(func() {
		let()
		srv.Unmount()
	})
	return root, dir, let
}

// TestMappedStalledFileSystem: a client's get into a mapping of a file
// whose reads never come back (another FUSE server, stalled) holds only
// that get. The copy's page faults wait on the other server; large
// copies used to wait in the engine's shared workers, so a second
// client's large get of another key waited behind them until the other
// server answered. Released, the first get finishes too.
func TestMappedStalledFileSystem(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB", "--evict", "off")
	root, stalled, let := mountStalled(t)
	tmp := t.TempDir()
	local := filepath.Join(tmp, "v")
	writeRandom(t, local, stallSize, 9)
	for _, k := range []string{"k1", "k2"} {
		run(t, daemonBin(), "put", local, d.path(k))
	}
	first := background(t, ioctlClientBin(t), "get", "--into", filepath.Join(stalled, "m"), d.path("k1"), filepath.Join(tmp, "out1"))
	// Cleanups run last first: the stalled reads are let go before the
	// client is killed and waited for (a killed client still waits for
	// the daemon's answer to its ioctl, which waits on those reads).
	t.Cleanup(let)
	first.waitOutput(t, `"step":"mapped"`)
	<-root.reading // the daemon's copy faulted on the stalled file
	// A deadline for a hang, not a speed: past it the stalled reads are
	// let go (a get waiting on them would never end, nor could its
	// client be killed) and the test fails.
	var forced atomic.Bool
	done := make(chan struct{})
	go func() {
		select {
		case <-done:
		case <-time.After(cmdTimeout / 2):
			forced.Store(true)
			let()
		}
	}()
	_, m := client(t, "get", d.path("k2"), filepath.Join(tmp, "out2"))
	close(done)
	if forced.Load() {
		t.Errorf("the other get ended only once the stalled file system answered")
	}
	if s := want(t, m, "get", "OK"); s.N != stallSize {
		t.Errorf("the other get moved %d B, want %d", s.N, stallSize)
	}
	run(t, "cmp", local, filepath.Join(tmp, "out2"))
	let()
	_, m = steps(t, first.mustWait(t))
	want(t, m, "get", "OK")
	run(t, "cmp", local, filepath.Join(tmp, "out1"))
	d.checkAlive(t)
}

// TestStopWithStalledRequest: SIGTERM while a request waits on a stalled
// file system (a get into a mapping of its file). The daemon cannot end
// that request, so it must not wait for it for ever: it exits within a
// bound, saying so, and the kernel ends the client's call; the mount is
// gone.
func TestStopWithStalledRequest(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB", "--evict", "off", "--stop-timeout", "2s")
	root, stalled, let := mountStalled(t)
	tmp := t.TempDir()
	local := filepath.Join(tmp, "v")
	writeRandom(t, local, stallSize, 9)
	run(t, daemonBin(), "put", local, d.path("k"))
	first := background(t, ioctlClientBin(t), "get", "--into", filepath.Join(stalled, "m"), d.path("k"), filepath.Join(tmp, "out"))
	t.Cleanup(let)
	first.waitOutput(t, `"step":"mapped"`)
	<-root.reading       // the daemon's copy faulted on the stalled file
	d.killed.Store(true) // it exits with an error: stop must not count that
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	// Deadlines for a hang, not speeds.
	select {
	case <-d.done:
	case <-time.After(cmdTimeout / 2):
		let() // a daemon waiting on the request exits once it ends
		<-d.done
		t.Fatalf("the daemon did not exit within %v of SIGTERM while a request was stalled", cmdTimeout/2)
	}
	if d.err == nil {
		t.Errorf("the daemon exited 0, leaving a request unfinished")
	}
	if log := d.log.String(); !strings.Contains(log, "requests stuck") {
		t.Errorf("the daemon's log does not say it left a request:\n%s", log)
	}
	select {
	case <-first.done:
	case <-time.After(cmdTimeout / 2):
		t.Fatalf("the stalled client's call did not end when the daemon exited")
	}
	if out, err := first.wait(); err == nil && strings.Contains(out, `"step":"get","ok":true`) {
		t.Errorf("the stalled get succeeded after the daemon left it: %s", out)
	}
	if mounted(d.dir) {
		t.Errorf("%s is still mounted after the daemon exited", d.dir)
	}
}

// TestStopServesOpenFiles: SIGTERM while a process keeps a file open and
// idle is no stuck request: the daemon detaches the mount and serves the
// file until it is closed, however long past its stop timeout, then
// exits 0.
func TestStopServesOpenFiles(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "64MiB", "--stop-timeout", "500ms")
	w := background(t, python, "-c", `
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"a" * (1 << 20))
print("ready", flush=True)
sys.stdin.readline()
os.write(fd, b"b" * 1000)
ok = os.pread(fd, (1 << 20) + 1000, 0) == b"a" * (1 << 20) + b"b" * 1000
os.close(fd)
print("done", "ok" if ok else "wrong", flush=True)
`, d.path("f"))
	w.waitOutput(t, "ready")
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	// Past twice the stop timeout, the daemon still serves the file.
	time.Sleep(3 * time.Second)
	if d.exited() {
		t.Fatalf("the daemon exited (%v) with a file open and no request running", d.err)
	}
	if _, err := io.WriteString(w.stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	if out := w.mustWait(t); !strings.Contains(out, "done ok") {
		t.Errorf("the writer after SIGTERM: %s", out)
	}
	select {
	case <-d.done:
	case <-time.After(cmdTimeout / 2):
		t.Fatalf("the daemon did not exit once the last file was closed")
	}
	if d.err != nil {
		t.Errorf("the daemon exited with %v, want 0", d.err)
	}
}
