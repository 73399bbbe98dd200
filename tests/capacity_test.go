package tests

import (
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestCapacityNoEvict fills a store that does not evict: dd ends with
// ENOSPC, every file committed before stays intact, and removing files
// makes room again.
func TestCapacityNoEvict(t *testing.T) {
	t.Parallel()
	const capacity, fileSize = 64 * miB, 4 * miB
	d := startDaemon(t, "--size", "64MiB", "--evict", "off")
	local := t.TempDir()
	run(t, "mkdir", d.path("fill"))
	src := func(i int) string { return filepath.Join(local, fmt.Sprintf("src-%d", i)) }
	dst := func(i int) string { return d.path("fill", fmt.Sprintf("f-%d", i)) }

	committed := -1
	for i := 0; i < 2*capacity/fileSize; i++ {
		writeRandom(t, src(i), fileSize, uint64(100+i))
		out, err := runErr("dd", "if="+src(i), "of="+dst(i), "bs=1M", "status=none")
		if err != nil {
			if !strings.Contains(out, "No space left on device") {
				t.Fatalf("dd of file %d failed, but not with ENOSPC: %v\n%s", i, err, out)
			}
			t.Logf("file %d: %s", i, strings.TrimSpace(out))
			break
		}
		committed = i
	}
	if committed == 2*capacity/fileSize-1 {
		t.Fatalf("wrote %d MiB into a %d MiB store without ENOSPC", 2*capacity/miB, capacity/miB)
	}
	if committed < capacity/fileSize/2 {
		t.Errorf("ENOSPC after only %d files of %d MiB in a %d MiB store", committed+1, fileSize/miB, capacity/miB)
	}
	for i := 0; i <= committed; i++ {
		run(t, "cmp", src(i), dst(i))
	}
	// The failed file holds what was written before ENOSPC, or nothing.
	failed := committed + 1
	if out, err := runErr("stat", "--cached=never", "-c", "%s", dst(failed)); err == nil {
		size := strings.TrimSpace(out)
		if size != "0" {
			run(t, "cmp", "-n", size, src(failed), dst(failed))
		}
	}

	st := d.quiesce(t)
	if st.Used > st.Capacity || st.Capacity != capacity {
		t.Errorf("status: used %d, capacity %d; want used <= capacity = %d", st.Used, st.Capacity, capacity)
	}
	if st.Evict.Enabled || st.Evict.Evictions != 0 {
		t.Errorf("status evict = %+v with --evict off", st.Evict)
	}

	// Room again after removing files.
	run(t, "rm", "-f", dst(0), dst(1), dst(failed))
	waitFor(t, "space freed by rm", func() (bool, string) {
		s := d.status(t)
		return s.Free >= 2*fileSize, fmt.Sprintf("%+v", s)
	})
	run(t, "dd", "if="+src(failed), "of="+dst(failed), "bs=1M", "status=none")
	run(t, "cmp", src(failed), dst(failed))
	for i := 2; i <= committed; i++ {
		run(t, "cmp", src(i), dst(i))
	}
}

// TestCapacityEvictLRU writes past the capacity of an evicting store:
// the least recently used unpinned files go, a pinned one stays, and every
// file that stays is intact.
func TestCapacityEvictLRU(t *testing.T) {
	t.Parallel()
	requireTools(t, "setfattr", "getfattr")
	const fileSize = 20 * miB
	d := startDaemon(t, "--size", "64MiB")
	local := t.TempDir()
	names := []string{"A", "B", "C", "D", "E"}
	src := map[string]string{}
	for i, n := range names {
		src[n] = filepath.Join(local, n)
		writeRandom(t, src[n], fileSize, uint64(200+i))
	}
	for _, n := range []string{"A", "B", "C"} {
		run(t, "cp", src[n], d.path(n))
	}
	// 60 MiB fit in 64 MiB, below the 95% high watermark: nothing may go.
	ls := func() map[string]bool {
		present := map[string]bool{}
		for _, n := range strings.Fields(run(t, "ls", d.dir)) {
			present[n] = true
		}
		return present
	}
	present := ls()
	if st := d.quiesce(t); st.Evict.Evictions != 0 || !present["A"] || !present["B"] || !present["C"] {
		t.Errorf("after writing A, B, C (60 MiB into 64 MiB, below the high watermark): present %v, evictions %d (%d B); want all three, no eviction",
			present, st.Evict.Evictions, st.Evict.EvictedBytes)
	}
	// Reading A leaves B the least recently used; B is pinned, so C is
	// the first to go.
	if present["A"] {
		run(t, "cmp", src["A"], d.path("A"))
	}
	run(t, "setfattr", "-n", "user.mooncake.pin", "-v", "1", d.path("B"))
	aBefore := present["A"]

	for _, n := range []string{"D", "E"} {
		run(t, "cp", src[n], d.path(n))
	}
	st := d.quiesce(t)
	present = ls()
	t.Logf("after writing D and E: present %v, status used %d evictions %d (%d B)", present, st.Used, st.Evict.Evictions, st.Evict.EvictedBytes)

	if !present["B"] {
		t.Errorf("the pinned file B was evicted")
	} else if pin := run(t, "getfattr", "--absolute-names", "--only-values", "-n", "user.mooncake.pin", d.path("B")); pin != "1" {
		t.Errorf("B: user.mooncake.pin = %q, want 1", pin)
	}
	if !present["E"] {
		t.Errorf("E, the file written last, was evicted")
	}
	if st.Evict.Evictions == 0 || st.Evict.EvictedBytes < fileSize {
		t.Errorf("status evict = %+v after writing 100 MiB into 64 MiB", st.Evict)
	}
	if present["C"] {
		t.Errorf("C, the least recently used unpinned file, survived")
	}
	if aBefore && present["C"] && !present["A"] {
		t.Errorf("A was evicted before C, which was used less recently")
	}
	if st.Used > st.Capacity {
		t.Errorf("status used %d > capacity %d", st.Used, st.Capacity)
	}
	for _, n := range names {
		if present[n] {
			run(t, "cmp", src[n], d.path(n))
		}
	}
}

// holdScript opens a file, reads it whole, prints "held <size>" and waits
// for a line on stdin; then it reads the file again through the same
// descriptor and prints "reread ok" if both reads match the source.
const holdScript = `
import os, sys
src, target = sys.argv[1], sys.argv[2]
want = open(src, "rb").read()
fd = os.open(target, os.O_RDONLY)
first = os.pread(fd, len(want) + 1, 0)
print("held", len(first), flush=True)
sys.stdin.readline()
again = os.pread(fd, len(want) + 1, 0)
os.close(fd)
print("first", "ok" if first == want else "BAD", "reread", "ok" if again == want else "BAD", flush=True)
`

// TestCapacityEvictOpen: a file held open by a reader is never evicted,
// even when it is the least recently used.
func TestCapacityEvictOpen(t *testing.T) {
	t.Parallel()
	const fileSize = 16 * miB
	d := startDaemon(t, "--size", "64MiB")
	local := t.TempDir()
	src := func(n string) string { return filepath.Join(local, n) }
	for i, n := range []string{"X", "F1", "F2", "F3", "F4", "F5"} {
		writeRandom(t, src(n), fileSize, uint64(300+i))
	}
	run(t, "cp", src("X"), d.path("X"))

	holder := background(t, python, "-c", holdScript, src("X"), d.path("X"))
	holder.waitOutput(t, "held")
	if st := d.status(t); st.OpenObjects < 1 {
		t.Errorf("status open_objects = %d while X is held open", st.OpenObjects)
	}
	// X is now the least recently used file; F1..F5 need 80 MiB more.
	for _, n := range []string{"F1", "F2", "F3", "F4", "F5"} {
		run(t, "cp", src(n), d.path(n))
	}
	st := d.status(t)
	if st.Evict.Evictions == 0 {
		t.Errorf("no evictions after writing 96 MiB into 64 MiB: %+v", st.Evict)
	}
	if out, err := runErr("stat", "--cached=never", "-c", "%s", d.path("X")); err != nil || strings.TrimSpace(out) != fmt.Sprint(fileSize) {
		t.Errorf("X, held open, is gone or changed after eviction: %v\n%s", err, out)
	}
	if _, err := io.WriteString(holder.stdin, "close\n"); err != nil {
		t.Fatal(err)
	}
	if out := holder.mustWait(t); !strings.Contains(out, "first ok reread ok") {
		t.Errorf("the holder of X read wrong bytes:\n%s", out)
	}
	// Closed and unpinned, X may go now, but while it stays it is intact.
	if out, err := runErr("cmp", src("X"), d.path("X")); err != nil && !strings.Contains(out, "No such file") {
		t.Errorf("cmp X: %v\n%s", err, out)
	}
	present := strings.Fields(run(t, "ls", d.dir))
	t.Logf("present after F1..F5: %v; evictions %d", present, st.Evict.Evictions)
	for _, n := range present {
		run(t, "cmp", src(n), d.path(n))
	}
}

// TestCapacityEvictForMetadata fills an evicting store with small files
// from a child process: their index entries reach the metadata limit (a
// sixteenth of --size, at least 16 MiB) long before their bytes fill it,
// and every put
// still lands, the oldest files evicted for room, the entries under the
// limit, the newest files intact.
func TestCapacityEvictForMetadata(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB") // 16 MiB of entries: about 54k files, 4 KiB of bytes each
	out := py(t, keysPrelude+`
n, per = 80000, 1000
failed = 0
for b in range(0, n, per):
    r = c.batch_put({f"m{b // 10000}/k{i:06d}": bytes([i % 251]) * 128 for i in range(b, b + per)}, check=False)
    failed += sum(1 for v in r.values() if v != 128)
print(f"failed={failed}")
print(f"newest_ok={c.get('m7/k079999') == bytes([79999 % 251]) * 128}")
print(f"oldest_gone={not os.path.exists(mnt + '/m0/k000000')}")
`, publicPythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"failed": "0", "newest_ok": "True", "oldest_gone": "True"})
	st := d.checkAlive(t)
	if st.Evict.Evictions == 0 || st.Metadata.Used > st.Metadata.Limit {
		t.Fatalf("evictions %d, metadata %d of %d B", st.Evict.Evictions, st.Metadata.Used, st.Metadata.Limit)
	}
	if st.Used > st.Capacity*9/10 {
		t.Errorf("%d of %d B used: the bytes, not the entries, ran out", st.Used, st.Capacity)
	}
}

