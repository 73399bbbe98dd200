package tests

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestRenameDirWhileCreating: one process renames a directory back and
// forth while another creates files in it (open, and the key ioctls'
// puts by name), as an unprivileged user in a shared directory. A create that lands in the directory's old name after
// it moved made that name again, as a directory nobody owns (root's, of
// 1970) that its user could not remove; now the create fails (ENOENT) or
// the rename takes the file along, so one directory stays, the user's.
// Nor is a create ever refused (EACCES): a look at D between a move away
// and the move back found D gone and then keys under it, and took it for
// an implicit directory, root's.
func TestRenameDirWhileCreating(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "256MiB")
	pub := d.publicDir(t)
	script := `
import os, sys, time
root, secs, how = sys.argv[1], float(sys.argv[2]), sys.argv[3]
D, X = root + "/D", root + "/X"
if how != "open":
    sys.path.insert(0, sys.argv[4])
    import mooncake_fs as mc
    client, rel = mc.Client(sys.argv[5]), os.path.relpath(D, sys.argv[5])
os.mkdir(D)
def mover():
    end = time.time() + secs
    while time.time() < end:
        for a, b in ((D, X), (X, D)):
            try: os.rename(a, b)
            except OSError: pass
def creator():
    end, i, denied = time.time() + secs, 0, 0
    while time.time() < end:
        i += 1
        try:
            if how == "open":
                with open("%s/f%d" % (D, i % 50), "wb") as f: f.write(b"x")
            elif how == "put":
                client.put("%s/f%d" % (rel, i % 50), b"x", makedirs=False)
            else:
                client.batch_put({"f%d" % j: b"x" for j in range(i % 50, i % 50 + 8)}, dir=rel, check=False, makedirs=False)
        except PermissionError: denied += 1
        except OSError: pass
    return 3 if denied else 0
kids = []
for fn in (mover, creator):
    p = os.fork()
    if p == 0:
        code = 1
        try: code = fn() or 0
        finally: os._exit(code)
    kids.append(p)
denied = any(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 3 for p in kids)
print(" ".join(sorted(os.listdir(root))) + (" EACCES" if denied else ""))
`
	// Creates through the file system, then puts of one key and batch
	// puts by name (the key ioctls), which commit new keys the same way.
	for round, how := range []string{"open", "open", "put", "batch"} {
		dir := filepath.Join(pub, "r"+string(rune('0'+round)))
		if out, err := asNobody(`mkdir "$1" && exec "$2" -c "$3" "$1" 3 "$4" "$5" "$6"`, dir, python, script, how, publicPythonDir(t), d.dir); err != nil {
			t.Fatalf("race: %v\n%s", err, out)
		} else if got, denied := strings.CutSuffix(strings.TrimSpace(out), " EACCES"); denied {
			t.Fatalf("round %d (%s): a create in the user's own directory was refused with EACCES", round, how)
		} else if got != "D" && got != "X" {
			t.Fatalf("round %d: directories left: %q; want one, D or X", round, got)
		}
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			fi, err := e.Info()
			if err != nil {
				t.Fatal(err)
			}
			if st := fi.Sys().(*syscall.Stat_t); st.Uid != 65534 || st.Gid != 65534 {
				t.Fatalf("round %d: %s owned by %d:%d; want the creating user's", round, e.Name(), st.Uid, st.Gid)
			}
		}
		if out, err := asNobody(`rm -rf "$1"`, dir); err != nil {
			t.Fatalf("round %d: the user cannot remove its directory: %v\n%s", round, err, out)
		}
	}
	d.checkAlive(t)
}

