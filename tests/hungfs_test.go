package tests

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

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
	pub := d.path("pub")
	run(t, "mkdir", "-m", "0777", pub)
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