// TestEvictedNames: the kernel forgets the names of files eviction takes,
// even when it may keep names an hour (--cache-timeout 1h), and an open
// that races the eviction behaves as on a file removed: O_CREAT makes the
// file anew (the kernel does not tell the daemon's OPEN of O_CREAT: a
// gone file there must answer ESTALE, for the kernel to walk the path
// again, never ENOENT), a plain open says ENOENT.
func TestEvictedNames(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "16MiB", "--cache-timeout", "1h")
	out := py(t, pyErrnoPrelude+`
import time
m = sys.argv[1]
for n in ("a", "b", "c"):
    with open(f"{m}/{n}", "wb") as f:
        f.write(b"x" * 4096)
    os.stat(f"{m}/{n}")  # the kernel keeps the name, and the inode
for i in range(8):  # 32 MiB into 16: the oldest files go first
    with open(f"{m}/big{i}", "wb") as f:
        f.write(b"y" * (4 << 20))
fd = try_("creat", os.open, f"{m}/a", os.O_RDONLY | os.O_CREAT, 0o644)
if fd is not None:
    print(f"a_size={os.fstat(fd).st_size}")
    os.close(fd)
try_("read", os.open, f"{m}/c", os.O_RDONLY)
deadline = time.time() + 30
while os.path.exists(f"{m}/b") and time.time() < deadline:
    time.sleep(0.01)
print(f"b_gone={not os.path.exists(m + '/b')}")
`, d.dir)
	checkResults(t, out, map[string]string{"creat": "OK", "a_size": "0", "read": "ENOENT", "b_gone": "True"})
	if st := d.checkAlive(t); st.Evict.Evictions == 0 {
		t.Fatalf("nothing evicted: %+v", st.Evict)
	}
	// The flag reached the kernel's settings, and the daemon has a P
	// beyond its FUSE readers (fs.spareProcs).
	var st struct {
		Fuse struct {
			EntryTimeout string `json:"entry_timeout"`
			GoProcs      int    `json:"go_procs"`
		} `json:"fuse"`
	}
	if err := json.Unmarshal([]byte(run(t, daemonBin(), "status", "--json", d.dir)), &st); err != nil {
		t.Fatal(err)
	}
	if want := max(2, min(16, runtime.NumCPU())) + 2; st.Fuse.EntryTimeout != "1h0m0s" || st.Fuse.GoProcs < want {
		t.Errorf("status fuse %+v: want entry_timeout 1h0m0s and at least %d Go procs", st.Fuse, want)
	}
}

