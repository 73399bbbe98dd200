package tests

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBatchActsOnTheVersionItChecked: a batch checks the caller's
// permissions on one version of a key and must act on that version. root
// keeps renaming a 0600 secret and a 0666 public file over one name while
// nobody batch-reads and batch-writes that name: nobody never reads the
// secret and never changes it.
func TestBatchActsOnTheVersionItChecked(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "64MiB")
	pub := d.publicDir(t)
	victim := filepath.Join(pub, "victim")
	if err := os.WriteFile(victim, []byte("public"), 0o666); err != nil {
		t.Fatal(err)
	}
	script := `
import sys
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
c = mc.Client(sys.argv[2])
leaks = reads = puts = 0
print("started", flush=True)
for i in range(4000):
    buf = bytearray(16)
    r = c.batch_get_into({"victim": buf}, dir="pub", check=False)
    if r["victim"] > 0:
        reads += 1
        if b"SECRET" in bytes(buf):
            leaks += 1
    r = c.batch_put({"victim": b"nobody"}, dir="pub", check=False, makedirs=False)
    if r["victim"] > 0:
        puts += 1
print(f"leaks={leaks}", flush=True)
print(f"reads={reads} puts={puts}", flush=True)
`
	b := background(t, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script, publicPythonDir(t), d.dir)
	b.waitOutput(t, "started")
	// renameOver writes data with mode perm (umask aside) and renames it
	// over the victim.
	renameOver := func(tmp string, data []byte, perm os.FileMode) {
		if err := os.WriteFile(tmp, data, perm); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(tmp, perm); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, victim); err != nil {
			t.Fatal(err)
		}
	}
	tampered := 0
	for running := true; running; {
		select {
		case <-b.done:
			running = false
		default:
			renameOver(filepath.Join(pub, ".s"), []byte("SECRET"), 0o600)
			// Only root could have changed it now: nobody may not write it.
			if got, err := os.ReadFile(victim); err != nil {
				t.Fatal(err)
			} else if st, err := os.Stat(victim); err == nil && st.Mode().Perm() == 0o600 && !bytes.Equal(got, []byte("SECRET")) {
				tampered++
			}
			renameOver(filepath.Join(pub, ".p"), []byte("public"), 0o666)
		}
	}
	out := b.mustWait(t)
	if !strings.Contains(out, "leaks=0") || tampered != 0 {
		t.Fatalf("nobody read the secret or changed it: %d secret files changed\n%s", tampered, out)
	}
	t.Logf("%s", out)
	d.checkAlive(t)
}

// TestPutThroughAFileFollowsWriteRules: a PUT ioctl through an open file
// is a write to that file: through the descriptor of an unlinked file it
// fails (ESTALE) and creates nothing; writes made through the descriptor
// before the put never overwrite it when the file is closed; an update
// includes them; a failed put changes nothing.
func TestPutThroughAFileFollowsWriteRules(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB")
	out := py(t, pyErrnoPrelude+`
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
c = mc.Client(sys.argv[2])
def read(k):
    with open(c.path(k), "rb") as f:
        return f.read().decode()
c.put("u", b"before")
f = c.open("u", "w")
os.unlink(c.path("u"))
try_("unlinked_put", f.put, b"after")
f.close()
print(f"u_exists={os.path.exists(c.path('u'))}")

c.put("w", b"0123456789")
f = c.open("w", "w")
os.pwrite(f.fileno(), b"OLD-WRITE", 0)
f.put(b"new")
f.close()
print(f"w={read('w')}")

c.put("up", b"0123456789")
f = c.open("up", "w")
os.pwrite(f.fileno(), b"AB", 0)
f.put(b"XY", offset=8, update=True)
print(f"up_open={read('up')}")
f.close()
print(f"up={read('up')}")

c.put("bad", b"kept")
f = c.open("bad", "w")
try_("bad_put", f.put_vm, 8, 4)
os.pwrite(f.fileno(), b"K", 0)
f.close()
print(f"bad={read('bad')}")
`, pythonDir(t), d.dir)
	got := pyResults(out)
	want := map[string]string{
		"unlinked_put": "ESTALE", "u_exists": "False",
		"w": "new", "up_open": "AB234567XY", "up": "AB234567XY",
		"bad_put": "EFAULT", "bad": "Kept",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q\n%s", k, got[k], v, out)
		}
	}
	if _, err := os.Stat(d.path("u")); err == nil {
		t.Errorf("a put through an unlinked file recreated it")
	}
	d.checkAlive(t)
}

