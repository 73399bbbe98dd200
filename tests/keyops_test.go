package tests

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// The one-key and vector-batch commands (ABI 1.3) from child processes.

// keysPrelude imports the client from argv[1] and opens the mount argv[2].
const keysPrelude = `
import ctypes, errno, mmap, os, random, sys
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
from mooncake_fs import abi
c = mc.Client(sys.argv[2])
mnt = sys.argv[2]
def addr(b):
    return ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))
def res(label, f, *a, **kw):
    try:
        r = f(*a, **kw)
        print(f"{label}={r}")
        return r
    except OSError as e:
        print(f"{label}={errno.errorcode.get(e.errno, e.errno)}")
`

// TestVectorBatchModel: keys gathered from random splits of several
// buffers (caller memory and a registration by address) and scattered
// into other random splits come back bit-exact against a model, from
// random offsets; puts and gets of one key by name agree with them.
func TestVectorBatchModel(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB")
	out := py(t, keysPrelude+`
rng = random.Random(5)
os.makedirs(mnt + "/vm", exist_ok=True)
d = mc.Directory(mnt + "/vm")
pool = mmap.mmap(-1, 4 << 20)
pool.write(rng.randbytes(4 << 20))
pid = d.register_vm(addr(pool), len(pool))
model = {}
def split(n):
    parts = []
    while n > 0:
        k = min(n, rng.randint(1, 70000))
        parts.append(k)
        n -= k
    return parts
for rnd in range(6):
    entries = []
    for k in range(40):
        key = f"r{rnd}/k{k}" if k % 3 else f"k{k}"
        os.makedirs(mnt + "/vm/" + os.path.dirname(key), exist_ok=True) if "/" in key else None
        total = rng.randint(0, 300000)
        segs, want, keep = [], b"", []
        for n in split(total):
            if rng.random() < 0.5:
                b = bytearray(rng.randbytes(n))
                keep.append(b)
                segs.append((abi.SEG_VM, addr(b), n))
                want += bytes(b)
            else:
                off = rng.randint(0, len(pool) - n)
                segs.append((pid, off, n))
                want += pool[off:off + n]
        if not segs:
            segs = [(abi.SEG_VM, 0, 0)]
        entries.append((key, segs, None, 0, 0, keep))
        model[key] = want
    res_ = d.batchv(True, [e[:5] for e in entries])
    bad = [(e[0], r) for e, (r, _) in zip(entries, res_) if r != len(model[e[0]])]
    assert not bad, bad
checked = 0
for key, want in model.items():
    off = rng.randint(0, len(want)) if want else 0
    bufs = [bytearray(n) for n in split(len(want) - off + rng.randint(0, 5000))] or [bytearray(1)]
    r = d.batch_getv({key: bufs}, offset=off)[key]
    got = b"".join(bytes(b) for b in bufs)[:r]
    assert r == len(want) - off and got == want[off:], (key, off, r, len(want))
    assert c.get("vm/" + key) == want, key
    checked += 1
# One key by name, then gathered: the same bytes either way.
c.put("vm/one", b"abc" * 1000)
o1, o2 = bytearray(1000), bytearray(3000)
assert d.batch_getv({"one": [o1, o2]})["one"] == 3000 and bytes(o1 + o2)[:3000] == b"abc" * 1000
print(f"checked={checked}")
`, publicPythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"checked": "170"}) // 6 rounds of 26 keys, and 14 replaced each round
	d.checkAlive(t)
}

