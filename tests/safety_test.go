package tests

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// The tests of this file each rebuild one way a user or a busy program
// broke the mount's promises (lost writes, a hung mount, partial files,
// unbounded daemon memory), driven from child processes as those users
// would.

// TestRegisterRefusesMountFiles: a buffer registered from a file of the
// mount itself would make the daemon fault on its own pages and hang the
// mount for everyone. nobody tries it; the registration is refused and
// the mount keeps answering. Process memory mapped from the mount still
// moves (process_vm_* faults are served by other requests).
func TestRegisterRefusesMountFiles(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "128MiB")
	pub := d.publicDir(t)
	script := pyErrnoPrelude + `
import ctypes, mmap
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
d = sys.argv[2]
n = 16 << 20
for name in ("A", "B"):
    with open(d + "/" + name, "wb") as f:
        f.write(b"\1" * n)
a = os.open(d + "/A", os.O_RDWR)
f = mc.File(d + "/B", "w")
try_("register_mount_file", f.register, a, n)
m = mmap.mmap(a, n)
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
try_("put_vm_mount_mapped", f.put_vm, addr, n)
`
	out, err := asNobody(`exec "$1" -c "$2" "$3" "$4"`, python, script, publicPythonDir(t), pub)
	if err != nil {
		t.Fatalf("nobody's script: %v\n%s", err, out)
	}
	checkResults(t, out, map[string]string{"register_mount_file": "EINVAL", "put_vm_mount_mapped": "OK"})
	if got := strings.Fields(run(t, "ls", pub)); strings.Join(got, " ") != "A B" {
		t.Errorf("ls after the refused registration: %v", got)
	}
	if st := d.checkAlive(t); st.OpenFiles.Used > st.OpenFiles.Limit {
		t.Errorf("open files %d over the limit %d", st.OpenFiles.Used, st.OpenFiles.Limit)
	}
}

// TestWriteAfterEviction: a file evicted while the kernel still has its
// name cached is opened for writing: the open reaches a live file (a new
// one with O_CREAT) or fails, and what is written and closed is there.
func TestWriteAfterEviction(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "256MiB")
	local := t.TempDir()
	writeRandom(t, filepath.Join(local, "A"), 100*miB, 1)
	writeRandom(t, filepath.Join(local, "B"), 148*miB, 2)
	for _, flags := range []string{"os.O_WRONLY", "os.O_WRONLY | os.O_CREAT | os.O_TRUNC", "os.O_RDWR | os.O_CREAT"} {
		run(t, "rm", "-f", d.path("A"), d.path("B"))
		run(t, "cp", filepath.Join(local, "A"), d.path("A"))
		// The script stats A (the kernel caches it), has another process
		// write B (which evicts A), then writes A at once.
		out := py(t, pyErrnoPrelude+`
import subprocess
d, b = sys.argv[1], sys.argv[2]
os.stat(d + "/A")
subprocess.run(["cp", b, d + "/B"], check=True)
fd = try_("open", os.open, d + "/A", `+flags+`, 0o644)
if fd is not None:
    os.write(fd, b"hello")
    try_("fsync", os.fsync, fd)
    try_("fstat", os.fstat, fd)
    try_("close", os.close, fd)
`, d.dir, filepath.Join(local, "B"))
		got := pyResults(out)
		if got["open"] != "OK" {
			if got["open"] != "ENOENT" || strings.Contains(flags, "O_CREAT") {
				t.Errorf("%s: open = %s, want OK (or ENOENT without O_CREAT)\n%s", flags, got["open"], out)
			}
			continue
		}
		checkResults(t, out, map[string]string{"fsync": "OK", "fstat": "OK", "close": "OK"})
		if st := d.status(t); st.Evict.Evictions == 0 {
			t.Fatalf("%s: writing B evicted nothing; the test did not test", flags)
		}
		b, err := os.ReadFile(d.path("A"))
		if err != nil {
			t.Errorf("%s: the write to A succeeded, and A is gone: %v", flags, err)
		} else if !strings.HasPrefix(string(b), "hello") {
			t.Errorf("%s: A after the write starts with %q", flags, b[:min(len(b), 16)])
		}
	}
}