// TestClusterRestartedNodeReadableFromPeers: peers that pooled
// connections to a node keep reading it after it is killed and started
// again under its name, and keep writing into it: a connection to the
// old incarnation is closed and dialed anew, not reused.
func TestClusterRestartedNodeReadableFromPeers(t *testing.T) {
	requireTools(t, "setfattr")
	c := newTestCluster(t, "a", "b", "c")
	a, b, cc := c.nodes["a"], c.nodes["b"], c.nodes["c"]
	src := randomFile(t, 2)
	run(t, "mkdir", b.path("ona"))
	run(t, "setfattr", "-n", "user.mooncake.placement", "-v", "node:a", b.path("ona"))
	run(t, "cp", src, a.path("f"))
	run(t, "cmp", src, b.path("f"))
	run(t, "cmp", src, cc.path("f"))
	run(t, "cp", src, b.path("ona", "before"))
	a.kill9(t)
	a2 := c.start(t, "a")
	src2 := randomFile(t, 3)
	run(t, "cp", src2, a2.path("g"))
	for _, n := range []*daemon{b, cc} {
		run(t, "cmp", src2, n.path("g"))
	}
	// Writes from b into a's memory reach the new incarnation at once.
	waitFor(t, "b to see a's new incarnation", func() (bool, string) {
		out, err := runErr("cp", src2, b.path("ona", "probe"))
		return err == nil, out
	})
	for i := range 3 {
		name := b.path("ona", fmt.Sprintf("after%d", i))
		run(t, "cp", src2, name)
		run(t, "cmp", src2, cc.path("ona", fmt.Sprintf("after%d", i)))
	}
}

// TestClusterStatWhileCommitWaitsOnEtcd: a commit waiting on a stalled
// etcd blocks no one else: stat of the file being committed, lookups of
// other files and reads of them answer while it waits.
func TestClusterStatWhileCommitWaitsOnEtcd(t *testing.T) {
	c := newTestCluster(t, "a")
	a := c.nodes["a"]
	src := randomFile(t, 1)
	run(t, "cp", src, a.path("other"))
	w := background(t, python, "-c", `
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
os.write(fd, b"x" * 65536)
print("written", flush=True)
sys.stdin.readline()
os.close(fd)
print("closed", flush=True)
`, a.path("f"))
	w.waitOutput(t, "written")
	c.etcd.Pause()
	defer c.etcd.Resume()
	fmt.Fprintln(w.stdin)
	// The close now waits on etcd; meanwhile:
	run(t, "stat", a.path("f"))
	run(t, "cmp", src, a.path("other"))
	run(t, "ls", a.dir)
	if strings.Contains(w.out.String(), "closed") {
		t.Fatal("the close did not wait for etcd: the test proves nothing")
	}
	c.etcd.Resume()
	out, err := w.wait()
	t.Logf("close with etcd stalled, then resumed: %v\n%s", err, out)
}

// TestClusterRenameLargeDirectory: a directory of 500 files (far more
// than one etcd transaction holds) renames whole in a cluster, and every
// node sees the result.
func TestClusterRenameLargeDirectory(t *testing.T) {
	c := newTestCluster(t, "a", "b", "c")
	a, b, cc := c.nodes["a"], c.nodes["b"], c.nodes["c"]
	run(t, "mkdir", "-p", a.path("d", "sub"))
	run(t, "sh", "-c", `cd "$1" && for i in $(seq 500); do echo "file $i" > "$i"; done && echo deep > sub/x`, "sh", a.path("d"))
	run(t, "mv", a.path("d"), a.path("e"))
	for _, n := range []*daemon{a, b, cc} {
		if out := run(t, "sh", "-c", `ls "$1" | wc -l`, "sh", n.path("e")); strings.TrimSpace(out) != "501" {
			t.Fatalf("%s lists %s entries in e, want 501", n.dir, strings.TrimSpace(out))
		}
		if got := run(t, "cat", n.path("e", "250"), n.path("e", "sub", "x")); got != "file 250\ndeep\n" {
			t.Fatalf("%s reads %q", n.dir, got)
		}
		if _, err := os.Stat(n.path("d")); !os.IsNotExist(err) {
			t.Fatalf("%s still has d: %v", n.dir, err)
		}
		if out := run(t, "ls", "-A", n.dir); strings.TrimSpace(out) != "e" {
			t.Fatalf("%s root lists %q, want just e", n.dir, out)
		}
	}
}

