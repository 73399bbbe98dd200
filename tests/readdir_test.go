package tests

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// direntAt is one entry of getdents64: its name and the offset after it.
type direntAt struct {
	name string
	off  int64
}

// getdents reads the rest of directory fd with buffers of bufSize bytes.
func getdents(t *testing.T, fd, bufSize int) []direntAt {
	t.Helper()
	var out []direntAt
	buf := make([]byte, bufSize)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			t.Fatalf("getdents: %v", err)
		}
		if n == 0 {
			return out
		}
		for b := buf[:n]; len(b) > 0; {
			// linux_dirent64: ino u64, off s64, reclen u16, type u8, name.
			off := int64(binary.LittleEndian.Uint64(b[8:]))
			reclen := int(binary.LittleEndian.Uint16(b[16:]))
			name := b[19:reclen]
			out = append(out, direntAt{string(name[:bytes.IndexByte(name, 0)]), off})
			b = b[reclen:]
		}
	}
}

// vmRSS returns the resident memory of process pid, in bytes.
func vmRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmRSS:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// TestReaddirLarge: a directory of 20000 files lists every one once
// through readdir, page after page of small getdents buffers; an lseek
// to any offset getdents gave lists on from that entry; and 200 open
// handles in the middle of its listing hold a page each, not the
// directory: the daemon's memory does not grow by their listings (before,
// each held all 20000 names, about 2 MB).
func TestReaddirLarge(t *testing.T) {
	d := startDaemon(t, "--size", "256MiB")
	dir := filepath.Join(d.dir, "big")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := ioctl.OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const n = 20000
	var want []string
	for i := 0; i < n; i += 1024 {
		var items []ioctl.BatchItem
		for k := i; k < min(n, i+1024); k++ {
			name := fmt.Sprintf("a-file-with-a-longer-name-%06d", k)
			items = append(items, ioctl.BatchItem{Key: name, Data: []byte{byte(k)}})
			want = append(want, name)
		}
		res, err := f.BatchPut(items)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range res {
			if r.Err != nil {
				t.Fatal(r.Err)
			}
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	if !slices.Equal(got, want) { // ReadDir sorts; want is in order
		t.Fatalf("ReadDir: %d names, want %d", len(got), len(want))
	}

	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	all := getdents(t, fd, 512)
	if len(all) != n+2 {
		t.Fatalf("getdents: %d entries, want %d", len(all), n+2)
	}
	seen := map[string]bool{}
	for _, e := range all {
		if seen[e.name] {
			t.Fatalf("%q listed twice", e.name)
		}
		seen[e.name] = true
	}
	for _, i := range []int{0, 1, 2, 100, 129, 5000, n - 1, n + 1} {
		if _, err := unix.Seek(fd, all[i].off, 0); err != nil {
			t.Fatal(err)
		}
		rest := getdents(t, fd, 1024)
		if !slices.Equal(rest, all[i+1:]) {
			t.Fatalf("after an lseek to entry %d's offset: %d entries, want %d", i, len(rest), len(all[i+1:]))
		}
	}

	pid := d.cmd.Process.Pid
	before := vmRSS(t, pid)
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	buf := make([]byte, 512)
	for range 200 {
		fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			t.Fatal(err)
		}
		fds = append(fds, fd)
		if _, err := unix.Getdents(fd, buf); err != nil {
			t.Fatal(err)
		}
	}
	if grew := vmRSS(t, pid) - before; grew > 100<<20 {
		t.Fatalf("200 open listings of %d names grew the daemon by %d MiB", n, grew>>20)
	}
	st := d.status(t)
	if st.OpenDirs < 200 || st.OpenFiles.Used < 200 {
		t.Fatalf("status with 200 directories open: %d directories, %d open", st.OpenDirs, st.OpenFiles.Used)
	}
}

// TestOpenShare: with --max-open 40, a user other than root holds at most
// 10 open files and directories of the mount (ENFILE past them, through
// the kernel), while root goes on opening; a --max-open below 4 is
// refused with a clear error. An O_RDONLY|O_TRUNC open refused so leaves
// its file as it was (it emptied it first).
func TestOpenShare(t *testing.T) {
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "64MiB", "--max-open", "40")
	kept := d.path("kept")
	if err := os.WriteFile(kept, []byte("kept"), 0o666); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(kept, 0o666); err != nil {
		t.Fatal(err)
	}
	script := `
import os, sys
fds = []
try:
    while len(fds) < 100:
        fds.append(os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY))
except OSError as e:
    print(len(fds), e.errno, flush=True)
try:
    os.open(sys.argv[2], os.O_RDONLY | os.O_TRUNC)
    print(0, flush=True)
except OSError as e:
    print(e.errno, flush=True)
sys.stdin.read()
`
	cmd := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script, d.dir, kept)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		in.Close()
		_ = cmd.Wait()
	}()
	var held, errno int
	if _, err := fmt.Fscan(out, &held, &errno); err != nil {
		t.Fatalf("the unprivileged opener: %v", err)
	}
	if held != 10 || errno != int(unix.ENFILE) {
		t.Fatalf("user 65534 held %d and got errno %d; want 10, then ENFILE", held, errno)
	}
	var truncErr int
	if _, err := fmt.Fscan(out, &truncErr); err != nil {
		t.Fatalf("the unprivileged opener: %v", err)
	}
	if got, err := os.ReadFile(kept); truncErr != int(unix.ENFILE) || string(got) != "kept" {
		t.Errorf("O_RDONLY|O_TRUNC open past the share: errno %d, the file reads %q, %v after; want ENFILE and %q", truncErr, got, err, "kept")
	}
	var fds []int
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	for range 5 {
		fd, err := unix.Open(d.dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			t.Fatalf("root while user 65534 holds its share: %v", err)
		}
		fds = append(fds, fd)
	}
	if out, err := runErr(daemonBin(), "mount", "--max-open", "2", newMountpoint(t)); err == nil || !strings.Contains(out, "--max-open 2") {
		t.Fatalf("--max-open 2: %v\n%s", err, out)
	}
}