// TestRenameOverIsAtomic: the write-temp-then-rename pattern. One process
// keeps replacing a name, others keep opening, reading, stating, reading
// the attributes of and recreating it: on a local file system none of
// them ever fails.
func TestRenameOverIsAtomic(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "128MiB")
	run(t, "sh", "-c", `echo first > "$1/rr"`, "sh", d.dir)
	script := `
import collections, errno, os, sys
d, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
fails = collections.Counter()
for i in range(n):
    try:
        if mode == "rename":
            t = "%s/.t%d" % (d, i % 4)
            with open(t, "wb") as f:
                f.write(b"v%08d" % i + b"x" * 1000)
            os.rename(t, d + "/rr")
        elif mode == "read":
            with open(d + "/rr", "rb") as f:
                b = f.read()
            # the creat process empties it now and then
            if not (b in (b"", b"first\n") or (b.startswith(b"v") and len(b) == 1009)):
                fails["torn"] += 1
            os.stat(d + "/rr")
            # As ls -l: the name's attributes right after its stat.
            try:
                os.getxattr(d + "/rr", "security.selinux", follow_symlinks=False)
            except OSError as e:
                if e.errno != errno.ENODATA:
                    raise
            os.listxattr(d + "/rr", follow_symlinks=False)
        else:
            os.close(os.open(d + "/rr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    except OSError as e:
        fails[errno.errorcode[e.errno]] += 1
print(mode, "fails", sum(fails.values()), dict(fails))
`
	const n = 3000
	readers := []*bg{
		background(t, python, "-c", script, d.dir, "read", strconv.Itoa(n)),
		background(t, python, "-c", script, d.dir, "read", strconv.Itoa(n)),
		background(t, python, "-c", script, d.dir, "creat", strconv.Itoa(n)),
	}
	out := run(t, python, "-c", script, d.dir, "rename", strconv.Itoa(n))
	for _, r := range readers {
		out += r.mustWait(t)
	}
	for line := range strings.SplitSeq(strings.TrimSpace(out), "\n") {
		if !strings.Contains(line, "fails 0 ") {
			t.Errorf("%s", line)
		}
	}
}

// TestForkDoesNotPublish: a writer that runs a child process while its
// file is half written (subprocess, with and without the descriptor
// passed on) publishes nothing until it closes the file itself; a reader
// meanwhile reads the old version, whole.
func TestForkDoesNotPublish(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "128MiB")
	out := py(t, `
import os, subprocess, sys
p = sys.argv[1] + "/f"
old = b"old" * 1000
with open(p, "wb") as f:
    f.write(old)
def reader():
    return subprocess.run(["cat", p], capture_output=True, check=True).stdout
f = open(p, "wb")
f.write(b"n" * (5 << 20))
f.flush()
subprocess.run(["true"], check=True)
print("after_exec=" + ("old" if reader() == old else "changed"))
subprocess.run(["sh", "-c", "exit 0"], pass_fds=(f.fileno(),), check=True)
print("after_inherit=" + ("old" if reader() == old else "changed"))
f.write(b"m" * 100)
f.close()
print("after_close=" + ("new" if reader() == b"n" * (5 << 20) + b"m" * 100 else "wrong"))
# A child that writes through the inherited descriptor publishes when it
# exits: it changed the file.
fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
os.write(fd, b"a" * 100)
subprocess.run([sys.executable, "-c", "import os, sys; os.write(int(sys.argv[1]), b'b' * 100)", str(fd)], pass_fds=(fd,), check=True)
print("after_child_wrote=" + ("both" if reader() == b"a" * 100 + b"b" * 100 else "other"))
os.close(fd)
# Written by this process, closed by another of its threads: published
# when close returns.
import threading
fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
os.write(fd, b"t" * 4096)
th = threading.Thread(target=os.close, args=(fd,))
th.start(); th.join()
print("after_thread_close=" + ("new" if reader() == b"t" * 4096 else "old"))
`, d.dir)
	checkResults(t, out, map[string]string{"after_exec": "old", "after_inherit": "old", "after_close": "new",
		"after_child_wrote": "both", "after_thread_close": "new"})
}

