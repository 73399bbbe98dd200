package tests

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestCopyLarge copies a 256 MiB random file in and out with cp.
func TestCopyLarge(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "512MiB")
	local := t.TempDir()
	src, back := filepath.Join(local, "src"), filepath.Join(local, "back")
	const size = 256 * miB
	writeRandom(t, src, size, 1)

	run(t, "cp", src, d.path("big"))
	run(t, "cmp", src, d.path("big"))
	run(t, "cp", d.path("big"), back)
	run(t, "cmp", src, back)
	if got := strings.TrimSpace(run(t, "stat", "-c", "%s", d.path("big"))); got != strconv.Itoa(size) {
		t.Errorf("stat size = %s, want %d", got, size)
	}
	if st := d.quiesce(t); st.Used < size || st.Used > st.Capacity {
		t.Errorf("status used = %d, want in [%d, capacity %d]", st.Used, size, st.Capacity)
	}
}

// TestPOSIX runs the tools people use on files against one mount; each
// subtest works in its own directory.
func TestPOSIX(t *testing.T) {
	t.Parallel()
	const capacity = 256 * miB
	d := startDaemon(t, "--size", "256MiB")
	for _, c := range []struct {
		name string
		fn   func(t *testing.T, d *daemon, dir string)
	}{
		{"DD", testDD},
		{"RandomOps", testRandomOps},
		{"Mmap", testMmap},
		{"TarAndRemove", testTarAndRemove},
		{"Rsync", testRsync},
		{"Rename", testRename},
		{"RenameOverOpen", testRenameOverOpen},
		{"ConcurrentWritersReaders", testConcurrentWritersReaders},
		{"StatUtime", testStatUtime},
		{"Permissions", testPermissions},
		{"Ls", testLs},
		{"Statfs", func(t *testing.T, d *daemon, dir string) { testStatfs(t, d, capacity) }},
		{"Xattrs", testXattrs},
		{"RewriteWhileHeld", testRewriteWhileHeld},
	} {
		t.Run(c.name, func(t *testing.T) {
			d.checkAlive(t)
			dir := d.path(c.name)
			run(t, "mkdir", dir)
			c.fn(t, d, dir)
			d.checkAlive(t)
		})
	}
}

// testRewriteWhileHeld: a descriptor opened read-write and kept open
// without writing (a lock file, a process that may write later) while
// others rewrite the file (O_TRUNC), append to it and truncate it (also
// truncate(2) by path, which went into the holder's draft unpublished,
// and a rewrite after it was lost), then a write through the held
// descriptor. Each reader sees what the same
// commands leave on the local file system. The held descriptor's draft
// stayed on the version it opened: the rewrite was hidden from readers,
// and the append's close published the old content plus the append.
func testRewriteWhileHeld(t *testing.T, d *daemon, dir string) {
	script := `f=$1/held
echo old > "$f"
exec 3<>"$f"
echo NEWER > "$f"; printf '%s|' "$(cat "$f")"
echo app >> "$f"; printf '%s|' "$(cat "$f")"
echo NEW2 > "$f"; truncate -s 2 "$f"; printf '%s|' "$(cat "$f")"
printf X >&3; printf '%s|' "$(cat "$f")"
exec 3>&-; printf '%s|' "$(cat "$f")"
echo init > "$f"
exec 3<>"$f"
"$2" -c 'import os, sys; os.truncate(sys.argv[1], 2)' "$f"; printf '%s|' "$(cat "$f")"
echo X > "$f"; printf '%s|' "$(cat "$f")"
exec 3>&-; printf '%s|' "$(cat "$f")"`
	requireTools(t, python)
	want := sh(t, script, t.TempDir(), python)
	if got := sh(t, script, dir, python); got != want {
		t.Fatalf("readers saw %q; the local file system gives %q", got, want)
	}
}

// testDD writes and reads back with dd at 4 KiB and 1 MiB blocks (the
// size is not a multiple of either), then patches in place and appends.
func testDD(t *testing.T, d *daemon, dir string) {
	local := t.TempDir()
	src := filepath.Join(local, "src")
	writeRandom(t, src, 8*miB+1234, 2)
	for _, bs := range []string{"4k", "1M"} {
		f, back := filepath.Join(dir, "f-"+bs), filepath.Join(local, "back-"+bs)
		run(t, "dd", "if="+src, "of="+f, "bs="+bs, "status=none")
		run(t, "dd", "if="+f, "of="+back, "bs="+bs, "status=none")
		run(t, "cmp", src, back)
		run(t, "cmp", src, f)
	}

	// The same edits on a local model and on the mounted file.
	patch, model := filepath.Join(local, "patch"), filepath.Join(local, "model")
	writeRandom(t, patch, 64*kiB+17, 3)
	run(t, "cp", src, model)
	f := filepath.Join(dir, "f-4k")
	for _, args := range [][]string{
		{"bs=4k", "seek=3", "conv=notrunc"},       // overwrite in the middle
		{"bs=1M", "oflag=append", "conv=notrunc"}, // append
		{"bs=4k", "seek=4096"},                    // truncate to 16 MiB, then write past the old end
	} {
		for _, out := range []string{model, f} {
			run(t, "dd", append([]string{"if=" + patch, "of=" + out, "status=none"}, args...)...)
		}
		run(t, "cmp", model, f)
	}
}

// randomOpsScript applies the same random pwrite/ftruncate/truncate/fsync
// operations to a local model file and to the mounted file, reopening both
// with O_RDWR between batches, and compares reads, sizes and (after every
// close or fsync) the whole content as a fresh reader sees it.
const randomOpsScript = `
import os, random, sys
seed, model, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
print("seed", seed, flush=True)
rng = random.Random(seed)
MAX = 6 << 20
hist = []
def fail(msg):
    print("FAIL:", msg)
    print("seed", seed, "last operations:")
    for h in hist[-30:]:
        print("  ", h)
    sys.exit(1)
def whole(p):
    with open(p, "rb") as f:
        return f.read()
for p in (model, target):
    os.close(os.open(p, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644))
size, nops = 0, 0
for batch in range(24):
    fds = [os.open(p, os.O_RDWR) for p in (model, target)]
    sizes = [os.fstat(fd).st_size for fd in fds]
    if sizes != [size, size]:
        fail(f"batch {batch}: sizes after reopen {sizes}, want {size}")
    for i in range(rng.randint(4, 24)):
        nops += 1
        r = rng.random()
        if r < 0.6:
            off = rng.randint(0, min(size + (256 << 10), MAX - 1))
            n = rng.choice([1, 511, 4095, 4096, 4097, 65536, 131072, rng.randint(1, 400000)])
            n = max(1, min(n, MAX - off))
            data = rng.randbytes(n)
            hist.append(f"batch {batch}: pwrite off={off} n={n}")
            for fd in fds:
                w = os.pwrite(fd, data, off)
                if w != n:
                    fail(f"short pwrite: {w} of {n}")
            size = max(size, off + n)
        elif r < 0.72:
            ns = rng.choice([0, rng.randint(0, size), size + rng.randint(1, 300000), rng.randint(0, MAX)])
            hist.append(f"batch {batch}: ftruncate {ns}")
            for fd in fds:
                os.ftruncate(fd, ns)
            size = ns
        elif r < 0.8:
            ns = rng.randint(0, size + 100000)
            hist.append(f"batch {batch}: truncate(path) {ns} with the file open")
            for p in (model, target):
                os.truncate(p, ns)
            size = ns
        elif r < 0.85:
            hist.append(f"batch {batch}: fsync")
            os.fsync(fds[1])
            if whole(target) != whole(model):
                fail("a new reader after fsync does not see the model's content")
        else:
            off = rng.randint(0, size + 10)
            n = rng.randint(1, 1 << 20)
            hist.append(f"batch {batch}: pread off={off} n={n}")
            a, b = os.pread(fds[0], n, off), os.pread(fds[1], n, off)
            if a != b:
                fail(f"pread off={off} n={n}: got {len(b)} B, model {len(a)} B, contents differ")
        got = os.fstat(fds[1]).st_size
        if got != size:
            fail(f"fstat size {got}, model {size}")
    for fd in fds:
        os.close(fd)
    if whole(target) != whole(model):
        fail(f"after the close of batch {batch}, a new reader does not see the model's content")
print("ops", nops, "final size", size)
`