// TestVectorBatchFailuresStayAlone: in one vector batch, new, replaced and
// missing keys, a segment past its registration, an unknown registration,
// a GPU index without a table and a key nobody may write each get their
// own result; every failed key leaves nothing, every other one commits
// whole.
func TestVectorBatchFailuresStayAlone(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "64MiB")
	pub := d.publicDir(t)
	run(t, "mkdir", "-m", "0755", d.path("pub", "rootdir"))
	run(t, "sh", "-c", `printf old > "$1/existing" && chmod 666 "$1/existing" && printf secret > "$1/secret" && chmod 600 "$1/secret"`, "sh", pub)
	script := keysPrelude + `
dd = mc.Directory(mnt + "/pub")
small = mmap.mmap(-1, 4096)
rid = dd.register_vm(addr(small), 4096)
data = bytearray(b"N" * 5000)
a = addr(data)
items = [
    ("new", [(abi.SEG_VM, a, 5000)]),
    ("existing", [(abi.SEG_VM, a, 10), (rid, 0, 6)]),
    ("pastreg", [(rid, 4000, 200)]),
    ("noreg", [(987, 0, 1)]),
    ("nogpu", [(abi.SEG_GPU | 3, 0, 1)]),
    ("rootdir/x", [(abi.SEG_VM, a, 3)]),
    ("secret", [(abi.SEG_VM, a, 3)]),
    ("badaddr", [(abi.SEG_VM, 8, 100)]),
]
r = dd.batchv(True, [(k, s, "m" if k == "new" else None, 0, 0) for k, s in items])
for (k, _), (v, _) in zip(items, r):
    print(f"put_{k}={errno.errorcode.get(-v, v) if v < 0 else v}")
got = {k: bytearray(6000) for k in ["new", "existing", "missing", "secret"]}
r = dd.batch_getv({k: [b] for k, b in got.items()}, check=False)
for k, v in r.items():
    print(f"get_{k}={errno.errorcode.get(-v, v) if v < 0 else v}")
print("new_ok=" + str(bytes(got["new"][:5000]) == b"N" * 5000))
print("existing_ok=" + str(bytes(got["existing"][:16]) == b"N" * 10 + b"\0" * 6))
res("meta_new", lambda: c.lookup("pub/new").meta)
`
	out, err := asNobody(`exec "$1" -c "$2" "$3" "$4"`, python, script, publicPythonDir(t), d.dir)
	if err != nil {
		t.Fatalf("nobody's script: %v\n%s", err, out)
	}
	checkResults(t, out, map[string]string{
		"put_new": "5000", "put_existing": "16", "put_pastreg": "EFAULT", "put_noreg": "EINVAL", "put_nogpu": "EINVAL",
		"put_rootdir/x": "EACCES", "put_secret": "EACCES", "put_badaddr": "EFAULT",
		"get_new": "5000", "get_existing": "16", "get_missing": "ENOENT", "get_secret": "EACCES",
		"new_ok": "True", "existing_ok": "True", "meta_new": "b'm'",
	})
	for _, gone := range []string{"pastreg", "noreg", "nogpu", "badaddr", "rootdir/x"} {
		if _, err := os.Stat(d.path("pub", gone)); err == nil {
			t.Errorf("failed key %s exists", gone)
		}
	}
	if b := run(t, "cat", d.path("pub", "secret")); b != "secret" {
		t.Errorf("refused put changed secret: %q", b)
	}
	d.checkAlive(t)
}

// TestVectorBatchNoSpace: a batch larger than the store, without
// eviction: the keys that found room commit whole, the others fail with
// ENOSPC alone and leave nothing, and no reservation is left behind.
func TestVectorBatchNoSpace(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "16MiB", "--evict", "off")
	out := py(t, keysPrelude+`
d = mc.Directory(mnt)
bufs = {f"b{i}": [bytearray(bytes([i]) * (1 << 20)), bytearray(bytes([i + 100]) * 12345)] for i in range(24)}
r = d.batch_putv(bufs, check=False)
ok = [k for k, v in r.items() if v > 0]
full = [k for k, v in r.items() if v == -errno.ENOSPC]
assert len(ok) + len(full) == len(r), r
for k in ok:
    want = bytes(bufs[k][0]) + bytes(bufs[k][1])
    assert c.get(k) == want, k
for k in full:
    assert not os.path.exists(mnt + "/" + k), k
print(f"some_ok={len(ok) > 0}")
print(f"some_full={len(full) > 0}")
`, publicPythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"some_ok": "True", "some_full": "True"})
	d.checkAlive(t)
}