// TestForkedThreadIDDoesNotPublish: the thread that opened a file may
// exit and its id go to a thread of a forked child; that child's close,
// by that thread or another, is still an inheritor's and publishes
// nothing of the half-written file. The test takes the id with
// ns_last_pid (root), again if another process gets it first, a few
// clock ticks after the open: within the open's own tick the daemon
// takes the id's thread for the opener (ids come back that fast only to
// root, and a program's first file is often opened that soon).
func TestForkedThreadIDDoesNotPublish(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	if os.Geteuid() != 0 {
		t.Skip("needs root: /proc/sys/kernel/ns_last_pid")
	}
	d := startDaemon(t, "--size", "64MiB")
	out := py(t, `
import os, sys, threading, time
p = sys.argv[1] + "/f"
def state():
    with open(p, "rb") as f:
        return "old" if f.read() == b"old" else "changed"
for how in ("by_that_thread", "by_another"):
    with open(p, "wb") as f:
        f.write(b"old")
    box = {}
    def opener():
        box["tid"] = threading.get_native_id()
        box["fd"] = os.open(p, os.O_WRONLY | os.O_TRUNC)
        os.write(box["fd"], b"n" * 4096)  # half of what it will write
    t = threading.Thread(target=opener); t.start(); t.join()
    time.sleep(0.05)  # the id comes back ticks after the open (USER_HZ is 100)
    tid, fd = box["tid"], box["fd"]
    pid = os.fork()
    if pid == 0:
        got = [False]
        def probe():
            if threading.get_native_id() == tid:
                got[0] = True
                if how == "by_that_thread":
                    os.close(fd)
                else:
                    held.wait()
        for _ in range(200):
            held = threading.Event()
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(tid - 1))
            th = threading.Thread(target=probe); th.start()
            if how == "by_another":
                th.join(0.05)
                if got[0]:
                    os.close(fd)  # the child's main thread, beside the reused id
                held.set()
            th.join()
            if got[0]:
                break
        os._exit(0 if got[0] else 3)
    _, st = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(st)
    print(how + "=" + ("noid" if code == 3 else state()))
    os.write(fd, b"m" * 4096)
    os.close(fd)
    print(how + "_own_close=" + state())
`, d.dir)
	res := pyResults(out)
	for _, how := range []string{"by_that_thread", "by_another"} {
		switch res[how] {
		case "noid":
			t.Logf("%s: the child never got the thread id; not checked", how)
		case "old":
		default:
			t.Errorf("%s: the child's close left the file %q, want old", how, res[how])
		}
		if res[how+"_own_close"] != "changed" {
			t.Errorf("%s: after the writer's own close the file is %q, want changed", how, res[how+"_own_close"])
		}
	}
}

// TestMappedWriteClosedByAnotherThread: a file changed only through a
// shared mapping and closed by another thread of its process (as Go
// programs and thread pools do) is published when close returns, not at
// the release that follows it.
func TestMappedWriteClosedByAnotherThread(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "128MiB")
	_, m := client(t, "mapped-close-thread", d.dir)
	want(t, m, "mapped_close_thread", "OK")
	d.checkAlive(t)
}