// testRandomOps runs randomOpsScript with a fixed seed (override with
// MOONCAKE_E2E_SEED) and compares the files with cmp at the end.
func testRandomOps(t *testing.T, d *daemon, dir string) {
	seed := int64(20261129)
	if s := os.Getenv("MOONCAKE_E2E_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseInt(s, 10, 64); err != nil {
			t.Fatalf("MOONCAKE_E2E_SEED=%q: %v", s, err)
		}
	}
	t.Logf("seed %d (set MOONCAKE_E2E_SEED to change it)", seed)
	model, target := filepath.Join(t.TempDir(), "model"), filepath.Join(dir, "target")
	out := py(t, randomOpsScript, strconv.FormatInt(seed, 10), model, target)
	t.Log(strings.TrimSpace(out))
	run(t, "cmp", model, target)
}

const mmapScript = `
import mmap, random, sys
import numpy as np
src, target = sys.argv[1], sys.argv[2]
want = open(src, "rb").read()
with open(target, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if len(m) != len(want):
        sys.exit(f"mmap length {len(m)}, want {len(want)}")
    if m[:] != want:
        first = next(i for i in range(len(want)) if m[i] != want[i])
        sys.exit(f"mmap content differs from byte {first}")
    rng = random.Random(7)
    for _ in range(300):
        off = rng.randrange(len(want))
        n = rng.randint(1, 300000)
        if m[off:off + n] != want[off:off + n]:
            sys.exit(f"mmap slice [{off}:{off + n}] differs")
    m.close()
a = np.memmap(target, dtype=np.uint8, mode="r")
b = np.fromfile(src, dtype=np.uint8)
if a.shape != b.shape or not np.array_equal(a, b):
    sys.exit("numpy.memmap content differs")
n4 = len(want) // 4
w = np.memmap(target, dtype="<u4", mode="r", shape=(n4,))
if not np.array_equal(w, np.frombuffer(want[:4 * n4], dtype="<u4")):
    sys.exit("numpy.memmap <u4 view differs")
print("ok", len(want))
`

// testMmap reads a mounted file through mmap.mmap and numpy.memmap.
func testMmap(t *testing.T, d *daemon, dir string) {
	requireNumpy(t)
	src := filepath.Join(t.TempDir(), "src")
	writeRandom(t, src, 5*miB+123, 4)
	target := filepath.Join(dir, "mapped")
	run(t, "cp", src, target)
	py(t, mmapScript, src, target)
}

// treeFile is one file of a test tree; dirs are implied, plus the empty
// ones listed in treeEmptyDirs.
type treeFile struct {
	path string
	size int64
	mode os.FileMode
}

var treeFiles = []treeFile{
	{"zero", 0, 0o644},
	{"one", 1, 0o644},
	{"mib", miB, 0o644},
	{"exec.sh", 50, 0o755},
	{"private", 10, 0o600},
	{"with space/file name.txt", 100, 0o644},
	{"ünïcødé.bin", 333, 0o644},
	{"a/page", 4096, 0o644},
	{"a/page-1", 4095, 0o644},
	{"a/page+1", 4097, 0o644},
	{"a/b/odd", 65537, 0o640},
	{"a/b/empty-file", 0, 0o644},
	{"a/b/c/big", 3*miB + 5, 0o644},
}

var treeEmptyDirs = []string{"empty", "nested/empty/inner", "a/b/c/leaf"}