// TestAddressRegistration: memory registered by address serves its
// process; unmapped, it gives EFAULT and the daemon lives; a forked child
// holding the same file may not use it (EPERM).
func TestAddressRegistration(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB")
	out := py(t, keysPrelude+`
d = mc.Directory(mnt)
m = mmap.mmap(-1, 1 << 20)
m.write(b"z" * (1 << 20))
rid = d.register_vm(addr(m), 1 << 20)
print("put=%d" % d.batchv(True, [("k", [(rid, 100, 5000)], None, 0, 0)])[0][0])
print("same=" + str(c.get("k") == b"z" * 5000))
r = os.fork()
if r == 0:
    v = d.batchv(False, [("k", [(rid, 0, 10)], None, 0, 0)])[0][0]
    os._exit(-v if v < 0 else 0)
_, st = os.waitpid(r, 0)
print("child=" + errno.errorcode.get(os.waitstatus_to_exitcode(st), "ok"))
`, publicPythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"put": "5000", "same": "True", "child": "EPERM"})
	out = py(t, keysPrelude+`
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
n = 1 << 20
p = libc.mmap(None, n, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANON
ctypes.memset(p, 0x5a, n)
d = mc.Directory(mnt)
rid = d.register_vm(p, n)
print("put=%d" % d.batchv(True, [("u", [(rid, 0, 4096)], None, 0, 0)])[0][0])
assert libc.munmap(p, n) == 0
v = d.batchv(False, [("u", [(rid, 0, 4096)], None, 0, 0)])[0][0]
print("get_unmapped=" + errno.errorcode.get(-v, str(v)))
v = d.batchv(True, [("u", [(rid, 0, 4096)], None, 0, 0)])[0][0]
print("put_unmapped=" + errno.errorcode.get(-v, str(v)))
print("kept=" + str(c.get("u") == bytes([0x5a]) * 4096))
a = abi.Key(source=abi.SRC_BUF, id=rid, len=10)
res("key_unmapped", lambda: d.key_call(False, "u", a).result)
`, publicPythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"put": "4096", "get_unmapped": "EFAULT", "put_unmapped": "EFAULT",
		"kept": "True", "key_unmapped": "EFAULT"})
	d.checkAlive(t)
}

// TestKilledBatchClientLeaksNothing: a client killed with SIGKILL in the
// middle of vector batches, with a memfd and an address range registered
// (one of them with calls submitted and not waited for), leaves no
// registration, no client state and, once its keys are removed, no byte
// of the store in use.
func TestKilledBatchClientLeaksNothing(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "128MiB")
	run(t, "mkdir", d.path("kill"))
	b := background(t, python, "-c", keysPrelude+`
d = mc.Directory(mnt + "/kill")
fd = os.memfd_create("kv")
os.ftruncate(fd, 8 << 20)
mid = d.register(fd, 8 << 20)
m = mmap.mmap(-1, 8 << 20)
vid = d.register_vm(addr(m), 8 << 20)
i = 0
while True:
    items = [(f"k{(i + j) % 500}", [(mid, j * 65536, 65536), (vid, j * 65536, 1000)], None, 0, 0) for j in range(64)]
    d.batchv(True, items)
    d.batchv(False, items)
    if i == 0:
        print("ready", flush=True)
    i += 1
`, publicPythonDir(t), d.dir)
	// And one whose batches of 320 keys go as calls in flight together
	// (the Mooncake API's pool threads), killed with some in the daemon.
	s := background(t, python, "-c", keysPrelude+`
import ctypes
os.environ["MOONCAKE_FS_MOUNT"] = mnt
from mooncake_fs.mooncake_store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("localhost", "x", 0, 0, "tcp", "", "", tenant_id="killstore") == 0
pool = (ctypes.c_char * (8 << 20))()
assert s.register_buffer(ctypes.addressof(pool), 8 << 20) == 0
keys = [f"s{i}" for i in range(320)]
ptrs = [ctypes.addressof(pool) + i * 16384 for i in range(320)]
i = 0
while True:
    assert s.batch_upsert_from(keys, ptrs, [16384] * 320) == [0] * 320
    assert s.batch_get_into(keys, ptrs, [16384] * 320) == [16384] * 320
    if i == 0:
        print("ready", flush=True)
    i += 1
`, publicPythonDir(t), d.dir)
	// And one that keeps calls submitted (ABI 1.7) in the daemon, killed
	// with several not waited for.
	run(t, "mkdir", d.path("killasync"))
	a := background(t, python, "-c", keysPrelude+`
import array, collections
from mooncake_fs import _abi
d = mc.Directory(mnt + "/killasync")
fd = os.memfd_create("kv")
os.ftruncate(fd, 4 << 20)
mid = d.register(fd, 4 << 20)
q = collections.deque()
i = 0
while True:
    names = [f"a{(i * 8 + j) % 300}".encode() for j in range(8)]
    words = array.array("Q")
    for j in range(8):
        words.extend((mid, j * 65536, 65536))
    q.append(d.submit_columns(i % 3 != 2, b"".join(names), [len(n) for n in names], words, 1, 0))
    if len(q) == _abi.MAX_ASYNC_CALLS:
        d.wait_columns(q.popleft())
    if i == 40:
        print("ready", flush=True)
    i += 1
`, publicPythonDir(t), d.dir)
	b.waitOutput(t, "ready")
	s.waitOutput(t, "ready")
	a.waitOutput(t, "ready")
	time.Sleep(200 * time.Millisecond)
	for _, c := range []*bg{b, s, a} {
		if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		c.wait()
	}
	type clients struct {
		Registrations regStatus `json:"registrations"`
		Clients       struct {
			Procs int `json:"procs"`
			IPC   int `json:"ipc_handles"`
		} `json:"clients"`
		Used     uint64 `json:"used"`
		OpenDirs int64  `json:"open_dirs"`
	}
	get := func() (clients, string) {
		out := run(t, daemonBin(), "status", "--json", d.dir)
		var c clients
		if err := json.Unmarshal([]byte(out), &c); err != nil {
			t.Fatalf("status: %v\n%s", err, out)
		}
		return c, fmt.Sprintf("%+v", c)
	}
	waitFor(t, "the killed client's registrations, directories and state gone", func() (bool, string) {
		c, s := get()
		return c.Registrations.Live == 0 && c.Clients.Procs == 0 && c.Clients.IPC == 0 && c.OpenDirs == 0, s
	})
	run(t, "rm", "-r", d.path("kill"), d.path("killstore"), d.path("killasync"))
	waitFor(t, "no byte in use", func() (bool, string) {
		c, s := get()
		return c.Used == 0, s
	})
	d.checkAlive(t)
}

