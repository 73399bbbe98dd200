package tests

import (
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

var soak = flag.Duration("soak", 0, "run TestConcurrentModel this long instead of its short default")

// modelWorker is one process of TestConcurrentModel. Every value it
// writes carries its name's class, its writer, a sequence number, its
// length and a checksum; every read is checked on the spot (never torn)
// and reported, with every write, for the test to check against what was
// written. Names:
//
//   - s*: stable, pinned, always present: replaced by temp+rename and
//     rewritten in place with O_TRUNC, now and then by a child killed
//     halfway through; reading one must never fail;
//   - a*: pinned logs of self-checking records appended with O_APPEND;
//   - v*: volatile, unpinned and large (more of them than the store
//     holds): written, unlinked, evicted; a read may find nothing or the
//     empty file a create makes, never a partial value.
const modelWorker = `
import errno, hashlib, json, os, random, struct, subprocess, sys, time
KILLED = """
import os, sys, time
data = sys.stdin.buffer.read(int(sys.argv[2]))
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC)
os.write(fd, data)
print("written", flush=True)
time.sleep(60)
"""
d, wid, seed, deadline, maxops = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
rnd = random.Random(seed)
HDR = struct.Struct("<4sIQQ32s")
writes, reads, errors = [], [], []
seq = nospace = 0

def value(name, size):
    global seq
    seq += 1
    body = rnd.randbytes(size)
    return seq, HDR.pack(b"mcv1", wid, seq, size, hashlib.sha256(body).digest()) + body

def check(name, b):
    if len(b) < HDR.size:
        return None, "short: %d B" % len(b)
    magic, w, s, size, digest = HDR.unpack_from(b)
    body = b[HDR.size:]
    if magic != b"mcv1" or len(body) != size or hashlib.sha256(body).digest() != digest:
        return None, "torn: %d B, header says %d" % (len(b), size)
    return (w, s), None

def put(path, data, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC, pin=False):
    fd = os.open(path, flags, 0o644)
    try:
        if pin:
            os.setxattr(fd, "user.mooncake.pin", b"1")
        os.write(fd, data)
    finally:
        os.close(fd)

def read_value(name, must):
    try:
        with open(d + "/" + name, "rb") as f:
            b = f.read()
    except OSError as e:
        if e.errno == errno.ENOENT and not must:
            return
        errors.append("read %s: %s" % (name, errno.errorcode.get(e.errno, e.errno)))
        return
    if not b and not must:
        return  # created, not written yet: O_CREAT makes the name at open
    got, err = check(name, b)
    if err:
        errors.append("read %s: %s" % (name, err))
    else:
        reads.append([name, got[0], got[1]])

def read_log(name):
    try:
        with open(d + "/" + name, "rb") as f:
            b = f.read()
    except OSError as e:
        errors.append("read %s: %s" % (name, errno.errorcode.get(e.errno, e.errno)))
        return
    off = 0
    while off < len(b):
        if len(b) - off < HDR.size:
            errors.append("log %s: %d B left at %d" % (name, len(b) - off, off))
            return
        size = HDR.unpack_from(b, off)[3]
        got, err = check(name, b[off:off + HDR.size + size])
        if err:
            errors.append("log %s at %d: %s" % (name, off, err))
            return
        reads.append([name, got[0], got[1]])
        off += HDR.size + size

ops = 0
while ops < maxops and time.time() < deadline:
    ops += 1
    r = rnd.random()
    try:
        if r < 0.01:
            # A rewriter killed halfway: nothing of it may ever be read.
            name = "s%d" % rnd.randrange(4)
            s, data = value(name, 200000)
            child = subprocess.Popen([sys.executable, "-c", KILLED, d + "/" + name, str(len(data) // 2)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            child.stdin.write(data[:len(data) // 2])
            child.stdin.close()
            child.stdout.readline()
            child.kill()
            child.wait()
        elif r < 0.15:
            name = "s%d" % rnd.randrange(4)
            s, data = value(name, rnd.choice([100, 5000, 70000, 300000]))
            tmp = "%s/.tmp-%d-%d" % (d, wid, s)
            put(tmp, data, pin=True)
            os.rename(tmp, d + "/" + name)
            writes.append([name, wid, s])
        elif r < 0.25:
            name = "s%d" % rnd.randrange(4)
            s, data = value(name, rnd.choice([100, 5000, 70000]))
            writes.append([name, wid, s])
            put(d + "/" + name, data, os.O_WRONLY | os.O_TRUNC)
        elif r < 0.35:
            name = "a%d" % rnd.randrange(2)
            s, data = value(name, rnd.choice([10, 300, 4000]))
            writes.append([name, wid, s])
            put(d + "/" + name, data, os.O_WRONLY | os.O_APPEND)
            if os.stat(d + "/" + name).st_size > (1 << 20):
                os.truncate(d + "/" + name, 0)  # logs are pinned: keep them small
        elif r < 0.50:
            name = "v%d" % rnd.randrange(10)
            s, data = value(name, rnd.choice([100, 2 << 20, 4 << 20, 6 << 20]))
            writes.append([name, wid, s])
            try:
                put(d + "/" + name, data)
            except OSError as e:
                # A full store whose files are all open may refuse a big
                # volatile value; the name then keeps what it had.
                if e.errno != errno.ENOSPC:
                    raise
                nospace += 1
        elif r < 0.55:
            try:
                os.unlink("%s/v%d" % (d, rnd.randrange(10)))
            except FileNotFoundError:
                pass
        elif r < 0.75:
            read_value("s%d" % rnd.randrange(4), True)
        elif r < 0.82:
            read_log("a%d" % rnd.randrange(2))
        else:
            read_value("v%d" % rnd.randrange(10), False)
    except OSError as e:
        errors.append("op %d (%.2f): %s" % (ops, r, e))
print(json.dumps({"wid": wid, "ops": ops, "nospace": nospace, "writes": writes, "reads": reads, "errors": errors[:20], "nerrors": len(errors)}))
`

// TestConcurrentModel runs several processes doing temp+rename replaces,
// in-place O_TRUNC rewrites, appends, unlinks and reads of overlapping
// names on a small store with eviction on, and checks every read: never
// torn, never a stable name missing, always a value some process wrote to
// that name. It runs a few seconds in make test; -soak DURATION runs it
// longer. A failure prints the seed; MOONCAKE_MODEL_SEED replays one.
func TestConcurrentModel(t *testing.T) {
	t.Parallel()
	requireTools(t, python)
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("MOONCAKE_MODEL_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("MOONCAKE_MODEL_SEED: %v", err)
		}
	}
	dur, maxOps := 8*time.Second, 4000
	if *soak > 0 {
		dur, maxOps = *soak, 1<<30
	}
	d := startDaemon(t, "--size", "32MiB")
	// Stable names and logs exist from the start, pinned.
	rng := rand.New(rand.NewPCG(seed, 0))
	for i := range 4 {
		run(t, "sh", "-c", `head -c 0 /dev/null > "$1" && setfattr -n user.mooncake.pin -v 1 "$1"`, "sh", d.path(fmt.Sprintf("s%d", i)))
	}
	for i := range 2 {
		run(t, "sh", "-c", `: > "$1" && setfattr -n user.mooncake.pin -v 1 "$1"`, "sh", d.path(fmt.Sprintf("a%d", i)))
	}
	// A first value in each stable name, written by "worker 0".
	out := py(t, `
import hashlib, os, struct, sys
for i in range(4):
    body = b"initial"
    with open("%s/s%d" % (sys.argv[1], i), "r+b") as f:
        f.write(struct.pack("<4sIQQ32s", b"mcv1", 0, i + 1, len(body), hashlib.sha256(body).digest()) + body)
        f.truncate()
print("ok")
`, d.dir)
	if !strings.Contains(out, "ok") {
		t.Fatal(out)
	}
	written := map[string]map[[2]uint64]bool{}
	note := func(name string, w, s uint64) {
		if written[name] == nil {
			written[name] = map[[2]uint64]bool{}
		}
		written[name][[2]uint64{w, s}] = true
	}
	for i := range 4 {
		note(fmt.Sprintf("s%d", i), 0, uint64(i+1))
	}
	type result struct {
		Wid     int      `json:"wid"`
		Ops     int      `json:"ops"`
		NoSpace int      `json:"nospace"`
		Writes  [][]any  `json:"writes"`
		Reads   [][]any  `json:"reads"`
		Errors  []string `json:"errors"`
		NErrors int      `json:"nerrors"`
	}
	// Rounds of at most a minute (a child command's time is bounded);
	// the names and what was written to them carry over.
	const workers = 4
	ops, nreads, nospace := 0, 0, 0
	for round, end := 0, time.Now().Add(dur); time.Now().Before(end); round++ {
		stop := time.Now().Add(time.Minute)
		if end.Before(stop) {
			stop = end
		}
		deadline := float64(stop.UnixNano()) / 1e9
		var procs []*bg
		for w := 1; w <= workers; w++ {
			procs = append(procs, background(t, python, "-c", modelWorker, d.dir, strconv.Itoa(round*workers+w),
				strconv.FormatUint(rng.Uint64()>>1, 10), fmt.Sprintf("%.3f", deadline), strconv.Itoa(maxOps)))
		}
		var results []result
		for _, p := range procs {
			out := p.mustWait(t)
			var r result
			line := lastLines(strings.TrimSpace(out), 1)
			if err := json.Unmarshal([]byte(line), &r); err != nil {
				t.Fatalf("seed %d: worker output: %v\n%s", seed, err, lastLines(out, 5))
			}
			results = append(results, r)
		}
		for _, r := range results {
			ops += r.Ops
			nospace += r.NoSpace
			for _, w := range r.Writes {
				note(w[0].(string), uint64(w[1].(float64)), uint64(w[2].(float64)))
			}
		}
		for _, r := range results {
			if r.NErrors > 0 {
				t.Errorf("seed %d: worker %d: %d errors, first: %v", seed, r.Wid, r.NErrors, r.Errors)
			}
			for _, rd := range r.Reads {
				nreads++
				name, w, s := rd[0].(string), uint64(rd[1].(float64)), uint64(rd[2].(float64))
				if !written[name][[2]uint64{w, s}] {
					t.Errorf("seed %d: worker %d read %s = value %d/%d, which nobody wrote there", seed, r.Wid, name, w, s)
				}
			}
		}
		if t.Failed() {
			break
		}
	}
	// Afterwards every stable name holds a whole value written to it.
	out = py(t, `
import hashlib, struct, sys
for i in range(4):
    b = open("%s/s%d" % (sys.argv[1], i), "rb").read()
    h = struct.calcsize("<4sIQQ32s")
    m, w, s, size, dg = struct.unpack_from("<4sIQQ32s", b)
    ok = m == b"mcv1" and len(b) == h + size and hashlib.sha256(b[h:]).digest() == dg
    print("s%d %d %d %s" % (i, w, s, "ok" if ok else "torn"))
`, d.dir)
	for line := range strings.SplitSeq(strings.TrimSpace(out), "\n") {
		var name, state string
		var w, s uint64
		if _, err := fmt.Sscanf(line, "%s %d %d %s", &name, &w, &s, &state); err != nil || state != "ok" || !written[name][[2]uint64{w, s}] {
			t.Errorf("seed %d: at the end: %q", seed, line)
		}
	}
	st := d.checkAlive(t)
	t.Logf("seed %d: %d ops, %d reads checked, %d evictions, %d volatile writes refused (ENOSPC)", seed, ops, nreads, st.Evict.Evictions, nospace)
	if st.Evict.Evictions == 0 {
		t.Errorf("seed %d: nothing was evicted: the run did not test eviction", seed)
	}
}