// makeTree builds the test tree under root on local disk, with fixed file
// mtimes so that tools that keep them can be checked.
func makeTree(t *testing.T, root string, seed uint64) {
	t.Helper()
	for i, f := range treeFiles {
		p := filepath.Join(root, f.path)
		writeRandom(t, p, f.size, seed*1000+uint64(i))
		if err := os.Chmod(p, f.mode); err != nil {
			t.Fatal(err)
		}
		mt := time.Unix(1500000000+int64(i)*3600, 0)
		if err := os.Chtimes(p, mt, mt); err != nil {
			t.Fatal(err)
		}
	}
	for _, dir := range treeEmptyDirs {
		if err := os.MkdirAll(filepath.Join(root, dir), 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// treeListing describes a tree as stat sees it, bypassing the kernel's
// attribute cache: every entry with its type and mode, files with their
// size. treeTimes lists the file mtimes.
func treeListing(t *testing.T, root string) string {
	t.Helper()
	return sh(t, `cd "$1" && {
find . -mindepth 1 -type d -exec stat --cached=never -c '%n|%F|%a' {} +
find . -type f -exec stat --cached=never -c '%n|%F|%a|%s' {} +
} | LC_ALL=C sort`, root)
}

func treeTimes(t *testing.T, root string) string {
	t.Helper()
	return sh(t, `cd "$1" && find . -type f -exec stat --cached=never -c '%n %Y' {} + | LC_ALL=C sort`, root)
}

// compareTrees runs diff -r and compares the listings and the mtimes.
func compareTrees(t *testing.T, want, got string) {
	t.Helper()
	run(t, "diff", "-r", want, got)
	if a, b := treeListing(t, want), treeListing(t, got); a != b {
		t.Errorf("types, modes or sizes under %s differ from %s:\n--- want\n%s--- got\n%s", got, want, a, b)
	}
	if a, b := treeTimes(t, want), treeTimes(t, got); a != b {
		t.Errorf("file mtimes under %s differ from %s (see StatUtime):\n--- want\n%s--- got\n%s", got, want, a, b)
	}
}

// testTarAndRemove extracts a tree with tar, compares it, removes it with
// rm -r and checks that nothing is left: no entry, no bytes, no object.
func testTarAndRemove(t *testing.T, d *daemon, dir string) {
	src := filepath.Join(t.TempDir(), "tree")
	makeTree(t, src, 5)
	before := d.quiesce(t)

	dst := filepath.Join(dir, "tree")
	sh(t, `mkdir "$2" && tar -C "$1" -cf - . | tar -C "$2" -xpf -`, src, dst)
	compareTrees(t, src, dst)

	run(t, "rm", "-r", dst)
	if out, err := runErr("ls", "-A", dir); err != nil || strings.TrimSpace(out) != "" {
		t.Errorf("ls -A %s after rm -r = %q, %v; want empty", dir, out, err)
	}
	if out, err := runErr("stat", dst); err == nil || !strings.Contains(out, "No such file") {
		t.Errorf("stat %s after rm -r: %v\n%s", dst, err, out)
	}
	waitFor(t, "used and objects back to their values before the tree", func() (bool, string) {
		s := d.status(t)
		return s.OpenObjects == 0 && s.Used == before.Used && s.Objects == before.Objects,
			fmt.Sprintf("used %d objects %d open %d, before: used %d objects %d", s.Used, s.Objects, s.OpenObjects, before.Used, before.Objects)
	})
}

// testRsync copies a tree with rsync -a, then syncs changes (a rewritten
// file, a new one, a deleted one) with --delete.
func testRsync(t *testing.T, d *daemon, dir string) {
	requireTools(t, "rsync")
	src := filepath.Join(t.TempDir(), "tree")
	makeTree(t, src, 6)
	dst := filepath.Join(dir, "tree")
	run(t, "rsync", "-a", src+"/", dst+"/")
	compareTrees(t, src, dst)

	writeRandom(t, filepath.Join(src, "a/b/odd"), 70001, 61)
	writeRandom(t, filepath.Join(src, "new.bin"), 12345, 62)
	if err := os.Remove(filepath.Join(src, "one")); err != nil {
		t.Fatal(err)
	}
	run(t, "rsync", "-a", "--delete", src+"/", dst+"/")
	compareTrees(t, src, dst)
}

// testRename moves files and directories, replacing existing ones.
func testRename(t *testing.T, d *daemon, dir string) {
	sh(t, `set -eux
cd "$1"
printf old > a
printf new > b
mv b a
test "$(cat a)" = new
test ! -e b
mkdir sub
mv a sub/a
test "$(cat sub/a)" = new
test ! -e a
mkdir sub/inner
printf x > sub/inner/x
mv sub sub2
test "$(cat sub2/inner/x)" = x
test "$(cat sub2/a)" = new
test ! -e sub
mkdir empty
mv -T sub2 empty
test "$(cat empty/inner/x)" = x
test ! -e sub2
test "$(ls empty | tr '\n' ' ')" = "a inner "
`, dir)
}

const renameOverOpenScript = `
import os, sys
d = sys.argv[1]
def put(p, b):
    with open(p, "wb") as f:
        f.write(b)
def get(p):
    with open(p, "rb") as f:
        return f.read()
def check(label, ok):
    print(f"{label}={'OK' if ok else 'FAIL'}", flush=True)
def readall(fd):
    out = b""
    while True:
        b = os.read(fd, 65536)
        if not b:
            return out
        out += b
target, incoming = d + "/target", d + "/incoming"
old, new = b"old-" * 50000, b"NEW!" * 70000
put(target, old)
put(incoming, new)

fd = os.open(target, os.O_RDONLY)
head = os.read(fd, 1000)
os.rename(incoming, target)
check("old_fd_reads_old", head + readall(fd) == old)
check("old_fd_pread_old", os.pread(fd, len(new), 0) == old)
check("old_fd_fstat_old_size", os.fstat(fd).st_size == len(old))
check("new_open_sees_new", get(target) == new)
check("source_name_gone", not os.path.exists(incoming))
os.close(fd)

fd = os.open(target, os.O_RDONLY)
put(target, b"third")
check("reader_keeps_version_over_otrunc_rewrite", os.pread(fd, len(new) + 10, 0) == new)
check("new_open_sees_rewrite", get(target) == b"third")
os.close(fd)

fd = os.open(target, os.O_RDONLY)
os.unlink(target)
check("reader_keeps_unlinked", os.pread(fd, 100, 0) == b"third")
check("unlinked_name_gone", not os.path.exists(target))
os.close(fd)
`

// testRenameOverOpen: a reader that opened a file before it was replaced
// (by rename, by an O_TRUNC rewrite, by unlink) keeps reading its version.
func testRenameOverOpen(t *testing.T, d *daemon, dir string) {
	out := py(t, renameOverOpenScript, dir)
	want := map[string]string{}
	for _, l := range []string{"old_fd_reads_old", "old_fd_pread_old", "old_fd_fstat_old_size", "new_open_sees_new",
		"source_name_gone", "reader_keeps_version_over_otrunc_rewrite", "new_open_sees_rewrite",
		"reader_keeps_unlinked", "unlinked_name_gone"} {
		want[l] = "OK"
	}
	checkResults(t, out, want)
}

// concurrentScript is a writer or a reader. Writer w writes files
// w{w}-{i} with content made from (w, i) in 64 KiB writes: even i in place,
// odd i to a temporary name renamed at the end. A reader opens random
// files until the file "done" appears and checks each: ENOENT, or the whole
// content; an empty file is allowed only for in-place files (open(O_CREAT)
// makes the name at once, the content comes at close). Then it checks that
// every file is whole. Readers print "ready" before their first open, and
// look only at files they have not yet seen whole.
const concurrentScript = `
import os, random, sys
mode, d, nw, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cache = {}
def content(w, i):
    if (w, i) not in cache:
        r = random.Random(w * 1000 + i)
        cache[(w, i)] = r.randbytes(4096 * r.randint(1, 200) + r.randint(0, 4095))
    return cache[(w, i)]
if mode == "writer":
    w = int(sys.argv[5])
    for i in range(n):
        data, final = content(w, i), f"{d}/w{w}-{i}"
        p = final if i % 2 == 0 else f"{d}/.tmp-w{w}-{i}"
        fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        off = 0
        while off < len(data):
            off += os.write(fd, data[off:off + 65536])
        os.close(fd)
        if p != final:
            os.rename(p, final)
    print("writer", w, "wrote", n, "files")
    sys.exit(0)
seen = {"enoent": 0, "empty": 0, "whole": 0}
def check(w, i):
    try:
        f = open(f"{d}/w{w}-{i}", "rb")
    except FileNotFoundError:
        seen["enoent"] += 1
        return False
    with f:
        got = f.read()
    want = content(w, i)
    if got == want:
        seen["whole"] += 1
        return True
    if not got and i % 2 == 0:
        seen["empty"] += 1
        return False
    print(f"FAIL: w{w}-{i}: read {len(got)} B, want {len(want)} B, contents differ: a partial or corrupt file")
    sys.exit(1)
rng = random.Random(int(sys.argv[5]))
todo = [(w, i) for w in range(nw) for i in range(n)]
print("ready", flush=True)
while not os.path.exists(d + "/done"):
    k = rng.randrange(len(todo)) if todo else None
    if k is None:
        continue
    if check(*todo[k]):
        todo[k] = todo[-1]
        todo.pop()
for w in range(nw):
    for i in range(n):
        if not check(w, i):
            print(f"FAIL: w{w}-{i} is not whole after its writer exited")
            sys.exit(1)
print("reader", seen)
`

// testConcurrentWritersReaders runs writers and readers in parallel
// processes; readers must never see a partial file.
func testConcurrentWritersReaders(t *testing.T, d *daemon, dir string) {
	const writers, readers, files = 3, 2, 16
	nw, n := strconv.Itoa(writers), strconv.Itoa(files)
	var rs, ws []*bg
	for r := range readers {
		rs = append(rs, background(t, python, "-c", concurrentScript, "reader", dir, nw, n, strconv.Itoa(100+r)))
	}
	for _, r := range rs {
		r.waitOutput(t, "ready")
	}
	for w := range writers {
		ws = append(ws, background(t, python, "-c", concurrentScript, "writer", dir, nw, n, strconv.Itoa(w)))
	}
	for _, w := range ws {
		w.mustWait(t)
	}
	run(t, "touch", filepath.Join(dir, "done"))
	for _, r := range rs {
		t.Log(strings.TrimSpace(r.mustWait(t)))
	}
	if out := run(t, "ls", "-A", dir); strings.Contains(out, ".tmp-") {
		t.Errorf("temporary files left after rename:\n%s", out)
	}
}

// testStatUtime checks sizes, times and modes as stat shows them, asking
// the daemon each time (stat --cached=never) rather than the kernel's
// attribute cache.
func testStatUtime(t *testing.T, d *daemon, dir string) {
	sh(t, `set -eux
cd "$1"
st() { stat --cached=never -c "$@"; }
printf hello > f
test "$(st %s f)" = 5
touch -m -d @1000000000 f
test "$(st %Y f)" = 1000000000
truncate -s 12345 f
test "$(st %s f)" = 12345
printf more >> f
test "$(st %s f)" = 12349
test "$(st %Y f)" -gt 1000000000
touch -m -d @1000000000 f
chmod 0640 f
test "$(st %a f)" = 640
test "$(st %Y f)" = 1000000000
mkdir d
test "$(st %F d)" = directory
test "$(st %F f)" = "regular file"
: > empty
test "$(st %s empty)" = 0
`, dir)
	out := py(t, `
import os, sys
p = sys.argv[1] + "/f"
os.utime(p, ns=(1, 1234567890123456789))
print(os.stat(p).st_mtime_ns)
`, dir)
	if got := strings.TrimSpace(out); got != "1234567890123456789" {
		t.Errorf("st_mtime_ns after os.utime = %s, want 1234567890123456789", got)
	}

	// Times set on a file that is open for writing, after the last write,
	// must stick: tar -x and cp -p set them with futimens before close.
	// So must one set by path while another process writes the file
	// through an O_TRUNC descriptor (its own draft), as touch -d would.
	py(t, `
import os, sys
fd = os.open(sys.argv[1] + "/futimens", os.O_CREAT | os.O_WRONLY, 0o644)
os.write(fd, b"data")
os.utime(fd, ns=(2000000000 * 10**9, 2000000000 * 10**9))
os.close(fd)
p = sys.argv[1] + "/touched"
fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
os.write(fd, b"data")
os.utime(p, ns=(2100000000 * 10**9, 2100000000 * 10**9))
os.close(fd)
`, dir)
	for name, want := range map[string]string{"futimens": "2000000000", "touched": "2100000000"} {
		if got := strings.TrimSpace(run(t, "stat", "--cached=never", "-c", "%Y", filepath.Join(dir, name))); got != want {
			t.Errorf("mtime set on %s before the writer's close(2) = %s after it, want %s", name, got, want)
		}
	}
	// A truncation that changes no bytes still marks the file modified,
	// as on tmpfs: an O_TRUNC open of an empty file (make's ": > stamp"),
	// truncate(2) and ftruncate(2) to the size the file has. Each file
	// is first given a time long past.
	py(t, `
import os, sys
d = sys.argv[1]
old = (1000000000 * 10**9, 1000000000 * 10**9)
for name, data in (("stamp", b""), ("same", b"abc"), ("fsame", b"abc")):
    p = d + "/" + name
    with open(p, "wb") as f:
        f.write(data)
    os.utime(p, ns=old)
os.close(os.open(d + "/stamp", os.O_WRONLY | os.O_TRUNC))
os.truncate(d + "/same", 3)
fd = os.open(d + "/fsame", os.O_WRONLY)
os.ftruncate(fd, 3)
os.close(fd)
`, dir)
	for _, name := range []string{"stamp", "same", "fsame"} {
		out := strings.Fields(run(t, "stat", "--cached=never", "-c", "%Y %s", filepath.Join(dir, name)))
		if len(out) != 2 || out[0] <= "1000000000" || len(out[0]) != 10 {
			t.Errorf("%s: mtime and size %q after a truncation that changed no bytes; want its time, not 1000000000", name, out)
		}
	}
	// Times past what the store keeps (int64 nanoseconds, 1677 to 2262)
	// are clamped to its ends, not wrapped around.
	far := filepath.Join(dir, "far")
	run(t, "touch", far)
	run(t, "touch", "-m", "-d", "2300-01-01 UTC", far)
	if got := strings.TrimSpace(run(t, "stat", "--cached=never", "-c", "%Y", far)); got != "9223372036" {
		t.Errorf("mtime set to 2300 reads %s, want the last second kept, 9223372036", got)
	}
	// Python checks of calls on one file each: what the script prints,
	// against what tmpfs prints.
	for _, c := range []struct{ what, script, want string }{
		// fchmod, fchown, futimens, fsetxattr and fremovexattr of a file
		// unlinked while open change the nameless file, as on tmpfs,
		// where they failed with ESTALE: fstat and fgetxattr of its
		// descriptors show them; its xattrs still read.
		{"an unlinked open file's xattrs, and it after fchmod, fchown, futimens, fsetxattr, fremovexattr", `
import errno, os, sys
p = sys.argv[1] + "/unlinked"
res = []
for flags in (os.O_RDWR, os.O_RDONLY):
    with open(p, "wb") as f:
        f.write(b"data")
    os.setxattr(p, "user.tag", b"t")
    fd = os.open(p, flags)
    os.unlink(p)
    tag = os.getxattr(fd, "user.tag").decode() + ",".join(os.listxattr(fd))
    os.fchmod(fd, 0o600)
    os.fchown(fd, 7, 8)
    os.utime(fd, ns=(5 * 10**9, 5 * 10**9))
    old = os.getxattr(fd, "user.tag").decode()
    os.setxattr(fd, "user.new", b"n")
    os.removexattr(fd, "user.tag")
    try:
        os.setxattr(fd, "user.new", b"x", os.XATTR_CREATE)
        again = "replaced"
    except OSError as e:
        again = errno.errorcode[e.errno]
    st = os.fstat(fd)
    res.append("%o %d %d %d %d %d %s %s %s=%s %s" % (st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime_ns // 10**9, st.st_nlink, st.st_size, tag, old,
        ",".join(os.listxattr(fd)), os.getxattr(fd, "user.new").decode(), again))
    os.close(fd)
print(" | ".join(res))
`,
			"600 7 8 5 0 4 tuser.tag t user.new=n EEXIST | 600 7 8 5 0 4 tuser.tag t user.new=n EEXIST"},
		// SEEK_DATA and SEEK_HOLE as on tmpfs: no holes before the end,
		// neither at or past it (ENXIO).
		{"SEEK_DATA/SEEK_HOLE of a 5000 B file at 10, and SEEK_HOLE, SEEK_DATA at 5000 and 6000", `
import errno, os, sys
p = sys.argv[1] + "/seek"
with open(p, "wb") as f:
    f.write(b"x" * 5000)
fd = os.open(p, os.O_RDONLY)
res = [os.lseek(fd, 10, os.SEEK_DATA), os.lseek(fd, 10, os.SEEK_HOLE)]
for off, whence in ((5000, os.SEEK_HOLE), (5000, os.SEEK_DATA), (6000, os.SEEK_HOLE)):
    try:
        res.append(os.lseek(fd, off, whence))
    except OSError as e:
        res.append(errno.errorcode[e.errno])
os.close(fd)
print(*res)
`,
			"10 5000 ENXIO ENXIO ENXIO"},
		// O_RDONLY|O_TRUNC empties the file, as Linux does on tmpfs (it
		// was opened for reading as it was).
		{"O_RDONLY|O_TRUNC open of a 7 B file: bytes read, fstat and stat sizes", `
import os, sys
p = sys.argv[1] + "/rotrunc"
with open(p, "wb") as f:
    f.write(b"content")
fd = os.open(p, os.O_RDONLY | os.O_TRUNC)
print(len(os.read(fd, 100)), os.fstat(fd).st_size, os.stat(p).st_size)
os.close(fd)
`,
			"0 0 0"},
	} {
		if got := strings.TrimSpace(py(t, c.script, dir)); got != c.want {
			t.Errorf("%s: %q, want %q", c.what, got, c.want)
		}
	}
	// A directory shows one link, "not counted" (its count would be 2
	// and one per subdirectory, which the store does not keep: 2 told
	// walkers such as File::Find that it had no subdirectories), and no
	// blocks, as tmpfs (du).
	if err := os.MkdirAll(filepath.Join(dir, "nl", "a", "b"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(run(t, "stat", "--cached=never", "-c", "%h %b", filepath.Join(dir, "nl"))); got != "1 0" {
		t.Errorf("a directory with a subdirectory: links and blocks %q, want \"1 0\"", got)
	}
	src := filepath.Join(t.TempDir(), "src")
	writeRandom(t, src, 10000, 7)
	mt := time.Unix(1600000000, 0)
	if err := os.Chtimes(src, mt, mt); err != nil {
		t.Fatal(err)
	}
	run(t, "cp", "-p", src, filepath.Join(dir, "cp-p"))
	if got := strings.TrimSpace(run(t, "stat", "--cached=never", "-c", "%Y", filepath.Join(dir, "cp-p"))); got != "1600000000" {
		t.Errorf("mtime after cp -p = %s, want 1600000000", got)
	}
}

// testPermissions checks that mode bits hold for an unprivileged user.
func testPermissions(t *testing.T, d *daemon, dir string) {
	requireTools(t, "setpriv")
	sh(t, `set -eux
cd "$1"
chmod 0755 .
printf secret > private
chmod 0600 private
printf public > public
chmod 0644 public
mkdir open
chmod 0777 open
`, dir)
	for _, c := range []struct {
		script, want string // want: output, or "!" + an error message
	}{
		{`cat "$1/public"`, "public"},
		{`cat "$1/private"`, "!Permission denied"},
		{`printf x >> "$1/public"`, "!Permission denied"},
		{`: > "$1/new"`, "!Permission denied"},
		{`chmod 0666 "$1/public"`, "!Operation not permitted"},
		{`rm -f "$1/public"`, "!Permission denied"},
		{`printf mine > "$1/open/mine" && stat -c %u:%g:%a "$1/open/mine"`, "65534:65534:644"},
		// Mode 0 stays 0 (go-fuse would show 0644 and 0755), as on tmpfs:
		// not even the owner may read or list.
		{`umask 777; : > "$1/open/zero" && mkdir "$1/open/zdir" && stat -c %a "$1/open/zero" "$1/open/zdir"`, "0\n0"},
		{`cat "$1/open/zero"`, "!Permission denied"},
		{`ls "$1/open/zdir"`, "!Permission denied"},
	} {
		out, err := asNobody("umask 022; "+c.script, dir)
		out = strings.TrimSpace(out)
		if msg, ok := strings.CutPrefix(c.want, "!"); ok {
			if err == nil || !strings.Contains(out, msg) {
				t.Errorf("as nobody: %s = %q, %v; want an error with %q", c.script, out, err, msg)
			}
		} else if err != nil || out != c.want {
			t.Errorf("as nobody: %s = %q, %v; want %q", c.script, out, err, c.want)
		}
	}
	if got := strings.TrimSpace(run(t, "cat", filepath.Join(dir, "public"))); got != "public" {
		t.Errorf("public = %q after the denied writes", got)
	}
}

// testLs lists directories, one with more entries than a listing batch.
func testLs(t *testing.T, d *daemon, dir string) {
	sh(t, `set -eux
cd "$1"
mkdir -p a b/c empty
touch f1 b/f2 b/c/f3
`, dir)
	if got := run(t, "ls", "-1", dir); got != "a\nb\nempty\nf1\n" {
		t.Errorf("ls -1 = %q", got)
	}
	out := run(t, "ls", "-la", dir)
	for _, name := range []string{" .", " ..", " a", " b", " empty", " f1"} {
		if !strings.Contains(out, name+"\n") {
			t.Errorf("ls -la has no %q:\n%s", name, out)
		}
	}
	want := "a\nb\nb/c\nb/c/f3\nb/f2\nempty\nf1\n"
	if got := sh(t, `cd "$1" && find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort`, dir); got != want {
		t.Errorf("find = %q, want %q", got, want)
	}

	const many = 700
	py(t, `
import os, sys
d = sys.argv[1] + "/many"
os.mkdir(d)
for i in range(int(sys.argv[2])):
    open(f"{d}/file-{i:04d}", "wb").close()
`, dir, strconv.Itoa(many))
	got := strings.Fields(run(t, "ls", "-1", filepath.Join(dir, "many")))
	var names []string
	for i := range many {
		names = append(names, fmt.Sprintf("file-%04d", i))
	}
	if !slices.Equal(got, names) {
		t.Errorf("ls of %d files listed %d names (first %q)", many, len(got), got[:min(len(got), 3)])
	}
}

// testStatfs checks that statfs reports the --size capacity.
func testStatfs(t *testing.T, d *daemon, capacity uint64) {
	f := strings.Fields(run(t, "stat", "-f", "-c", "%S %b %f %a %l %T", d.dir))
	if len(f) != 6 {
		t.Fatalf("stat -f: %q", f)
	}
	var n [5]uint64
	for i := range n {
		v, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			t.Fatalf("stat -f field %d %q: %v", i, f[i], err)
		}
		n[i] = v
	}
	bsize, blocks, bfree, bavail, namelen := n[0], n[1], n[2], n[3], n[4]
	if bsize*blocks != capacity {
		t.Errorf("stat -f: %d blocks of %d B = %d B, want the --size %d", blocks, bsize, bsize*blocks, capacity)
	}
	if bfree > blocks || bavail > bfree {
		t.Errorf("stat -f: free %d, available %d, of %d blocks", bfree, bavail, blocks)
	}
	if namelen != 255 {
		t.Errorf("stat -f: name length %d, want 255", namelen)
	}
	lines := strings.Split(strings.TrimSpace(run(t, "df", "-B1", "--output=size", d.dir)), "\n")
	if got := strings.TrimSpace(lines[len(lines)-1]); got != strconv.FormatUint(capacity, 10) {
		t.Errorf("df -B1 size = %s, want %d", got, capacity)
	}
	if st := d.status(t); st.Capacity != capacity {
		t.Errorf("status capacity = %d, want %d", st.Capacity, capacity)
	}
}

// testXattrs reads the computed user.mooncake.* attributes, pins and
// unpins, and round-trips a user attribute.
func testXattrs(t *testing.T, d *daemon, dir string) {
	requireTools(t, "getfattr", "setfattr", "rsync")
	f := filepath.Join(dir, "f")
	sh(t, `head -c 3000 /dev/zero > "$1"`, f)
	get := func(name string) string {
		t.Helper()
		return run(t, "getfattr", "--absolute-names", "--only-values", "-n", name, f)
	}
	if v := get("user.mooncake.size"); v != "3000" {
		t.Errorf("user.mooncake.size = %q, want 3000", v)
	}
	v1, err := strconv.ParseUint(get("user.mooncake.version"), 10, 64)
	if err != nil {
		t.Fatalf("user.mooncake.version: %v", err)
	}
	sh(t, `printf more >> "$1"`, f)
	if v := get("user.mooncake.size"); v != "3004" {
		t.Errorf("user.mooncake.size after append = %q, want 3004", v)
	}
	if v2, err := strconv.ParseUint(get("user.mooncake.version"), 10, 64); err != nil || v2 <= v1 {
		t.Errorf("user.mooncake.version after a rewrite = %d (%v), want more than %d", v2, err, v1)
	}
	if loc := get("user.mooncake.location"); !strings.HasPrefix(loc, "local:") {
		t.Errorf("user.mooncake.location = %q, want local:<extents>", loc)
	}
	if v := get("user.mooncake.pin"); v != "0" {
		t.Errorf("user.mooncake.pin = %q, want 0", v)
	}
	run(t, "setfattr", "-n", "user.mooncake.pin", "-v", "1", f)
	if v := get("user.mooncake.pin"); v != "1" {
		t.Errorf("user.mooncake.pin after setting 1 = %q", v)
	}
	run(t, "setfattr", "-n", "user.mooncake.pin", "-v", "0", f)
	if v := get("user.mooncake.pin"); v != "0" {
		t.Errorf("user.mooncake.pin after setting 0 = %q", v)
	}

	run(t, "setfattr", "-n", "user.color", "-v", "blue", f)
	if v := get("user.color"); v != "blue" {
		t.Errorf("user.color = %q", v)
	}
	// Listed: what is stored, and the pin while set; the computed names
	// are read by name only, so copies of the file's attributes work.
	all := run(t, "getfattr", "--absolute-names", "-d", "-m", "-", f)
	if !strings.Contains(all, "user.color=") {
		t.Errorf("getfattr -d -m - has no user.color:\n%s", all)
	}
	for _, name := range []string{"user.mooncake.size", "user.mooncake.version", "user.mooncake.location", "user.mooncake.pin"} {
		if strings.Contains(all, name) {
			t.Errorf("getfattr -d -m - lists %s:\n%s", name, all)
		}
	}
	run(t, "setfattr", "-n", "user.mooncake.pin", "-v", "1", f)
	if all := run(t, "getfattr", "--absolute-names", "-d", f); !strings.Contains(all, `user.mooncake.pin="1"`) {
		t.Errorf("getfattr -d of a pinned file has no pin:\n%s", all)
	}
	// rsync -aX in the mount, and out and back: every attribute
	// listed can be set again, the pin included.
	out := t.TempDir()
	sh(t, `set -e
mkdir "$1/xsrc" "$1/xsrc/d"
cp -a "$2" "$1/xsrc/d/f"
rsync -aX "$1/xsrc/" "$1/xdst/"
rsync -aX "$1/xsrc/" "$3/"
rsync -aX "$3/" "$1/xback/"
`, dir, f, out)
	for _, c := range []string{"xsrc/d/f", "xdst/d/f", "xback/d/f"} {
		p := filepath.Join(dir, c)
		if v := run(t, "getfattr", "--absolute-names", "--only-values", "-n", "user.color", p); v != "blue" {
			t.Errorf("%s: user.color = %q", c, v)
		}
		if v := run(t, "getfattr", "--absolute-names", "--only-values", "-n", "user.mooncake.pin", p); v != "1" {
			t.Errorf("%s: user.mooncake.pin = %q", c, v)
		}
	}
	if all := run(t, "getfattr", "--absolute-names", "-d", "-m", "-", filepath.Join(out, "d", "f")); strings.Contains(all, "user.mooncake.size") {
		t.Errorf("a copy outside the mount carries the computed attributes:\n%s", all)
	}
	sh(t, `set -e
for f in "$1"/xsrc/d/f "$1"/xdst/d/f "$1"/xback/d/f; do setfattr -n user.mooncake.pin -v 0 "$f"; done
rm -r "$1/xsrc" "$1/xdst" "$1/xback"`, dir)
	run(t, "setfattr", "-n", "user.mooncake.pin", "-v", "0", f)
	run(t, "setfattr", "-x", "user.color", f)
	if out, err := runErr("getfattr", "--absolute-names", "-n", "user.color", f); err == nil || !strings.Contains(out, "No such attribute") {
		t.Errorf("getfattr of a removed attribute: %v\n%s", err, out)
	}
	if v := get("user.mooncake.size"); v != "3004" {
		t.Errorf("user.mooncake.size after the xattr changes = %q, want 3004", v)
	}
}

// TestRootAttributes: the mount's top takes chmod, chown, utimes and
// xattrs as any directory does, again and again (the second chmod used
// to hang for good: the root's record was never read back), and an
// unprivileged user may create there once it is world-writable. The
// record is hidden from listings.
func TestRootAttributes(t *testing.T) {
	t.Parallel()
	requireTools(t, "getfattr", "setfattr")
	d := startDaemon(t, "--size", "64MiB")
	root := d.dir
	for _, mode := range []string{"700", "1777", "755", "1777"} {
		run(t, "chmod", mode, root)
		if got := strings.TrimSpace(run(t, "stat", "--cached=never", "-c", "%a", root)); got != mode {
			t.Errorf("root mode after chmod %s = %s", mode, got)
		}
	}
	run(t, "chown", "65534:65534", root)
	run(t, "chown", "0:0", root)
	if got := strings.TrimSpace(run(t, "stat", "--cached=never", "-c", "%u:%g %a", root)); got != "0:0 1777" {
		t.Errorf("root after chown back = %s, want 0:0 1777", got)
	}
	run(t, "touch", "-m", "-d", "@1600000000", root)
	if got := strings.TrimSpace(run(t, "stat", "--cached=never", "-c", "%Y", root)); got != "1600000000" {
		t.Errorf("root mtime = %s, want 1600000000", got)
	}
	run(t, "setfattr", "-n", "user.where", "-v", "top", root)
	if got := run(t, "getfattr", "--absolute-names", "--only-values", "-n", "user.where", root); got != "top" {
		t.Errorf("root xattr = %q, want top", got)
	}
	if out, err := asNobody(`echo hi > "$1/mine" && cat "$1/mine"`, root); err != nil || strings.TrimSpace(out) != "hi" {
		t.Errorf("nobody creating in the world-writable root: %v\n%s", err, out)
	}
	if got := strings.Fields(run(t, "ls", "-A", root)); len(got) != 1 || got[0] != "mine" {
		t.Errorf("ls -A of the root = %q, want [mine]", got)
	}
	d.checkAlive(t)
}

// TestSetgidAndTarXattrs: a setgid directory gives its group to what is
// made in it and its setgid bit to new directories, as on tmpfs; and tar
// extracts files with xattrs, which it makes with mknod(S_IFREG).
func TestSetgidAndTarXattrs(t *testing.T) {
	t.Parallel()
	requireTools(t, "tar", "setfattr", "getfattr")
	d := startDaemon(t, "--size", "64MiB")
	shared := d.path("shared")
	run(t, "mkdir", shared)
	run(t, "chgrp", "1234", shared)
	run(t, "chmod", "2775", shared)
	run(t, "touch", filepath.Join(shared, "file"))
	run(t, "mkdir", filepath.Join(shared, "sub"))
	py(t, keysPrelude+`
c.batch_put({"put": b"x"}, dir="shared")
c.put("shared/one", b"y")
`, pythonDir(t), d.dir)
	if out := run(t, "stat", "-c", "%n %g %a", filepath.Join(shared, "file"), filepath.Join(shared, "sub"),
		filepath.Join(shared, "put"), filepath.Join(shared, "one")); out !=
		shared+"/file 1234 644\n"+shared+"/sub 1234 2755\n"+shared+"/put 1234 644\n"+shared+"/one 1234 644\n" {
		t.Errorf("entries of a setgid directory:\n%s", out)
	}
	src := t.TempDir()
	run(t, "mkdir", filepath.Join(src, "t"))
	f := filepath.Join(src, "t", "f")
	if err := os.WriteFile(f, []byte("hi\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	run(t, "setfattr", "-n", "user.origin", "-v", "web", f)
	archive := filepath.Join(t.TempDir(), "x.tar")
	run(t, "tar", "--xattrs", "-cf", archive, "-C", src, "t")
	run(t, "tar", "--xattrs", "-xf", archive, "-C", d.dir)
	got := d.path("t", "f")
	if out := run(t, "getfattr", "--absolute-names", "--only-values", "-n", "user.origin", got); out != "web" {
		t.Errorf("xattr after tar --xattrs -x: %q", out)
	}
	run(t, "cmp", f, got)
}

// TestDirectoryMtime: a directory's mtime moves when an entry is made in
// it or leaves it, through the mount or by a batch put, so Python finds a
// module written beside one it imported before (its import system lists
// a directory again only when that mtime moved). --cache-timeout 0: the
// kernel asks at every stat.
func TestDirectoryMtime(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB", "--cache-timeout", "0")
	out := py(t, keysPrelude+`
import time
d = mnt + "/pkg"
os.mkdir(d)
def moved(label, fn):
    before = os.stat(d).st_mtime_ns
    time.sleep(0.002)
    fn()
    print(f"{label}={os.stat(d).st_mtime_ns > before}")
moved("create", lambda: open(d + "/mod_a.py", "w").write("X = 1\n"))
sys.path.insert(0, d)
import mod_a
moved("create2", lambda: open(d + "/mod_b.py", "w").write("Y = 2\n"))
import mod_b
print(f"import={mod_b.Y}")
moved("rewrite", lambda: open(d + "/mod_b.py", "w").write("Y = 3\n"))
moved("mkdir", lambda: os.mkdir(d + "/sub"))
moved("rmdir", lambda: os.rmdir(d + "/sub"))
moved("rename_out", lambda: os.rename(d + "/mod_b.py", mnt + "/mod_b.py"))
moved("unlink", lambda: os.unlink(d + "/mod_a.py"))
moved("batch_put", lambda: c.batch_put({"k1": b"1", "k2": b"2"}, dir="pkg"))
# Times set by the owner stick, even set again to the value they had (as
# tar and rsync do after filling a directory), and a directory moved
# keeps its subdirectories' times.
old = 946684800 * 10**9  # 2000-01-01
os.utime(d, ns=(old, old))
open(d + "/late", "w").close()
os.utime(d, ns=(old, old))
print(f"set_again={os.stat(d).st_mtime_ns == old}")
os.makedirs(d + "/s/t")
open(d + "/s/t/f", "w").close()
os.utime(d + "/s/t", ns=(old, old))
os.rename(d, mnt + "/pkg2")
print(f"sub_kept={os.stat(mnt + '/pkg2/s/t').st_mtime_ns == old}")
`, pythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"create": "True", "create2": "True", "import": "2", "rewrite": "False",
		"mkdir": "True", "rmdir": "True", "rename_out": "True", "unlink": "True", "batch_put": "True",
		"set_again": "True", "sub_kept": "True"})
}

// TestOpenWhileWriting: a file another process is still writing (its
// descriptor open, nothing closed or synced yet) is the file as written
// so far, to every program, as on tmpfs:
//   - its size once the kernel looks its name up again (the entry timed
//     out: --cache-timeout 100ms), so the writer's own lseek(SEEK_END)
//     and appends land after its bytes, and a mapping of its end
//     survives a stat;
//   - the bytes a new read-only open reads, as they grow, for writers
//     that share the file (no O_TRUNC: git's index-pack reads the pack
//     its other half writes), and after the writer closes, what it
//     published;
//   - while a writer that opened with O_TRUNC (a shell's >) writes, the
//     old version, whole, and then the new one, whole;
//   - a reader opened before the writer keeps the version it opened;
//   - a follower whose writers are gone reads what they left, not a
//     version an O_TRUNC writer published after them, nor the draft of
//     writers who came after.
func TestOpenWhileWriting(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB", "--cache-timeout", "100ms")
	out := py(t, `
import mmap, os, sys, time
d = sys.argv[1]
os.chdir(d)
def say(*a): print(*a, flush=True)

# Size after a new lookup; the writer's lseek(SEEK_END) and appends.
fd = os.open("grow", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"A" * 5000)
time.sleep(0.3)
say("stat", os.stat("grow").st_size, "end", os.lseek(fd, 0, os.SEEK_END))
os.write(fd, b"B" * 10)
os.close(fd)
with open("grow", "rb") as f:
    say("grow ok", f.read() == b"A" * 5000 + b"B" * 10)

# A mapping of the end of a file still open for writing, across a stat.
fd = os.open("mapped", os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"z", 8191)
m = mmap.mmap(fd, 8192)
time.sleep(0.3)
say("mapped stat", os.stat("mapped").st_size)
m[8190] = ord("y")
say("mapped", m[8190:8192])
m.close()
os.close(fd)

# New read-only opens while writers write: writers that share the file
# (O_RDWR|O_CREAT|O_EXCL, as git writes a pack; O_WRONLY|O_APPEND, a log)
# are followed; one that truncated (O_TRUNC, a shell's >) is not.
for name, flags in (("pack", os.O_RDWR | os.O_CREAT | os.O_EXCL), ("log", os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                    ("trunc", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
    old = b"old version\n" if name != "pack" else b""
    if old:
        with open(name, "wb") as f:
            f.write(old)
    w = os.open(name, flags, 0o644)
    want = old if name == "log" else b""
    ok = True
    for i in range(5):
        line = b"line %d of %s\n" % (i, name.encode())
        os.write(w, line)
        want += line
        with open(name, "rb") as r:
            got = r.read()
        ok = ok and got == (old if name == "trunc" else want)
    held = open(name, "rb")  # opened while writing
    os.write(w, b"tail\n")
    want += b"tail\n"
    ok = ok and os.stat(name).st_size == len(want)
    os.close(w)
    ok = ok and held.read() == (old if name == "trunc" else want)
    held.close()
    with open(name, "rb") as r:
        ok = ok and r.read() == want
    say(name, "ok" if ok else "differs")

# A file unlinked or renamed over while a follower reads it: the follower
# keeps what the writer wrote, after the writer closes too, as an unlinked
# file's bytes stay on tmpfs.
for how in ("unlink", "renameover"):
    with open("gone", "wb") as f:
        f.write(b"O" * 10)
    w = os.open("gone", os.O_WRONLY | os.O_APPEND)
    os.write(w, b"A" * 100)
    r = os.open("gone", os.O_RDONLY)
    if how == "unlink":
        os.unlink("gone")
    else:
        with open("other", "wb") as f:
            f.write(b"G" * 5)
        os.rename("other", "gone")
    os.write(w, b"B" * 100)
    os.close(w)
    got = os.pread(r, 4096, 0)
    say(how, got == b"O" * 10 + b"A" * 100 + b"B" * 100, os.fstat(r).st_size)
    os.close(r)

# Reads of a follower from several threads while the writer closes: each
# reads the bytes written, never the version from before.
import threading
short = 0
for it in range(20):
    with open("race", "wb") as f:
        f.write(b"O" * 10)
    w = os.open("race", os.O_WRONLY | os.O_APPEND)
    os.write(w, b"A" * (1 << 20))
    r = os.open("race", os.O_RDONLY)
    stop = threading.Event()
    bad = []
    def reader():
        while not stop.is_set():
            if len(os.pread(r, 4096, 512 << 10)) != 4096:
                bad.append(1)
    ts = [threading.Thread(target=reader) for _ in range(4)]
    for t in ts:
        t.start()
    os.close(w)
    for _ in range(50):
        os.pread(r, 1, 0)
    stop.set()
    for t in ts:
        t.join()
    short += len(bad)
    os.close(r)
say("short reads", short)

# A follower that reads on after the writers it followed are gone reads
# what they left, whole, even once an O_TRUNC writer published another
# version (the writer that shared the file may not have written at all),
# and once other writers share the file anew (again).
for wrote, again in ((False, False), (True, False), (False, True)):
    with open("left", "wb") as f:
        f.write(b"A" * (3 << 20))
    h = os.open("left", os.O_WRONLY)
    if wrote:
        os.pwrite(h, b"C" * 10, 0)
    r = os.open("left", os.O_RDONLY)
    got = os.pread(r, 1 << 20, 0)
    os.close(h)
    w = os.open("left", os.O_WRONLY | os.O_TRUNC)
    os.write(w, b"B" * (2 << 20))
    os.close(w)
    h2 = os.open("left", os.O_WRONLY) if again else None
    while True:
        more = os.pread(r, 1 << 20, len(got))
        if not more:
            break
        got += more
    os.close(r)
    if h2 is not None:
        os.close(h2)
    want = b"A" * (3 << 20)
    if wrote:
        want = b"C" * 10 + want[10:]
    say("left", wrote, again, got == want)

# A shell's > publishes the emptied file when the shell closes its
# descriptor: readers see that until the job closes (an O_TRUNC rewrite
# shows whole), and what the job wrote is published even if it is killed
# (on tmpfs it is all there).
import subprocess
with open("job.log", "wb") as f:
    f.write(b"old run\n")
# The shell writes (printf is built in) and stays, waiting for sleep; it
# has written once stat shows the size being written. (No other
# redirection in the group: the shell's save and restore of its stdout
# for one would close a descriptor of the log, which publishes.)
job = subprocess.Popen(["sh", "-c", "{ printf %s " + "N" * 300 + "; sleep 1; } > job.log"])
for _ in range(1000):
    if os.stat("job.log").st_size == 300:
        break
    time.sleep(0.01)
with open("job.log", "rb") as r:
    say("job running", r.read())
job.wait()
with open("crash.log", "wb") as f:
    f.write(b"old run\n")
subprocess.run(["sh", "-c", "{ echo partial; kill -9 $$; } > crash.log"])
with open("crash.log", "rb") as r:
    say("killed job", r.read())

# fstat of a directory and a file removed while open: their attributes,
# no link left (after the attribute timeout: asked of the daemon).
os.mkdir("gonedir")
dfd = os.open("gonedir", os.O_RDONLY | os.O_DIRECTORY)
os.rmdir("gonedir")
fd = os.open("gonefile", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"abc")
os.unlink("gonefile")
time.sleep(0.3)
st = os.fstat(dfd)
say("gone dir", oct(st.st_mode), st.st_nlink)
st = os.fstat(fd)
say("gone file", st.st_size, st.st_nlink)
os.close(dfd)
os.close(fd)

# A reader opened before the writer keeps its version.
with open("kept", "wb") as f:
    f.write(b"first")
early = open("kept", "rb")
w = os.open("kept", os.O_WRONLY | os.O_TRUNC)
os.write(w, b"second")
os.close(w)
say("kept", early.read())
early.close()
`, d.dir)
	want := "stat 5000 end 5000\ngrow ok True\nmapped stat 8192\nmapped b'yz'\npack ok\nlog ok\ntrunc ok\nunlink True 210\nrenameover True 210\nshort reads 0\nleft False False True\nleft True False True\nleft False True True\njob running b''\nkilled job b'partial\\n'\ngone dir 0o40755 0\ngone file 3 0\nkept b'first'\n"
	if out != want {
		t.Errorf("got:\n%s\nwant:\n%s", out, want)
	}
}

// TestReaderFollowsAppends: a descriptor opened for reading before
// writers that share the file (>>, O_APPEND, in-place writes) reads what
// they write, as on tmpfs, whether they closed yet or not: tail -f shows
// each line a shell appends, and a reader polling while another process
// appends 3000 records (each its own open, write and close) reads every
// record once, in order. A rewrite (O_TRUNC) is still another version:
// the reader keeps the one it read, and appends to the new one are not
// its to read.
func TestReaderFollowsAppends(t *testing.T) {
	t.Parallel()
	requireTools(t, "tail")
	d := startDaemon(t, "--size", "64MiB")
	out := py(t, `
import os, subprocess, sys
os.chdir(sys.argv[1])
def say(*a): print(*a, flush=True)

with open("log", "wb") as f:
    f.write(b"first\n")
r = open("log", "rb")
got, want = r.read(), b"first\n"
for i in range(60):
    line = b"line %d\n" % i
    w = os.open("log", os.O_WRONLY | os.O_APPEND)
    os.write(w, line)
    want += line
    if i % 3 == 0:
        os.close(w)  # read after the appender closed
    got += r.read()
    if i % 3 != 0:
        os.close(w)  # read while it is open
say("appends", got == want)
for i in range(5):
    subprocess.run("echo shell %d >> log" % i, shell=True, check=True)
    want += b"shell %d\n" % i
got += r.read()
say("shell appends", got == want)
w = open("log", "ab", buffering=0)
for i in range(20):
    w.write(b"long %d\n" % i)
    want += b"long %d\n" % i
    got += r.read()
w.close()
got += r.read()
say("long appender", got == want)
# A touch, a chmod, an xattr or a rename change no bytes: still followed.
for i, change in enumerate((lambda: os.utime("log"), lambda: os.chmod("log", 0o600),
                            lambda: os.setxattr("log", "user.x", b"1"), lambda: os.rename("log", "log.1"),
                            lambda: os.rename("log.1", "log"))):
    change()
    with open("log" if os.path.exists("log") else "log.1", "ab") as w:
        w.write(b"meta %d\n" % i)
    want += b"meta %d\n" % i
got += r.read()
say("after metadata", got == want)
w = os.open("log", os.O_WRONLY)
os.pwrite(w, b"FIRST", 0)
os.close(w)
want = b"FIRST" + want[5:]
r.seek(0)
say("in place", r.read() == want)
subprocess.run("echo rewritten > log", shell=True, check=True)
r.seek(0)
say("rewrite", r.read() == want)
subprocess.run("echo more >> log", shell=True, check=True)
r.seek(0)
say("append to rewrite", r.read() == want)
r.close()

open("conc", "wb").close()
r = open("conc", "rb")
p = subprocess.Popen([sys.executable, "-c", """
import os, sys
for i in range(3000):
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"%06d\\n" % i)
    os.close(fd)
""", "conc"])
got = b""
while p.poll() is None:
    got += r.read()
got += r.read()
say("concurrent", p.wait(), got == b"".join(b"%06d\n" % i for i in range(3000)))

# A reader that read half the file through the draft of a writer that
# shares it (kept open, writing nothing) reads the other half of the same
# version after an O_TRUNC writer replaced the file, not the new bytes
# the shared draft moves onto for its writer.
with open("held", "wb") as f:
    f.write(b"A" * (2 << 20))
h = os.open("held", os.O_RDWR)
r = os.open("held", os.O_RDONLY)
first = os.pread(r, 1 << 20, 0)
w = os.open("held", os.O_WRONLY | os.O_TRUNC)
os.write(w, b"B" * (3 << 20))
os.close(w)
rest = os.pread(r, 4 << 20, 1 << 20)
os.write(h, b"C")
os.close(h)
say("rewrite under a reader", first + rest == b"A" * (2 << 20), os.pread(r, 1, 2 << 20))
os.close(r)

# A reader opened while a writer holds the file O_RDWR without writing,
# then an O_TRUNC rewrite: the reader keeps the bytes it opened, empty
# ones too.
for old in (b"A" * 100, b""):
    with open("idle", "wb") as f:
        f.write(old)
    h = os.open("idle", os.O_RDWR)
    r = os.open("idle", os.O_RDONLY)
    with open("idle", "wb") as f:
        f.write(b"B" * 100)
    say("rewrite under an idle holder", len(old), os.read(r, 200) == old)
    os.close(r)
    os.close(h)

# A log renamed back and forth while it is appended to: every append read.
import threading
open("rlog", "wb").close()
r = open("rlog", "rb")
stop = []
def renamer():
    while not stop:
        try:
            os.rename("rlog", "rlog.1")
            os.rename("rlog.1", "rlog")
        except FileNotFoundError:
            pass
t = threading.Thread(target=renamer)
t.start()
got, want = b"", b""
for i in range(400):
    while True:
        try:
            w = os.open("rlog", os.O_WRONLY | os.O_APPEND)
            break
        except FileNotFoundError:
            pass
    os.write(w, b"%d\n" % i)
    os.close(w)
    want += b"%d\n" % i
    got += r.read()
stop.append(1)
t.join()
with open("rlog", "rb") as f:
    say("appends across renames", got + r.read() == want, f.read() == want)
`, d.dir)
	if want := "appends True\nshell appends True\nlong appender True\nafter metadata True\nin place True\nrewrite True\nappend to rewrite True\nconcurrent 0 True\nrewrite under a reader True b''\nrewrite under an idle holder 100 True\nrewrite under an idle holder 0 True\nappends across renames True True\n"; out != want {
		t.Errorf("got:\n%s\nwant:\n%s", out, want)
	}

	log := d.path("tailed")
	run(t, "sh", "-c", `echo start > "$1"`, "sh", log)
	tail := background(t, "tail", "-n", "+1", "-f", log)
	tail.waitOutput(t, "start\n")
	for i := range 5 {
		line := fmt.Sprintf("appended %d\n", i)
		run(t, "sh", "-c", `printf "$2" >> "$1"`, "sh", log, line)
		tail.waitOutput(t, line)
	}
}

// TestWriteKillsSetID: as on tmpfs, bytes written by a user without the
// privilege to keep them clear a file's set-user-ID bit, and its
// set-group-ID bit where the group may execute: through write(2) (a new
// content, an append), an O_TRUNC open, a put by name, a batch put and a
// put through an open file. root's writes keep them, and so does a chmod
// after the write, before the close. The kernel leaves this to the daemon
// for the mount's direct writes and atomic O_TRUNC opens.
func TestWriteKillsSetID(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv", "stat")
	d := startDaemon(t, "--size", "64MiB")
	pub := d.publicDir(t)
	files := map[string]string{ // name: mode set by root
		"trunc": "6777", "append": "6777", "nogx": "6767", "root": "6777", "otrunc": "6777",
		"byname": "6777", "batch": "6777", "handle": "6777",
	}
	for name, mode := range files {
		run(t, "sh", "-c", `printf old > "$1" && chmod "$2" "$1"`, "sh", filepath.Join(pub, name), mode)
	}
	run(t, "sh", "-c", `printf root >> "$1"`, "sh", filepath.Join(pub, "root"))
	script := `
import os, sys
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
mnt = sys.argv[2]
open(mnt + "/pub/trunc", "w").write("new")
open(mnt + "/pub/append", "a").write("more")
open(mnt + "/pub/nogx", "a").write("more")
os.close(os.open(mnt + "/pub/otrunc", os.O_WRONLY | os.O_TRUNC))
fd = os.open(mnt + "/pub/mine", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, b"mine")
os.fchmod(fd, 0o4755)  # after the write, before the close: kept
os.close(fd)
c = mc.Client(mnt)
c.put("pub/byname", b"new")
c.batch_put({"batch": b"new"}, dir="pub")
with mc.File(mnt + "/pub/handle", "w") as f:
    f.put(b"new")
`
	if out, err := asNobody(`exec "$1" -c "$2" "$3" "$4"`, python, script, publicPythonDir(t), d.dir); err != nil {
		t.Fatalf("nobody's writes: %v\n%s", err, out)
	}
	want := map[string]string{
		"trunc": "777", "append": "777", "nogx": "2767", "root": "6777", "otrunc": "777", "mine": "4755",
		"byname": "777", "batch": "777", "handle": "777",
	}
	for name, mode := range want {
		if got := strings.TrimSpace(run(t, "stat", "-c", "%a", filepath.Join(pub, name))); got != mode {
			t.Errorf("%s: mode %s after the writes, want %s", name, got, mode)
		}
	}
	d.checkAlive(t)
}