// TestConcurrentRewritesNeverTorn: several processes rewrite one name
// with O_TRUNC at once, each value carrying its length and checksum;
// readers, reading in 64 KiB pieces, only ever see one writer's whole
// value.
func TestConcurrentRewritesNeverTorn(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "128MiB")
	script := `
import hashlib, os, random, struct, sys
p, mode, n = sys.argv[1] + "/tw", sys.argv[2], int(sys.argv[3])
rnd = random.Random(os.getpid())
ok = bad = 0
for i in range(n):
    if mode == "write":
        body = os.urandom(rnd.choice([49, 1000, 100000, 256 << 10, 1 << 20]))
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(body)) + hashlib.sha256(body).digest())
            f.write(body)
        continue
    try:
        with open(p, "rb", buffering=0) as f:
            # In pieces, as a reader of a large value does: every piece
            # must come from the version the first one did.
            b = b"".join(iter(lambda: f.read(64 << 10), b""))
    except FileNotFoundError:
        continue
    size = struct.unpack("<Q", b[:8])[0] if len(b) >= 8 else -1
    if len(b) == 40 + size and hashlib.sha256(b[40:]).digest() == b[8:40]:
        ok += 1
    else:
        bad += 1
        print("torn: %d B, header says %d" % (len(b), size))
print(mode, "ok", ok, "bad", bad)
`
	// A first value, so that no reader meets the empty file that
	// creating the name makes.
	run(t, python, "-c", script, d.dir, "write", "1")
	var procs []*bg
	for range 3 {
		procs = append(procs, background(t, python, "-c", script, d.dir, "write", "300"))
	}
	procs = append(procs, background(t, python, "-c", script, d.dir, "read", "1500"))
	out := ""
	for _, p := range procs {
		out += p.mustWait(t)
	}
	if strings.Contains(out, "torn") || !strings.Contains(out, "read ok") {
		t.Errorf("readers saw torn values:\n%s", out)
	}
}

// TestFailedWriteKeepsVersion: a rewrite that runs out of space fails at
// close, and the file keeps the version it had: nothing partial is
// published.
func TestFailedWriteKeepsVersion(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "64MiB", "--evict", "off")
	run(t, "sh", "-c", `printf keep > "$1"`, "sh", d.path("f"))
	out := py(t, pyErrnoPrelude+`
p = sys.argv[1]
fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
chunk = b"z" * (1 << 20)
for i in range(100):
    if try_("write%d" % i, os.write, fd, chunk) is None:
        break
try_("again", os.write, fd, b"x")
try_("close", os.close, fd)
`, d.path("f"))
	if !strings.Contains(out, "=ENOSPC") {
		t.Fatalf("100 MiB into a 64 MiB store never failed:\n%s", out)
	}
	checkResults(t, out, map[string]string{"close": "ENOSPC"})
	// Once a write failed, later writes through the file fail too: none
	// may look as if it landed in a file that cannot publish.
	if got := pyResults(out); !strings.Contains(out, "=ENOSPC") || got["again"] != "ENOSPC" {
		t.Errorf("a write after the failed one: %q, want ENOSPC\n%s", got["again"], out)
	}
	if b, err := os.ReadFile(d.path("f")); err != nil || string(b) != "keep" {
		t.Errorf("f after the failed rewrite: %d B starting %q, %v; want %q", len(b), b[:min(len(b), 16)], err, "keep")
	}
	waitFor(t, "the failed draft's space back", func() (bool, string) {
		st := d.status(t)
		return st.Used < 1*miB && st.OpenObjects == 0, fmt.Sprintf("used %d, open %d", st.Used, st.OpenObjects)
	})
}

