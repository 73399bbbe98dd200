package tests

import (
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// TestBadInput feeds one daemon requests it must refuse with the right
// errno, changing nothing; after each case the daemon still serves.
func TestBadInput(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "32MiB", "--evict", "off")
	for _, c := range []struct {
		name string
		fn   func(t *testing.T, d *daemon, dir string)
	}{
		{"NameTooLong", testNameTooLong},
		{"PathTooLong", testPathTooLong},
		{"Ioctl", testIoctl},
		{"NoSpace", testNoSpace},
		{"Xattr", testBadXattr},
		{"Namespace", testBadNamespace},
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

func testNameTooLong(t *testing.T, d *daemon, dir string) {
	out := py(t, pyErrnoPrelude+`
d = sys.argv[1]
n255, n256 = "a" * 255, "b" * 256
fd = try_("create255", os.open, f"{d}/{n255}", os.O_CREAT | os.O_WRONLY, 0o644)
if fd is not None:
    os.write(fd, b"x" * 100)
    os.close(fd)
    with open(f"{d}/{n255}", "rb") as f:
        print("content255=" + ("OK" if f.read() == b"x" * 100 else "BAD"))
print("listed255=" + ("OK" if n255 in os.listdir(d) else "MISSING"))
try_("create256", os.open, f"{d}/{n256}", os.O_CREAT | os.O_WRONLY, 0o644)
try_("stat256", os.stat, f"{d}/{n256}")
try_("mkdir256", os.mkdir, f"{d}/{n256}")
try_("rename255to256", os.rename, f"{d}/{n255}", f"{d}/{n256}")
try_("stat255", os.stat, f"{d}/{n255}")
try_("mkdir255", os.mkdir, f"{d}/d{n255[1:]}")
try_("unlink255", os.unlink, f"{d}/{n255}")
`, dir)
	checkResults(t, out, map[string]string{
		"create255": "OK", "content255": "OK", "listed255": "OK",
		"create256": "ENAMETOOLONG", "stat256": "ENAMETOOLONG", "mkdir256": "ENAMETOOLONG",
		"rename255to256": "ENAMETOOLONG", "stat255": "OK", "mkdir255": "OK", "unlink255": "OK",
	})
}

// testPathTooLong: a path over PATH_MAX, and keys over 4095 bytes made by
// walking down (relative paths) or by renaming a directory to a longer
// name.
func testPathTooLong(t *testing.T, d *daemon, dir string) {
	out := py(t, pyErrnoPrelude+`
mnt, d = sys.argv[1], sys.argv[2]
try_("path4097", os.open, d + "/" + "p/" * 2100 + "f", os.O_CREAT | os.O_WRONLY, 0o644)

# Walk down with relative paths: every syscall path is short, but the key
# (the path from the mount root) grows by 201 bytes a level.
base = os.path.relpath(d, mnt)
os.chdir(d)
keylen, level, name = len(base), 0, "n" * 200
while True:
    level += 1
    if keylen + 1 + len(name) > 4095:
        try_("mkdir_over_4095", os.mkdir, name)
        fd = try_("create_over_4095", os.open, name, os.O_CREAT | os.O_WRONLY, 0o644)
        if fd is not None:
            os.close(fd)
        break
    os.mkdir(name)
    os.chdir(name)
    keylen += 1 + len(name)
deep = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
longest = "e" * (4095 - keylen - 1)
fd = try_("create_4095", os.open, longest, os.O_CREAT | os.O_WRONLY, 0o644)
if fd is not None:
    os.write(fd, b"deep")
    os.close(fd)
try_("create_4096", os.open, longest + "g", os.O_CREAT | os.O_WRONLY, 0o644)

# Renaming the top directory to a longer name would push the key of the
# file above past 4095 bytes: refused, or the file stays usable.
os.chdir(d)
try_("rename_top_longer", os.rename, name, "L" * 250)
os.fchdir(deep)
def rewrite():
    with open(longest, "wb") as f:
        f.write(b"after")
    with open(longest, "rb") as f:
        if f.read() != b"after":
            raise OSError(errno.EIO, "content")
try_("deep_stat", os.stat, longest)
try_("deep_rewrite", rewrite)
os.chdir(d)
os.close(deep)
import shutil
try_("rmtree", shutil.rmtree, "L" * 250 if os.path.exists("L" * 250) else name)
print("left=%d" % len(os.listdir(d)))
`, d.dir, dir)
	checkResults(t, out, map[string]string{
		"path4097":          "ENAMETOOLONG",
		"mkdir_over_4095":   "ENAMETOOLONG",
		"create_over_4095":  "ENAMETOOLONG",
		"create_4095":       "OK",
		"create_4096":       "ENAMETOOLONG",
		"rename_top_longer": "ENAMETOOLONG|OK",
		"deep_rewrite":      "OK",
		"deep_stat":         "OK",
		"rmtree":            "OK",
		"left":              "0",
	})
}

// ioctlScript issues the probes and unknown commands on a mounted file.
const ioctlScript = `
import fcntl, random, struct
f, seed = sys.argv[1], int(sys.argv[2])
def IOC(dir, typ, nr, size):
    return (dir << 30) | (size << 16) | (typ << 8) | nr
M = ord("M")
fd = os.open(f, os.O_RDONLY)

buf = bytearray(16)
if try_("get_magic", fcntl.ioctl, fd, IOC(2, M, 1, 16), buf, True) is not None:
    print("magic=" + buf.hex())
buf = bytearray(16)
if try_("get_abi", fcntl.ioctl, fd, IOC(2, M, 2, 16), buf, True) is not None:
    size, flags, major, minor = struct.unpack("<IIII", buf)
    print(f"abi={major}.{minor}")

try_("other_type", fcntl.ioctl, fd, IOC(3, ord("q"), 0x9d, 24), bytearray(24), True)
try_("m_unknown_nr", fcntl.ioctl, fd, IOC(3, M, 0xee, 16), bytearray(16), True)
try_("m_no_arg", fcntl.ioctl, fd, IOC(0, M, 0x7f, 0), 0)
try_("m_magic_short", fcntl.ioctl, fd, IOC(2, M, 1, 8), bytearray(8), True)
try_("m_magic_write", fcntl.ioctl, fd, IOC(1, M, 1, 16), bytearray(16), True)
try_("m_max_size", fcntl.ioctl, fd, IOC(3, M, 0x55, 16383), bytearray(16383), True)

# File flags (lsattr, chattr): none set, none kept; clearing them is fine.
flags = bytearray(8)
if try_("getflags", fcntl.ioctl, fd, 0x80086601, flags, True) is not None:
    print("flags=" + flags.hex())
try_("setflags_none", fcntl.ioctl, fd, 0x40086602, struct.pack("l", 0))
try_("setflags_immutable", fcntl.ioctl, fd, 0x40086602, struct.pack("l", 0x10))

# Random commands; type bytes the VFS or other layers answer themselves
# (0x00 FIBMAP/FIGETBSZ, 'T' FIO*, 'f' and 'X' file attributes, 0x94
# FICLONE, 0x15 FS_IOC_GETFSUUID) are left out.
print("seed", seed)
rng = random.Random(seed)
skip = {0x00, ord("T"), ord("f"), ord("X"), 0x94, 0x15}
bad = []
for i in range(64):
    typ = M if i % 2 else rng.choice([x for x in range(256) if x not in skip | {M}])
    nr = rng.choice([x for x in range(256) if typ != M or x not in (1, 2)])
    size = rng.choice([0, 1, 8, 16, 24, 64, 256, 4096, 16383])
    dir = 0 if size == 0 else rng.randint(1, 3)
    cmd = IOC(dir, typ, nr, size)
    try:
        fcntl.ioctl(fd, cmd, 0) if size == 0 else fcntl.ioctl(fd, cmd, bytearray(size), True)
        bad.append(f"{cmd:#x}:OK")
    except OSError as e:
        if e.errno != errno.ENOTTY:
            bad.append(f"{cmd:#x}:{errname(e.errno)}")
print("random=" + ("OK" if not bad else ",".join(bad)))
os.close(fd)
`

// testIoctl: the probes answer the magic and ABI version; unknown commands
// of any type byte answer ENOTTY.
func testIoctl(t *testing.T, d *daemon, dir string) {
	f := filepath.Join(dir, "f")
	run(t, "sh", "-c", `printf data > "$1"`, "sh", f)
	out := py(t, pyErrnoPrelude+ioctlScript, f, "1234")
	// GET_MAGIC fills {size=16, flags=0, magic} little-endian.
	wantMagic := "1000000000000000" + fmt.Sprintf("%016x", byteSwap(ioctl.MagicValue))
	checkResults(t, out, map[string]string{
		"get_magic": "OK", "magic": wantMagic,
		"get_abi": "OK", "abi": fmt.Sprintf("%d.%d", ioctl.ABIMajor, ioctl.ABIMinor),
		"other_type": "ENOTTY", "m_unknown_nr": "ENOTTY", "m_no_arg": "ENOTTY",
		"m_magic_short": "ENOTTY", "m_magic_write": "ENOTTY", "m_max_size": "ENOTTY",
		"random": "OK", "getflags": "OK", "flags": "0000000000000000", "setflags_none": "OK", "setflags_immutable": "EOPNOTSUPP",
	})

	// The Go client's Probe, from a helper process.
	out = run(t, probeBin(), f)
	if want := fmt.Sprintf("abi=%d.%d", ioctl.ABIMajor, ioctl.ABIMinor); !strings.Contains(out, want) {
		t.Errorf("probe %s = %q, want %s", f, out, want)
	}
	local := filepath.Join(t.TempDir(), "local")
	run(t, "touch", local)
	out, err := runErr(probeBin(), local)
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Errorf("probe of a local file: %v (want exit 3, not mooncake-fs)\n%s", err, out)
	}
	if got := strings.TrimSpace(run(t, "cat", f)); got != "data" {
		t.Errorf("content after the ioctls = %q", got)
	}
}

// byteSwap reverses the bytes of v: the hex of a little-endian word.
func byteSwap(v uint64) uint64 {
	var r uint64
	for range 8 {
		r = r<<8 | v&0xff
		v >>= 8
	}
	return r
}

// testNoSpace: writes past the capacity of a non-evicting store fail with
// ENOSPC, committed files stay intact, and nothing leaks.
func testNoSpace(t *testing.T, d *daemon, dir string) {
	local := t.TempDir()
	keep := []string{filepath.Join(local, "keep1"), filepath.Join(local, "keep2")}
	for i, k := range keep {
		writeRandom(t, k, 4*miB+int64(i), uint64(400+i))
		run(t, "cp", k, filepath.Join(dir, filepath.Base(k)))
	}
	before := d.quiesce(t)

	out, err := runErr("dd", "if=/dev/zero", "of="+filepath.Join(dir, "big"), "bs=1M", "count=64", "status=none")
	if err == nil || !strings.Contains(out, "No space left on device") {
		t.Errorf("dd of 64 MiB into a 32 MiB store: %v, want ENOSPC\n%s", err, out)
	}
	out = py(t, pyErrnoPrelude+`
d = sys.argv[1]
fd = os.open(d + "/huge", os.O_CREAT | os.O_RDWR, 0o644)
try_("pwrite_1TiB", os.pwrite, fd, b"x", 1 << 40)
try_("ftruncate_1TiB", os.ftruncate, fd, 1 << 40)
try_("fallocate_1TiB", os.posix_fallocate, fd, 0, 1 << 40)
try_("close", os.close, fd)
try_("truncate_keep1_1TiB", os.truncate, d + "/keep1", 1 << 40)
print("huge_size=%d" % os.stat(d + "/huge").st_size)
`, dir)
	checkResults(t, out, map[string]string{
		"pwrite_1TiB": "ENOSPC|EFBIG", "ftruncate_1TiB": "ENOSPC|EFBIG", "fallocate_1TiB": "ENOSPC|EFBIG",
		"close": "ENOSPC|EFBIG", "truncate_keep1_1TiB": "ENOSPC|EFBIG", "huge_size": "0",
	})
	for _, k := range keep {
		run(t, "cmp", k, filepath.Join(dir, filepath.Base(k)))
	}
	run(t, "rm", "-f", filepath.Join(dir, "big"), filepath.Join(dir, "huge"))
	waitFor(t, "used back to its value before the failed writes", func() (bool, string) {
		s := d.status(t)
		return s.OpenObjects == 0 && s.Used == before.Used,
			fmt.Sprintf("used %d open %d, before %d", s.Used, s.OpenObjects, before.Used)
	})
}

// testBadXattr: computed attributes are read-only, pin takes 0 or 1, and
// a refused change changes nothing; trusted.* and security.* are kept
// like user.* (the kernel checks the caller), system.* and
// security.capability are refused, and so is a placement that a mount
// outside a cluster can never meet (more than one replica, another node).
func testBadXattr(t *testing.T, d *daemon, dir string) {
	f := filepath.Join(dir, "f")
	run(t, "sh", "-c", `head -c 1234 /dev/zero > "$1"`, "sh", f)
	out := py(t, pyErrnoPrelude+`
f, dir_ = sys.argv[1], sys.argv[2]
for name in ("size", "version", "location", "status", "bogus"):
    try_("set_" + name, os.setxattr, f, "user.mooncake." + name, b"5")
for label, v in (("banana", b"banana"), ("empty", b""), ("two", b"2")):
    try_("pin_" + label, os.setxattr, f, "user.mooncake.pin", v)
try_("remove_pin", os.removexattr, f, "user.mooncake.pin")
try_("remove_size", os.removexattr, f, "user.mooncake.size")
try_("trusted", os.setxattr, f, "trusted.x", b"1")
try_("security", os.setxattr, f, "security.x", b"2")
try_("capability", os.setxattr, f, "security.capability", b"\x01\x00\x00\x02" + b"\x00" * 16)
try_("system_acl", os.setxattr, f, "system.posix_acl_access", b"\x02\x00\x00\x00")
try_("user_tag", os.setxattr, f, "user.\x01x", b"1")
print("trusted_value=" + os.getxattr(f, "trusted.x").decode())
print("listed=" + ",".join(sorted(n for n in os.listxattr(f) if not n.startswith("user."))))
import subprocess
for ns in ("user", "trusted", "security"):
    try_("empty_" + ns, os.setxattr, f, ns + ".", b"1")
    try_("get_empty_" + ns, os.getxattr, f, ns + ".")
# trusted.* is listed only to a caller with CAP_SYS_ADMIN, root or not.
out = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", sys.executable, "-c",
                      "import os, sys; print(','.join(sorted(os.listxattr(sys.argv[1]))))", f],
                     capture_output=True, text=True)
print("listed_without_admin=" + ",".join(n for n in out.stdout.strip().split(",") if not n.startswith("user.")))
try_("remove_trusted", os.removexattr, f, "trusted.x")
try_("remove_trusted_again", os.removexattr, f, "trusted.x")
try_("user_64KiB", os.setxattr, f, "user.big", b"v" * 65536)
try_("user_64KiB_plus_1", os.setxattr, f, "user.bigger", b"v" * 65537)
try_("get_missing", os.getxattr, f, "user.nothing")
# Placement this one node can never meet is refused, not left to fail
# every write under it (some only at the close).
try_("replicas_2", os.setxattr, f, "user.mooncake.replicas", b"2")
try_("replicas_1", os.setxattr, f, "user.mooncake.replicas", b"1")
try_("replicas_0", os.setxattr, f, "user.mooncake.replicas", b"0")
try_("replicas_padded", os.setxattr, f, "user.mooncake.replicas", b" 1")
try_("replicas_plus", os.setxattr, f, "user.mooncake.replicas", b"+1")
try_("placement_other", os.setxattr, dir_, "user.mooncake.placement", b"node:elsewhere")
try_("placement_spread", os.setxattr, dir_, "user.mooncake.placement", b"spread")
print("placement_other_set=%d" % ("user.mooncake.placement" in os.listxattr(f)))
try_("create_existing", os.setxattr, f, "user.big", b"1", os.XATTR_CREATE)
try_("replace_missing", os.setxattr, f, "user.none", b"1", os.XATTR_REPLACE)
print("size=" + os.getxattr(f, "user.mooncake.size").decode())
print("pin=" + os.getxattr(f, "user.mooncake.pin").decode())
print("stat_size=%d" % os.stat(f).st_size)
`, f, dir)
	checkResults(t, out, map[string]string{
		"set_size": "EPERM", "set_version": "EPERM", "set_location": "EPERM", "set_status": "EPERM", "set_bogus": "EPERM",
		"pin_banana": "EINVAL", "pin_empty": "EINVAL", "pin_two": "EINVAL",
		"remove_pin": "EPERM", "remove_size": "EPERM",
		"trusted": "OK", "security": "OK", "capability": "EOPNOTSUPP", "system_acl": "EOPNOTSUPP", "user_tag": "EOPNOTSUPP",
		"trusted_value": "1", "listed": "security.x,trusted.x", "listed_without_admin": "security.x",
		"empty_user": "EINVAL", "empty_trusted": "EINVAL", "empty_security": "EINVAL",
		"get_empty_user": "EINVAL", "get_empty_trusted": "EINVAL", "get_empty_security": "EINVAL", "remove_trusted": "OK", "remove_trusted_again": "ENODATA",
		"user_64KiB": "OK", "user_64KiB_plus_1": "E2BIG",
		"get_missing": "ENODATA", "create_existing": "EEXIST", "replace_missing": "ENODATA",
		"size": "1234", "pin": "0", "stat_size": "1234",
		"replicas_2": "EINVAL", "replicas_1": "OK", "replicas_0": "EINVAL", "replicas_padded": "EINVAL", "replicas_plus": "EINVAL", "placement_other": "EINVAL", "placement_spread": "OK",
		"placement_other_set": "0",
	})
	// The same through setfattr, as a user would see it.
	if out, err := runErr("setfattr", "-n", "user.mooncake.pin", "-v", "banana", f); err == nil || !strings.Contains(out, "Invalid argument") {
		t.Errorf("setfattr pin=banana: %v, want EINVAL\n%s", err, out)
	}
	if out, err := runErr("setfattr", "-n", "user.mooncake.size", "-v", "1", f); err == nil || !strings.Contains(out, "Operation not permitted") {
		t.Errorf("setfattr user.mooncake.size: %v, want EPERM\n%s", err, out)
	}
	run(t, "cmp", "-n", "1234", "/dev/zero", f)
}

// testBadNamespace: refused directory and name operations (and mknod of
// a regular file, the one kind of node the store keeps).
func testBadNamespace(t *testing.T, d *daemon, dir string) {
	out := py(t, pyErrnoPrelude+`
import stat
d = sys.argv[1]
os.mkdir(d + "/dir")
with open(d + "/dir/f", "wb") as f:
    f.write(b"kept")
with open(d + "/file", "wb") as f:
    f.write(b"file")
try_("rmdir_nonempty", os.rmdir, d + "/dir")
try_("rmdir_file", os.rmdir, d + "/file")
try_("unlink_dir", os.unlink, d + "/dir")
try_("mkdir_existing", os.mkdir, d + "/dir")
try_("create_excl_existing", os.open, d + "/file", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
try_("create_in_missing_dir", os.open, d + "/missing/f", os.O_CREAT | os.O_WRONLY, 0o644)
try_("mkdir_under_file", os.mkdir, d + "/file/x")
try_("open_dir_for_write", os.open, d + "/dir", os.O_WRONLY)
try_("rename_dir_into_itself", os.rename, d + "/dir", d + "/dir/sub")
try_("rename_file_over_dir", os.rename, d + "/file", d + "/dir")
try_("rename_dir_over_file", os.rename, d + "/dir", d + "/file")
try_("rename_missing", os.rename, d + "/missing", d + "/x")
try_("symlink", os.symlink, "file", d + "/link")
try_("hardlink", os.link, d + "/file", d + "/hard")
try_("mkfifo", os.mkfifo, d + "/fifo")
try_("mknod_chr", os.mknod, d + "/chr", 0o644 | stat.S_IFCHR, os.makedev(1, 3))
try_("mknod_reg", os.mknod, d + "/reg", 0o640 | stat.S_IFREG)
try_("mknod_reg_existing", os.mknod, d + "/file", 0o644 | stat.S_IFREG)
st = os.stat(d + "/reg")
print(f"reg={stat.filemode(st.st_mode)} {st.st_size}")
with open(d + "/dir/f", "rb") as f:
    print("kept=" + f.read().decode())
with open(d + "/file", "rb") as f:
    print("file=" + f.read().decode())
print("listing=" + ",".join(sorted(os.listdir(d))))
`, dir)
	checkResults(t, out, map[string]string{
		"rmdir_nonempty": "ENOTEMPTY", "rmdir_file": "ENOTDIR", "unlink_dir": "EISDIR",
		"mkdir_existing": "EEXIST", "create_excl_existing": "EEXIST", "create_in_missing_dir": "ENOENT",
		"mkdir_under_file": "ENOTDIR", "open_dir_for_write": "EISDIR", "rename_dir_into_itself": "EINVAL",
		"rename_file_over_dir": "EISDIR", "rename_dir_over_file": "ENOTDIR", "rename_missing": "ENOENT",
		"symlink": "EOPNOTSUPP|EPERM", "hardlink": "EOPNOTSUPP|EPERM", "mkfifo": "EOPNOTSUPP|EPERM",
		"mknod_chr": "EOPNOTSUPP|EPERM", "mknod_reg": "OK", "mknod_reg_existing": "EEXIST", "reg": "-rw-r----- 0",
		"kept": "kept", "file": "file", "listing": "dir,file,reg",
	})
	if out, err := runErr("rmdir", filepath.Join(dir, "dir")); err == nil || !strings.Contains(out, "Directory not empty") {
		t.Errorf("rmdir of a non-empty directory: %v, want ENOTEMPTY\n%s", err, out)
	}
}

// TestBadInputEvictsNothing: a write or truncation that can never fit
// (1 TiB into 64 MiB) fails without evicting anything.
func TestBadInputEvictsNothing(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB")
	local := t.TempDir()
	var keep []string
	for i := range 2 {
		k := filepath.Join(local, "keep"+strconv.Itoa(i))
		writeRandom(t, k, 8*miB, uint64(500+i))
		run(t, "cp", k, d.path(filepath.Base(k)))
		keep = append(keep, k)
	}
	out := py(t, pyErrnoPrelude+`
d = sys.argv[1]
fd = os.open(d + "/huge", os.O_CREAT | os.O_RDWR, 0o644)
try_("pwrite_1TiB", os.pwrite, fd, b"x", 1 << 40)
try_("ftruncate_1TiB", os.ftruncate, fd, 1 << 40)
try_("fallocate_1TiB", os.posix_fallocate, fd, 0, 1 << 40)
# The refused writes failed the file's draft: close reports it.
try_("close", os.close, fd)
try_("truncate_keep0_1TiB", os.truncate, d + "/keep0", 1 << 40)
`, d.dir)
	checkResults(t, out, map[string]string{
		"pwrite_1TiB": "ENOSPC|EFBIG", "ftruncate_1TiB": "ENOSPC|EFBIG",
		"fallocate_1TiB": "ENOSPC|EFBIG", "close": "ENOSPC|EFBIG", "truncate_keep0_1TiB": "ENOSPC|EFBIG",
	})
	st := d.checkAlive(t)
	if st.Evict.Evictions != 0 {
		t.Errorf("requests that could never fit evicted %d objects (%d B)", st.Evict.Evictions, st.Evict.EvictedBytes)
	}
	for _, k := range keep {
		if out, err := runErr("cmp", k, d.path(filepath.Base(k))); err != nil {
			t.Errorf("%s after the refused requests: %v\n%s", filepath.Base(k), err, out)
		}
	}
}