// TestSubmittedCalls: the Go client's submitted vector batches through
// the mount: several in the daemon at once, waited for in any order,
// each once, with the bytes of the same calls made one by one.
func TestSubmittedCalls(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB")
	f, err := ioctl.OpenDir(d.dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// Submitted calls take memory the daemon holds: a memfd registration.
	mfd, err := unix.MemfdCreate("submitted", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mfd)
	if err := unix.Ftruncate(mfd, 1<<20); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(mfd, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	reg, err := f.RegisterFd(mfd, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.StartBatchPutV(nil, []ioctl.VItem{{Key: "vm", Data: [][]byte{mem[:8]}}}); !errors.Is(err, ioctl.ErrBadItem) {
		t.Fatalf("process memory submitted: %v", err)
	}
	vals := make([][]byte, 24)
	var pend []*ioctl.PendingV
	at := uint64(0)
	for c := range 3 {
		var items []ioctl.VItem
		for j := range 8 {
			i := c*8 + j
			vals[i] = bytes.Repeat([]byte{byte(i + 1)}, 1000+i*100)
			copy(mem[at:], vals[i])
			n := uint64(len(vals[i]))
			items = append(items, ioctl.VItem{Key: fmt.Sprintf("s%d", i),
				Segs: []ioctl.Seg{{ID: reg.ID, Off: at, Len: 500}, {ID: reg.ID, Off: at + 500, Len: n - 500}}})
			at += n
		}
		p, err := f.StartBatchPutV(nil, items)
		if err != nil {
			t.Fatal(err)
		}
		pend = append(pend, p)
	}
	for c := 2; c >= 0; c-- {
		res, err := pend[c].Wait()
		if err != nil {
			t.Fatal(err)
		}
		for j, r := range res {
			if i := c*8 + j; r.Err != nil || r.N != uint64(len(vals[i])) {
				t.Fatalf("s%d: %+v", i, r)
			}
		}
		if _, err := pend[c].Wait(); err == nil {
			t.Fatal("a call waited for twice")
		}
	}
	for i, v := range vals {
		if got, err := os.ReadFile(d.path(fmt.Sprintf("s%d", i))); err != nil || !bytes.Equal(got, v) {
			t.Fatalf("s%d: %v", i, err)
		}
	}
	dst := mem[512<<10 : 512<<10+2000]
	p, err := f.StartBatchGetV(nil, []ioctl.VItem{{Key: "s3", Segs: []ioctl.Seg{{ID: reg.ID, Off: 512 << 10, Len: 2000}}},
		{Key: "none", Segs: []ioctl.Seg{{ID: reg.ID, Off: 600 << 10, Len: 500}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.WaitCalls(); err != nil { // done, not consumed
		t.Fatal(err)
	}
	res, err := p.Wait()
	if err != nil || res[0].N != uint64(len(vals[3])) || !bytes.Equal(dst[:res[0].N], vals[3]) || !errors.Is(res[1].Err, syscall.ENOENT) {
		t.Fatalf("get: %+v, %v", res, err)
	}
	big := make([]ioctl.VItem, ioctl.MaxBatch+1)
	for i := range big {
		big[i] = ioctl.VItem{Key: fmt.Sprintf("b%d", i), Segs: []ioctl.Seg{{ID: reg.ID, Off: 0, Len: 1}}}
	}
	if _, err := f.StartBatchPutV(nil, big); err == nil {
		t.Fatal("a call of more keys than one call carries was submitted")
	}
}

// TestMetaFollowsTheBytes: the meta describes the bytes it was put with.
// A rewrite through a file (O_TRUNC, or a truncation) drops it, unless a
// new one is set during the rewrite (as cp -a does); in-place edits and
// other xattrs keep theirs.
func TestMetaFollowsTheBytes(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB")
	out := py(t, keysPrelude+`
d = mc.Directory(mnt)
M = "user.mooncake.meta"
def meta(k):
    try:
        return os.getxattr(mnt + "/" + k, M).decode()
    except OSError as e:
        return errno.errorcode[e.errno]
d.put_key("a", b"0123456789", meta="m1")
os.setxattr(mnt + "/a", "user.other", b"keep")
print("put=" + meta("a"))
with open(mnt + "/a", "r+b") as f:    # in place, no truncation
    f.write(b"X")
print("inplace=" + meta("a"))
with open(mnt + "/a", "wb") as f:     # O_TRUNC
    f.write(b"new bytes")
print("trunc=" + meta("a"))
print("other=" + os.getxattr(mnt + "/a", "user.other").decode())
d.put_key("a", b"0123456789", meta="m2")
with open(mnt + "/a", "wb") as f:     # a copy that brings its meta
    f.write(b"copied")
    os.setxattr(f.fileno(), M, b"m3")
print("copied=" + meta("a"))
d.put_key("a", b"0123456789", meta="m4")
os.truncate(mnt + "/a", 4)
print("truncated=" + meta("a"))
d.put_key("a", b"0123456789", meta="m5")
with open(mnt + "/a", "r+b") as f:
    f.truncate(2)
    f.write(b"zz")
print("ftruncated=" + meta("a"))
`, publicPythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"put": "m1", "inplace": "m1", "trunc": "ENODATA", "other": "keep",
		"copied": "m3", "truncated": "ENODATA", "ftruncated": "ENODATA"})
	d.checkAlive(t)
}

// TestTwoWritersOfOneNameByKey: two processes put the same keys at once,
// by vector batch and by PUT_KEY, values of several segments each; every
// key ends up whole from one writer, with that writer's meta, never a mix.
func TestTwoWritersOfOneNameByKey(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB")
	writer := keysPrelude + `
import hashlib
w = sys.argv[3]
d = mc.Directory(mnt)
rng = random.Random(w)
for rnd in range(60):
    items = {}
    for k in range(16):
        n = rng.randint(1, 40000)
        body = rng.randbytes(n)
        tag = (w + ":" + hashlib.sha256(body).hexdigest()).encode()
        items[f"k{k}"] = (tag, [tag + b"|", body[: n // 2], body[n // 2:]])
    if rnd % 2:
        d.batch_putv({k: v[1] for k, v in items.items()}, meta={k: v[0][:2] for k, v in items.items()})
    else:
        for k, (tag, parts) in items.items():
            d.put_key(k, b"".join(parts), meta=tag[:2])
print("done=1")
`
	a := background(t, python, "-c", writer, publicPythonDir(t), d.dir, "A")
	b := background(t, python, "-c", writer, publicPythonDir(t), d.dir, "B")
	a.mustWait(t)
	b.mustWait(t)
	out := py(t, keysPrelude+`
import hashlib
bad = 0
for k in range(16):
    v = c.get(f"k{k}")
    tag, _, body = v.partition(b"|")
    w, _, h = tag.decode().partition(":")
    meta = c.lookup(f"k{k}").meta
    if hashlib.sha256(body).hexdigest() != h or meta != tag[:2]:
        bad += 1
print(f"bad={bad}")
`, publicPythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"bad": "0"})
	d.checkAlive(t)
}

// TestPutByNameWhileHeld: a file held open read-write, never written
// through, while puts by name (one key, a batch, the client's put)
// replace it: every reader sees each put's value, an append through the
// file system adds to it, and the holder's later write lands on the last
// value, as the same steps give on a local file system (the put by name
// there is a rewrite). A held descriptor kept its draft on the version
// it opened: readers saw the old value, and the append published the
// old value plus the append over the put.
func TestPutByNameWhileHeld(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "256MiB")
	script := `
import os, sys
sys.path.insert(0, sys.argv[1])
import mooncake_fs as mc
mnt, local = sys.argv[2], len(sys.argv) > 3
c = None if local else mc.Client(mnt)
f = mnt + "/held"
def put(v, how):
    if local:
        with open(f, "wb") as w:
            w.write(v)
    elif how == "key":
        mc.Directory(mnt).put_key("held", v)
    elif how == "batch":
        c.batch_put({"held": v, "other": b"x"})
    else:
        c.put("held", v)
def read():
    with open(f, "rb") as r:
        return r.read().decode()
with open(f, "wb") as w:
    w.write(b"old\n")
fd = os.open(f, os.O_RDWR)
seen = []
put(b"NEWER\n", "key"); seen.append(read())
with open(f, "ab") as a:
    a.write(b"app\n")
seen.append(read())
put(b"B1\n", "batch"); seen.append(read())
put(b"P\n", "client"); seen.append(read())
os.write(fd, b"X"); seen.append(read())
os.close(fd); seen.append(read())
print("seen=" + "|".join(s.replace("\n", "/") for s in seen))
`
	want := py(t, script, publicPythonDir(t), t.TempDir(), "local")
	if !strings.Contains(want, "seen=NEWER/|NEWER/app/|B1/|P/|") {
		t.Fatalf("the local file system gave %q", want)
	}
	got := py(t, script, publicPythonDir(t), d.dir)
	if got != want {
		t.Fatalf("readers saw %q; the local file system gives %q", got, want)
	}
	d.checkAlive(t)
}

// TestPutFollowsRename: a put whose file, or whose directory handle's
// directory, is renamed while its bytes are copied lands under the new
// name, as a write(2) or an openat(2) with the same descriptors would:
// a put through an open file, a put by name through a directory's handle
// (one key, and a batch of keys), each raced in rounds against a rename
// at a growing delay, some rounds before the copy ends. A put through a
// file renamed meanwhile failed with ESTALE, one by name with ENOENT,
// and stored nothing. Then a directory's handle whose directory was
// removed answers ENOENT, as openat does with it, not ESTALE. Puts of
// keys that exist, as fast as they go for 3 s while another process
// renames their directory back and forth, land but for a few (a batch's
// keys looked up under the old name were committed with that name's
// objects: EINVAL, every key).
func TestPutFollowsRename(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "1GiB")
	out := py(t, keysPrelude+`
import threading, time
big = bytearray(os.urandom(1 << 20)) * 128
bad = 0
def race(label, do, rename, delay):
    global bad
    t = threading.Thread(target=lambda: (time.sleep(delay), rename()))
    t.start()
    try:
        do()
    except OSError as e:
        bad += 1
        print(f"{label} at {delay}: {errno.errorcode.get(e.errno, e.errno)}")
    t.join()
for r in range(6):
    delay = 0.004 * r
    os.makedirs(f"{mnt}/f{r}")
    f = mc.File(f"{mnt}/f{r}/x", "w")
    race("file", lambda: f.put(big), lambda: os.rename(f"{mnt}/f{r}/x", f"{mnt}/f{r}/y"), delay)
    f.close()
    with open(f"{mnt}/f{r}/y", "rb") as g:
        bad += g.read() != big
    os.makedirs(f"{mnt}/k{r}")
    dk = mc.Directory(f"{mnt}/k{r}")
    race("key", lambda: dk.put_key("x", big), lambda: os.rename(f"{mnt}/k{r}", f"{mnt}/k{r}moved"), delay)
    dk.close()
    with open(f"{mnt}/k{r}moved/x", "rb") as g:
        bad += g.read() != big
    os.makedirs(f"{mnt}/b{r}")
    db = mc.Directory(f"{mnt}/b{r}")
    part = memoryview(big)[: 8 << 20]
    race("batch", lambda: db.batch_put({f"k{i}": part for i in range(16)}), lambda: os.rename(f"{mnt}/b{r}", f"{mnt}/b{r}moved"), delay)
    db.close()
    for i in range(16):
        with open(f"{mnt}/b{r}moved/k{i}", "rb") as g:
            bad += g.read() != part
    for p in (f"f{r}/y", f"k{r}moved/x"):
        os.unlink(f"{mnt}/{p}")
    for i in range(16):
        os.unlink(f"{mnt}/b{r}moved/k{i}")
print(f"bad={bad}")
# Existing keys, while another process renames their directory back and
# forth as fast as it can: every put lands (a few may fail where the
# directory moved again at each of their looks: ENOENT, or EAGAIN).
import multiprocessing, collections
os.makedirs(mnt + "/ra")
for j in range(8):
    with open(f"{mnt}/ra/k{j}", "wb") as w:
        w.write(b"old")
def renamer(stop):
    while not stop.is_set():
        os.rename(mnt + "/ra", mnt + "/rb")
        os.rename(mnt + "/rb", mnt + "/ra")
stop = multiprocessing.Event()
p = multiprocessing.Process(target=renamer, args=(stop,))
p.start()
dr = mc.Directory(mnt + "/ra")
seen, calls, end = collections.Counter(), 0, time.time() + 3
while time.time() < end:
    calls += 2
    try:
        dr.put_key("k0", b"one")
        seen["ok"] += 1
    except OSError as e:
        seen[errno.errorcode[e.errno]] += 1
    r = dr.batch_put({f"k{j}": b"many" for j in range(8)}, check=False, makedirs=False)
    for x in set(r.values()):
        seen[errno.errorcode[-x] if x < 0 else "ok"] += 1
stop.set()
p.join()
failed = sum(v for k, v in seen.items() if k != "ok")
print("moving_others=%d" % sum(v for k, v in seen.items() if k not in ("ok", "ENOENT", "EAGAIN")))
print("moving_failed_under_1pct=%d" % (failed * 100 < calls))
print("moving:", dict(seen))
os.makedirs(mnt + "/gone")
g = mc.Directory(mnt + "/gone")
os.rmdir(mnt + "/gone")
res("gone_put", g.put_key, "x", b"1")
res("gone_lookup", g.lookup, "x")
`, publicPythonDir(t), d.dir)
	checkResults(t, out, map[string]string{"bad": "0", "gone_put": "ENOENT", "gone_lookup": "ENOENT",
		"moving_others": "0", "moving_failed_under_1pct": "1"})
	d.checkAlive(t)
}

// TestInlineKeyCalls: one-key calls whose values ride in the call (ABI
// 1.9, values up to 4 KiB), from an unprivileged user's process: values
// of 0, 1 and 4096 bytes come back bit-exact, inline and by address (a
// buffer of 4097 bytes goes by address); a put into a directory or over
// a file the user may not write fails with EACCES and changes nothing;
// a client killed amid inline puts and gets leaves whole values of its
// own only, and no byte in use once the keys are gone.
func TestInlineKeyCalls(t *testing.T) {
	t.Parallel()
	requireTools(t, python, "setpriv")
	d := startDaemon(t, "--size", "64MiB")
	pub := d.publicDir(t)
	run(t, "mkdir", "-m", "0755", d.path("pub", "rootdir"))
	run(t, "sh", "-c", `printf secret > "$1/secret" && chmod 644 "$1/secret"`, "sh", pub)
	script := keysPrelude + `
from mooncake_fs import _abi
dd = mc.Directory(mnt + "/pub")
for n in (0, 1, 4096):
    v = bytes((i * 7 + n) % 251 for i in range(n))
    dd.put_key(f"k{n}", v, meta="m")
    small, big = bytearray(max(n, 1)), bytearray(4097)
    cs, _, _ = dd.get_key_into(f"k{n}", small)
    cb, size, _ = dd.get_key_into(f"k{n}", big)
    print(f"k{n}=" + str(size == n and bytes(small[:cs]) == v and bytes(big[:cb]) == v and c.get(f"pub/k{n}") == v))
res("rootdir", dd.put_key, "rootdir/x", b"abc")
res("secret", dd.put_key, "secret", b"abc")
print("inline_used=" + str(not dd._no_inline))
`
	out, err := asNobody(`exec "$1" -c "$2" "$3" "$4"`, python, script, publicPythonDir(t), d.dir)
	if err != nil {
		t.Fatalf("nobody's script: %v\n%s", err, out)
	}
	checkResults(t, out, map[string]string{"k0": "True", "k1": "True", "k4096": "True", "inline_used": "True",
		"rootdir": "EACCES", "secret": "EACCES"})
	if _, err := os.Stat(d.path("pub", "rootdir", "x")); err == nil {
		t.Error("a refused put made rootdir/x")
	}
	if b := run(t, "cat", d.path("pub", "secret")); b != "secret" {
		t.Errorf("a refused put changed secret: %q", b)
	}

	// Killed amid inline calls: every value is one the client wrote.
	run(t, "mkdir", d.path("kill"))
	b := background(t, python, "-c", keysPrelude+`
d = mc.Directory(mnt + "/kill")
out = bytearray(4096)
i = 0
while True:
    k = f"k{i % 100}"
    d.put_key(k, (k + ":" + str(i) + "|").encode() * (1 + i % 150))
    d.get_key_into(k, out)
    if i == 500:
        print("ready", flush=True)
    i += 1
`, publicPythonDir(t), d.dir)
	b.waitOutput(t, "ready")
	time.Sleep(100 * time.Millisecond)
	if err := b.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	b.wait()
	entries, err := os.ReadDir(d.path("kill"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		v, err := os.ReadFile(d.path("kill", e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		unit, _, _ := strings.Cut(string(v), "|")
		if !strings.HasPrefix(unit, e.Name()+":") || strings.Repeat(unit+"|", len(v)/(len(unit)+1)) != string(v) {
			t.Errorf("%s holds %d B that no put wrote whole: %.60q", e.Name(), len(v), v)
		}
	}
	run(t, "rm", "-r", d.path("kill"), d.path("pub"))
	waitFor(t, "no byte in use", func() (bool, string) {
		out := run(t, daemonBin(), "status", "--json", d.dir)
		var st struct {
			Used uint64 `json:"used"`
		}
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("status: %v\n%s", err, out)
		}
		return st.Used == 0, out
	})
	d.checkAlive(t)
}

// TestReadStatus: ioctl.ReadStatus gives the daemon's status JSON from
// the mount's root, the same figures `status --json` prints; a directory
// of another file system is an error.
func TestReadStatus(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, "--size", "64MiB")
	if err := os.WriteFile(d.dir+"/k", []byte("v"), 0o644); err != nil {
		t.Fatal(err)
	}
	b, err := ioctl.ReadStatus(d.dir)
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Mountpoint string          `json:"mountpoint"`
		Objects    int             `json:"objects"`
		Batches    json.RawMessage `json:"batches"`
	}
	if err := json.Unmarshal(b, &st); err != nil || st.Mountpoint != d.dir || st.Objects != 1 || len(st.Batches) == 0 {
		t.Fatalf("status %+v, %v, from %s", st, err, b)
	}
	if _, err := ioctl.ReadStatus(t.TempDir()); err == nil {
		t.Fatal("a status from a directory of another file system")
	}
}