// TestEvictedNamesBurst: more names the kernel knows evicted at once than
// the daemon queues for it to forget (4096): the rest are found by a walk
// of the names it knows, so none stays visible (--cache-timeout 1h).
func TestEvictedNamesBurst(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB", "--cache-timeout", "1h")
	out := py(t, `
import os, sys, time
m, n = sys.argv[1], 6000
os.mkdir(m + "/d")
for i in range(n):
    with open(f"{m}/d/f{i}", "wb") as f:
        f.write(b"x" * 4096)
for i in range(n):
    os.stat(f"{m}/d/f{i}")
with open(m + "/big", "wb") as f:  # evicts them all at once
    f.write(b"y" * (56 << 20))
deadline = time.time() + 30
while True:
    listed = set(os.listdir(m + "/d"))
    seen = sum(1 for i in range(n) if f"f{i}" not in listed and os.path.exists(f"{m}/d/f{i}"))
    if seen == 0 or time.time() > deadline:
        break
    time.sleep(0.05)
print(f"evicted={n - len(listed) >= 4097}")
print(f"still_seen={seen}")
`, d.dir)
	checkResults(t, out, map[string]string{"evicted": "True", "still_seen": "0"})
}

// TestCreateWhileEvictingMetadata: processes creating files in one
// directory past the metadata bound, so that creates, which the kernel
// serves holding the directory's lock, evict files the kernel knows in
// it, whose names the daemon then has the kernel forget (which takes that
// lock): every create ends, and the mount lives. (A build that told the
// kernel from the evicting goroutine hung this way under a review
// helper's heavier load: 100000 creates of short names.)
func TestCreateWhileEvictingMetadata(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB") // 16 MiB of entries: about 32k files of names this long, 128 MiB of bytes
	run(t, "mkdir", d.path("d"))
	var procs []*bg
	for w := range 4 {
		procs = append(procs, background(t, python, "-c", `
import os, sys
m, w = sys.argv[1], sys.argv[2]
for i in range(10000):
    fd = os.open(f"{m}/d/w{w}_{i:06d}_" + "n" * 200, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"z" * 128)
    os.close(fd)
print("done", flush=True)
`, d.dir, fmt.Sprint(w)))
	}
	for _, p := range procs {
		// A bound for a hang, not a timing: all the other tests may be
		// running beside these 40000 creates.
		select {
		case <-p.done:
		case <-time.After(5 * time.Minute):
			t.Fatalf("creators still running after 5 minutes: the mount hangs?\n%s", p.out.String())
		}
		if out := p.out.String(); !strings.Contains(out, "done") {
			t.Fatalf("a creator failed (%v):\n%s", p.err, out)
		}
	}
	if st := d.checkAlive(t); st.Evict.Evictions == 0 {
		t.Fatalf("no file evicted for metadata: %+v", st.Evict)
	}
}