// TestXattrsBounded: nobody cannot grow the daemon without bound through
// extended attributes: one file holds at most 128 KiB of them, and no
// more names than listxattr can list (64 KiB with their NULs), the mount
// a documented share of its capacity (status shows it), and past either
// setxattr fails with ENOSPC while everything else keeps working.
func TestXattrsBounded(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "64MiB")
	pub := d.publicDir(t)
	script := pyErrnoPrelude + `
d = sys.argv[1]
v = b"x" * (64 << 10)
open(d + "/one", "wb").close()
for i in range(3):
    try_("one_%d" % i, os.setxattr, d + "/one", "user.a%d" % i, v)
# Names alone: the list listxattr answers stays within the kernel's 64 KiB.
open(d + "/names", "wb").close()
named = 0
for i in range(1000):
    try:
        os.setxattr(d + "/names", "user." + ("%04d" % i) * 50, b"v")
        named += 1
    except OSError as e:
        print("names_stopped=" + errno.errorcode[e.errno])
        break
print("listed_names=%d" % (len(os.listxattr(d + "/names")) == named))
try_("names_replace", os.setxattr, d + "/names", "user." + "0000" * 50, b"w")
done = 0
for i in range(2000):
    p = "%s/f%d" % (d, i)
    open(p, "wb").close()
    try:
        os.setxattr(p, "user.big", v)
        done += 1
    except OSError as e:
        print("stopped_at=%d %s" % (done, errno.errorcode[e.errno]))
        break
`
	// Names up to the list's bound (to within a few bytes; the pin listed)
	// leave room for the meta a put adds.
	meta := py(t, keysPrelude+`
p = mnt + "/named"
open(p, "wb").close()
os.setxattr(p, "user.mooncake.pin", b"1")
i = 0
for length in (205, 100, 50, 25, 12):
    while True:
        base = "user.%x." % i
        try:
            os.setxattr(p, base + "z" * max(0, length - len(base)), b"v")
            i += 1
        except OSError:
            break
print("listed=%d" % len(b"".join(n.encode() + b"\0" for n in os.listxattr(p))))
d = mc.Directory(mnt)
res("meta_put", lambda: d.put_key("named", b"v", meta=b"m") > 0)
res("listed_after", lambda: "user.mooncake.meta" in os.listxattr(p))
os.setxattr(p, "user.mooncake.pin", b"0")
os.unlink(p)
`, publicPythonDir(t), d.dir)
	checkResults(t, meta, map[string]string{"meta_put": "True", "listed_after": "True"})
	out, err := asNobody(`exec "$1" -c "$2" "$3"`, python, script, pub)
	if err != nil {
		t.Fatalf("nobody's script: %v\n%s", err, out)
	}
	checkResults(t, out, map[string]string{"one_0": "OK", "one_1": "ENOSPC", "one_2": "ENOSPC",
		"names_stopped": "ENOSPC", "listed_names": "1", "names_replace": "OK"})
	// A put with a meta adds user.mooncake.meta: the names left room for it.

	stop, ok := pyResults(out)["stopped_at"]
	if !ok || !strings.HasSuffix(stop, "ENOSPC") {
		t.Fatalf("2000 xattrs of 64 KiB in a 64 MiB store all succeeded (or failed otherwise): %q\n%s", stop, lastLines(out, 5))
	}
	st := d.checkAlive(t)
	if st.Metadata.Limit == 0 || st.Metadata.Used > st.Metadata.Limit+128<<10 {
		t.Errorf("metadata %d B, limit %d B", st.Metadata.Used, st.Metadata.Limit)
	}
	t.Logf("xattrs stopped at %s; metadata %d of %d B", stop, st.Metadata.Used, st.Metadata.Limit)
	// Removing files gives the room back.
	run(t, "sh", "-c", `rm -f "$1"/f*`, "sh", pub)
	run(t, "setfattr", "-n", "user.again", "-v", "1", filepath.Join(pub, "one"))
}