// TestBatchPutVisibleAfterNegativeLookup: a key the kernel was told does
// not exist (a cached negative entry) is there for the next lookup once a
// batch created it; and one it was never asked about is too.
func TestBatchPutVisibleAfterNegativeLookup(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB")
	out := py(t, `
import os, sys
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
c = mc.Client(sys.argv[2])
os.mkdir(c.path("kv"))
print("before=%s" % os.path.exists(c.path("kv/asked")))
c.batch_put({"asked": b"1", "fresh": b"2"}, dir="kv")
print("asked=%s" % os.path.exists(c.path("kv/asked")))
print("fresh=%s" % os.path.exists(c.path("kv/fresh")))
with open(c.path("kv/asked"), "rb") as f:
    print("content=%s" % f.read().decode())
`, pythonDir(t), d.dir)
	got := pyResults(out)
	if got["before"] != "False" || got["asked"] != "True" || got["fresh"] != "True" || got["content"] != "1" {
		t.Fatalf("lookups around a batch put:\n%s", out)
	}
}

// TestBatchPutMixedKeys: one batch of new, existing, forbidden, faulting
// and too-large keys, from an unprivileged caller: every good key commits
// whole, every failed one gets its own errno and leaves nothing. (With
// eviction off: with it, the too-large key evicts the others, as it
// would one key at a time.)
func TestBatchPutMixedKeys(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "16MiB", "--evict", "off")
	pub := d.publicDir(t)
	run(t, "mkdir", "-m", "0755", filepath.Join(pub, "locked"))
	if err := os.WriteFile(filepath.Join(pub, "old"), []byte("old content"), 0o666); err != nil {
		t.Fatal(err)
	}
	run(t, "chmod", "0666", filepath.Join(pub, "old"))
	script := pyErrnoPrelude + `
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
from mooncake_fs import _abi
from mooncake_fs._buffer import pinned
c = mc.Client(sys.argv[2])
vals = {"new1": b"a" * 4096, "old": b"replaced", "locked/x": b"no", "big1": bytes(10 << 20),
        "big2": bytes(10 << 20), "new2": b"b" * 100}
with c.opendir("pub") as d, pinned(vals["new1"]) as p1, pinned(vals["old"]) as p2, \
        pinned(vals["locked/x"]) as p3, pinned(vals["big1"]) as p4, pinned(vals["big2"]) as p5, \
        pinned(vals["new2"]) as p6:
    entries = [mc.Entry("new1", *p1), mc.Entry("old", *p2), mc.Entry("locked/x", *p3),
               mc.Entry("fault", 8, 4096), mc.Entry("big1", *p4), mc.Entry("big2", *p5), mc.Entry("new2", *p6)]
    res = d.batch(_abi.BATCH_PUT, _abi.BATCH_VM, entries)
for e, (r, v) in zip(entries, res):
    print(f"{e.key}={errname(-r) if r < 0 else r}")
`
	out, err := asNobody(`exec "$1" -c "$2" "$3" "$4"`, python, script, publicPythonDir(t), d.dir)
	if err != nil {
		t.Fatalf("nobody's batch: %v\n%s", err, out)
	}
	got := pyResults(out)
	want := map[string]string{"new1": "4096", "old": "8", "locked/x": "EACCES", "fault": "EFAULT",
		"big1": fmt.Sprint(10 << 20), "big2": "ENOSPC", "new2": "100"}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q\n%s", k, got[k], v, out)
		}
	}
	for k, v := range map[string]string{"new1": strings.Repeat("a", 4096), "old": "replaced", "new2": strings.Repeat("b", 100)} {
		if b, err := os.ReadFile(filepath.Join(pub, k)); err != nil || string(b) != v {
			t.Errorf("%s after the batch: %q, %v", k, b, err)
		}
	}
	if st, err := os.Stat(filepath.Join(pub, "big1")); err != nil || st.Size() != 10<<20 {
		t.Errorf("big1 after the batch: %v, %v", st, err)
	}
	for _, k := range []string{"locked/x", "fault", "big2"} {
		if _, err := os.Stat(filepath.Join(pub, k)); err == nil {
			t.Errorf("failed key %s exists", k)
		}
	}
	d.checkAlive(t)
}