// TestDirectoryRenameStorm: six processes make, remove, rename (also
// into each other) and fill four directories at random. Renames moved a
// directory that had been implicit (its last file removed) under its own
// inode number, which the next implicit directory of the old name took
// too: to the kernel one directory in two places, a loop, and the daemon
// walking up it grew until the OOM killer came. After the storm the tree
// must be a tree: every directory of one inode number, the walk
// finishes, and everything removes.
func TestDirectoryRenameStorm(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	d := startDaemon(t, "--size", "256MiB")
	root := d.path("storm")
	run(t, "mkdir", root)
	script := `
import os, random, sys, time
root, secs, procs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
def work(i):
    r, end = random.Random(i), time.time() + secs
    while time.time() < end:
        a, b = "%s/D%d" % (root, r.randint(0, 3)), "%s/D%d" % (root, r.randint(0, 3))
        op = r.randint(0, 7)
        try:
            if op == 0: os.mkdir(a)
            elif op == 1: os.rmdir(a)
            elif op == 2:
                with open("%s/f%d" % (a, r.randint(0, 5)), "wb") as f: f.write(b"x" * r.randint(0, 9000))
            elif op == 3: os.rename(a, b)
            elif op == 4: os.rename(a, "%s/sub%d" % (b, r.randint(0, 2)))
            elif op == 5: os.unlink("%s/f%d" % (a, r.randint(0, 5)))
            elif op == 6:
                for dp, dn, fn in os.walk(a, topdown=False):
                    for x in fn: os.unlink(os.path.join(dp, x))
                    for x in dn: os.rmdir(os.path.join(dp, x))
            else:
                os.makedirs("%s/sub%d/deep" % (a, r.randint(0, 2)), exist_ok=True)
                with open(a + "/sub0/deep/g", "wb") as f: f.write(b"y" * 100)
        except OSError:
            pass
kids = []
for i in range(procs):
    p = os.fork()
    if p == 0:
        try: work(i)
        finally: os._exit(0)
    kids.append(p)
for p in kids: os.waitpid(p, 0)
`
	py(t, script, root, "12", "6")
	st := d.checkAlive(t)
	inos := map[uint64]string{}
	err := filepath.WalkDir(root, func(p string, e os.DirEntry, err error) error {
		if err != nil || !e.IsDir() {
			return err
		}
		fi, err := e.Info()
		if err != nil {
			return err
		}
		ino := fi.Sys().(*syscall.Stat_t).Ino
		if other, dup := inos[ino]; dup {
			t.Errorf("%s and %s share inode %d", p, other, ino)
		}
		inos[ino] = p
		return nil
	})
	if err != nil {
		t.Fatalf("walk after the storm: %v (%d objects)", err, st.Objects)
	}
	run(t, "rm", "-rf", root)
	if st := d.quiesce(t); st.Objects != 0 {
		t.Fatalf("%d objects left after rm -rf", st.Objects)
	}
}

// TestRenameDirUnderDescriptors: while one process renames a directory
// back and forth, another works in it through a descriptor of it (and
// of a file in it), as programs with a working directory do: every call
// on what is in it finds it, as on tmpfs. They failed with ENOENT or
// ESTALE while a rename was between the store and go-fuse's tree (a
// quarter of the stats of files that never went away), and the kernel
// then kept the ENOENT as a negative entry, so the files stayed missing
// by path too for a second after the renames ended.
func TestRenameDirUnderDescriptors(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB")
	script := `
import errno, os, sys, time
root, secs = sys.argv[1], float(sys.argv[2])
os.makedirs(root + "/p/x")
N = 200
for i in range(N):
    with open(root + "/p/x/e%d" % i, "w") as f:
        f.write("v%d" % i)
dfd = os.open(root + "/p/x", os.O_RDONLY)
ffd = os.open(root + "/p/x/e0", os.O_RDONLY)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.read(r, 1)
    end = time.time() + secs
    while time.time() < end:
        os.rename(root + "/p/x", root + "/p/y")
        os.rename(root + "/p/y", root + "/p/x")
    os._exit(0)
def stat(i): os.stat("e%d" % i, dir_fd=dfd)
def read(i):
    fd = os.open("e%d" % i, os.O_RDONLY, dir_fd=dfd)
    try:
        got = os.read(fd, 100)
    finally:
        os.close(fd)
    if got != b"v%d" % i:
        raise OSError(errno.EIO, "e%d reads %r" % (i, got))
def chmod(i): os.chmod("e%d" % i, 0o644, dir_fd=dfd)
def xattr(i):
    try: os.getxattr("/proc/self/fd/%d/e%d" % (dfd, i), "user.none")
    except OSError as e:
        if e.errno != errno.ENODATA: raise
def create(i):
    fd = os.open("c%d" % i, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644, dir_fd=dfd)
    os.close(fd)
    os.unlink("c%d" % i, dir_fd=dfd)
def mkdir(i):
    os.mkdir("d%d" % i, dir_fd=dfd)
    os.rmdir("d%d" % i, dir_fd=dfd)
def fstat(i):
    for fd in (dfd, ffd):
        if os.fstat(fd).st_nlink == 0:
            raise OSError(errno.ESTALE, "fstat shows no link")
ops = [stat, read, chmod, xattr, create, mkdir, fstat]
fails, n = {}, 0
os.write(w, b"g")
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    op = ops[n % len(ops)]
    try:
        op(n % N)
    except OSError as e:
        k = "%s %s" % (op.__name__, errno.errorcode.get(e.errno, e.strerror))
        fails[k] = fails.get(k, 0) + 1
    n += 1
missing = [i for i in range(N) if not os.path.exists(root + "/p/x/e%d" % i)]
print(n, sorted(fails.items()), missing[:5])
`
	out := strings.Fields(strings.TrimSpace(py(t, script, filepath.Join(d.dir, "u"), "2")))
	if len(out) < 1 {
		t.Fatalf("no output")
	}
	if got := strings.Join(out[1:], " "); got != "[] []" {
		t.Errorf("calls on a directory's files through descriptors while it was renamed (%s calls): failures and files missing after: %s; want none", out[0], got)
	}
}