// TestTruncateRacesRelease: truncate(2) by path right after a writer's
// close, while the kernel's release of that writer may still be
// publishing: it never fails and is never lost.
func TestTruncateRacesRelease(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "128MiB")
	out := py(t, `
import collections, errno, os, sys, threading, time
p = sys.argv[1] + "/t"
errs, lost = collections.Counter(), 0
for i in range(2000):
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"x" * 65536)
    th = threading.Thread(target=os.close, args=(fd,))
    th.start(); th.join()
    try:
        os.truncate(p, 0)
    except OSError as e:
        errs[errno.errorcode[e.errno]] += 1
        continue
    for _ in range(100):
        if os.stat(p).st_size == 0:
            break
        time.sleep(0.01)
    else:
        lost += 1
print("errors=%d %s" % (sum(errs.values()), dict(errs)))
print("lost=%d" % lost)
`, d.dir)
	got := pyResults(out)
	if !strings.HasPrefix(got["errors"], "0 ") || got["lost"] != "0" {
		t.Errorf("truncate after close:\n%s", out)
	}
}

// TestKilledWriterPublishesNothing: a process rewriting a file (O_TRUNC)
// is killed with SIGKILL halfway: the kernel closes its files, and the
// file keeps its old version. One that exits without closing (exit(3)
// closes its files) publishes, as a close would.
func TestKilledWriterPublishesNothing(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "128MiB")
	out := py(t, `
import os, signal, subprocess, sys, time
p = sys.argv[1] + "/f"
with open(p, "wb") as f:
    f.write(b"old")
child = subprocess.Popen([sys.executable, "-c", """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC)
os.write(fd, b"half" * 100000)
print("ready", flush=True)
time.sleep(60)
""", p], stdout=subprocess.PIPE)
child.stdout.readline()
child.send_signal(signal.SIGKILL)
child.wait()
for _ in range(200):  # the release comes after the kill
    b = open(p, "rb").read()
    if b != b"old":
        break
    time.sleep(0.01)
print("after_kill=" + ("old" if b == b"old" else "changed:%d" % len(b)))
subprocess.run([sys.executable, "-c",
    "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC); os.write(fd, b'done'); os._exit(0)", p], check=True)
print("after_exit=" + ("new" if open(p, "rb").read() == b"done" else "old"))
`, d.dir)
	checkResults(t, out, map[string]string{"after_kill": "old", "after_exit": "new"})
}

// TestStatWhileOpen: a file some process holds open answers stat, and the
// kernel's permission checks, as it is now, not as the version the
// holder reads: a chmod 600 keeps other users out, and a file rewritten
// since copies whole. (--cache-timeout 0: the kernel asks the daemon at
// every stat and check, as it does after a second by default.)
func TestStatWhileOpen(t *testing.T) {
	t.Parallel()
	requireTools(t, "setpriv")
	d := startDaemon(t, "--size", "64MiB", "--cache-timeout", "0")
	run(t, "chmod", "0755", d.dir)
	secret, f := d.path("secret"), d.path("f")
	holder := background(t, python, "-c", `
import os, sys, time
secret, f = sys.argv[1], sys.argv[2]
with open(secret, "w") as w:
    w.write("top secret")
os.chmod(secret, 0o644)
with open(f, "wb") as w:
    w.write(b"A" * 5000)
hs, hf = open(secret, "rb"), open(f, "rb")  # held open, old versions
os.chmod(secret, 0o600)
with open(f, "wb") as w:
    w.write(b"B" * 20000)
print(f"held_reads={len(hf.read())}", flush=True)
print("ready", flush=True)
time.sleep(60)
`, secret, f)
	holder.waitOutput(t, "ready")
	if out, err := asNobody(`cat "$1"`, secret); err == nil || !strings.Contains(out, "Permission denied") {
		t.Errorf("nobody read a mode-600 file held open by root: %v\n%s", err, out)
	}
	if out := run(t, "stat", "-c", "%s %a", f, secret); out != "20000 644\n10 600\n" {
		t.Errorf("stat of files held open: %q, want the current sizes and modes", out)
	}
	run(t, "cp", f, d.path("copy"))
	if out := run(t, "stat", "-c", "%s", d.path("copy")); out != "20000\n" {
		t.Errorf("cp of a rewritten file held open at its old version: %s B, want 20000", strings.TrimSpace(out))
	}
}
