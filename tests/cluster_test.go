package tests

// Cluster end to end: a real etcd on loopback and several daemons, each
// with its own mountpoint and transport port, driven from child processes.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store/etcdindex/etcdtest"
)

const clusterToken = "e2e-cluster-token-0123456789"

type testCluster struct {
	etcd   *etcdtest.Server
	token  string // path of the token file
	prefix string
	nodes  map[string]*daemon
}

// newTestCluster starts etcd and one daemon per name.
func newTestCluster(t *testing.T, names ...string) *testCluster {
	t.Helper()
	requireE2E(t)
	c := &testCluster{etcd: etcdtest.Start(t), nodes: map[string]*daemon{},
		prefix: fmt.Sprintf("/e2e-%d/", time.Now().UnixNano())}
	c.token = filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(c.token, []byte(clusterToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		c.start(t, n)
	}
	return c
}

// start mounts node name (again) with extra mount flags.
func (c *testCluster) start(t *testing.T, name string, extra ...string) *daemon {
	t.Helper()
	return c.startWith(t, name, c.token, extra...)
}

func (c *testCluster) startWith(t *testing.T, name, token string, extra ...string) *daemon {
	t.Helper()
	args := append([]string{"--etcd", c.etcd.ClientURL, "--etcd-prefix", c.prefix, "--node", name,
		"--listen", "127.0.0.1:0", "--token-file", token, "--node-ttl", "2s",
		"--size", "128MiB", "--segment-size", "32MiB", "--hugepages", "off"}, extra...)
	d := startDaemon(t, args...)
	c.nodes[name] = d
	return d
}

// clusterStatus is the cluster part of status --json.
type clusterStatus struct {
	Live  bool `json:"live"`
	Nodes []struct {
		Name string `json:"name"`
		Free uint64 `json:"free"`
		Live bool   `json:"live"`
	} `json:"nodes"`
	Lost      []string `json:"lost"`
	LostCount int      `json:"lost_count"`
	Repairer  string   `json:"repairer"`
	Server    struct {
		AuthFailures uint64 `json:"AuthFailures"`
	} `json:"server"`
}

func (d *daemon) cluster(t testing.TB) clusterStatus {
	t.Helper()
	out := run(t, daemonBin(), "status", "--json", d.dir)
	var s struct {
		Cluster *clusterStatus `json:"cluster"`
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil || s.Cluster == nil {
		t.Fatalf("status --json has no cluster part (%v):\n%s", err, out)
	}
	return *s.Cluster
}

// replicaNodes reads user.mooncake.location: the nodes holding the file.
func replicaNodes(t testing.TB, path string) []string {
	t.Helper()
	out, err := shErr(`getfattr --absolute-names --only-values -n user.mooncake.location "$1"`, path)
	if err != nil {
		t.Fatalf("location of %s: %v %s", path, err, out)
	}
	var nodes []string
	for r := range strings.FieldsSeq(out) {
		i := strings.IndexByte(r, ':')
		if i <= 0 {
			t.Fatalf("location of %s: %q", path, out)
		}
		nodes = append(nodes, r[:i])
	}
	return nodes
}

// segmentsOf counts the distinct segments a location string names.
func segmentsOf(loc string) int {
	segs := map[string]bool{}
	for _, m := range regexp.MustCompile(`seg\d+`).FindAllString(loc, -1) {
		segs[m] = true
	}
	return len(segs)
}

func randomFile(t testing.TB, mib int) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), fmt.Sprintf("src-%d", mib))
	sh(t, `head -c $(($2*1048576+4097)) /dev/urandom > "$1"`, p, fmt.Sprint(mib))
	return p
}

// TestClusterReadEverywhere: a file written and closed on A is read whole on
// B and C at once (cp, dd, ioctl GET), and namespace changes on any node
// are seen by all.
func TestClusterReadEverywhere(t *testing.T) {
	requireTools(t, "getfattr")
	c := newTestCluster(t, "a", "b", "c")
	a, b, cc := c.nodes["a"], c.nodes["b"], c.nodes["c"]
	src := randomFile(t, 40)
	run(t, "cp", src, a.path("f"))
	run(t, "cmp", src, b.path("f"))
	sh(t, `dd if="$1" bs=1M status=none | cmp - "$2"`, cc.path("f"), src)
	local := filepath.Join(t.TempDir(), "got")
	_, m := client(t, "get", cc.path("f"), local)
	want(t, m, "get", "OK")
	run(t, "cmp", src, local)
	if got := replicaNodes(t, cc.path("f")); len(got) != 1 || got[0] != "a" {
		t.Fatalf("f on %v, want [a]", got)
	}
	// Close-to-open, many times: each version is seen whole on the other
	// nodes right after the writer's close returns.
	for i := range 20 {
		body := strings.Repeat(fmt.Sprintf("v%d-", i), 1000+i*37)
		sh(t, `printf %s "$1" > "$2"`, body, a.path("small"))
		for _, d := range []*daemon{b, cc} {
			if got := run(t, "cat", d.path("small")); got != body {
				t.Fatalf("version %d on %s: %d bytes, want %d", i, d.dir, len(got), len(body))
			}
		}
	}
	// Rename on B, unlink on C, mkdir on A: seen everywhere.
	run(t, "mv", b.path("f"), b.path("g"))
	for _, d := range []*daemon{a, cc} {
		if _, err := os.Stat(d.path("f")); !os.IsNotExist(err) {
			t.Fatalf("f still visible on %s after rename on b: %v", d.dir, err)
		}
		run(t, "cmp", src, d.path("g"))
	}
	run(t, "rm", cc.path("g"))
	run(t, "mkdir", a.path("dir"))
	for _, d := range []*daemon{a, b} {
		if _, err := os.Stat(d.path("g")); !os.IsNotExist(err) {
			t.Fatalf("g still visible on %s after unlink on c: %v", d.dir, err)
		}
	}
	if out := run(t, "ls", cc.path()); strings.Fields(out)[0] != "dir" {
		t.Fatalf("ls on c: %q", out)
	}
	// A's memory is given back once the file is gone everywhere.
	waitFor(t, "a frees the deleted file", func() (bool, string) {
		s := a.status(t)
		return s.Used < 1<<20, fmt.Sprintf("used %d", s.Used)
	})
	st := a.cluster(t)
	if len(st.Nodes) != 3 || !st.Live || st.Repairer != "a" {
		t.Fatalf("cluster status on a: %+v", st)
	}
}

// TestClusterPlacement: node:NAME and spread are honoured, replicas land on
// distinct nodes, an impossible choice is ENOSPC, and a full node spills a
// large file across the segments of another.
func TestClusterPlacement(t *testing.T) {
	requireTools(t, "getfattr", "setfattr")
	c := newTestCluster(t, "a", "b", "c")
	a, b, cc := c.nodes["a"], c.nodes["b"], c.nodes["c"]
	src := randomFile(t, 20)

	run(t, "mkdir", a.path("onb"))
	run(t, "setfattr", "-n", "user.mooncake.placement", "-v", "node:b", a.path("onb"))
	run(t, "cp", src, a.path("onb", "x"))
	if got := replicaNodes(t, cc.path("onb", "x")); len(got) != 1 || got[0] != "b" {
		t.Fatalf("onb/x on %v, want [b]", got)
	}
	run(t, "cmp", src, cc.path("onb", "x"))

	// Two replicas of a 40 MiB file: on two nodes, each across two of
	// their 32 MiB segments.
	run(t, "mkdir", b.path("two"))
	run(t, "setfattr", "-n", "user.mooncake.replicas", "-v", "2", b.path("two"))
	src40 := randomFile(t, 40)
	run(t, "cp", src40, a.path("two", "y"))
	if got := replicaNodes(t, b.path("two", "y")); len(got) != 2 || got[0] == got[1] {
		t.Fatalf("two/y on %v, want two distinct nodes", got)
	}
	loc, _ := shErr(`getfattr --absolute-names --only-values -n user.mooncake.location "$1"`, b.path("two", "y"))
	for _, rep := range strings.Fields(loc) {
		if segmentsOf(rep) < 2 {
			t.Fatalf("replica %q does not span two segments", rep)
		}
	}
	for _, d := range []*daemon{a, b, cc} {
		run(t, "cmp", src40, d.path("two", "y"))
	}

	// Bad values are refused; impossible placements fail with ENOSPC and
	// leave nothing.
	if out, err := runErr("setfattr", "-n", "user.mooncake.replicas", "-v", "0", a.path("two")); err == nil {
		t.Fatalf("replicas=0 accepted: %s", out)
	}
	run(t, "mkdir", a.path("nowhere"))
	run(t, "setfattr", "-n", "user.mooncake.placement", "-v", "node:zz", a.path("nowhere"))
	if out, err := runErr("cp", src, a.path("nowhere", "z")); err == nil || !strings.Contains(out, "No space left") {
		t.Fatalf("cp to node:zz: %v %s", err, out)
	}
	run(t, "mkdir", a.path("four"))
	run(t, "setfattr", "-n", "user.mooncake.replicas", "-v", "4", a.path("four"))
	if out, err := runErr("cp", src, a.path("four", "w")); err == nil || !strings.Contains(out, "No space left") {
		t.Fatalf("cp with 4 replicas on 3 nodes: %v %s", err, out)
	}
	if _, err := os.Stat(b.path("four", "w")); err == nil {
		if sz := run(t, "stat", "-c", "%s", b.path("four", "w")); strings.TrimSpace(sz) != "0" {
			t.Fatalf("a failed write left %s bytes visible", sz)
		}
	}

	// Fill a (it holds a replica of two/y), then write more than it has left: the file spills to the
	// node with the most free space, across its 32 MiB segments.
	sh(t, `head -c $((80*1048576)) /dev/zero > "$1"`, a.path("filler"))
	big := randomFile(t, 60)
	run(t, "cp", big, a.path("big"))
	nodes := replicaNodes(t, b.path("big"))
	if len(nodes) != 1 || nodes[0] == "a" {
		t.Fatalf("big on %v, want one node other than a", nodes)
	}
	loc, _ = shErr(`getfattr --absolute-names --only-values -n user.mooncake.location "$1"`, b.path("big"))
	if segmentsOf(loc) < 2 {
		t.Fatalf("big does not span segments: %s", loc)
	}
	for _, d := range []*daemon{a, b, cc} {
		run(t, "cmp", big, d.path("big"))
	}
}

// TestClusterReplicasSurviveKill: with replicas=2, kill -9 of a node loses
// nothing: every file reads bit-identical and the count is restored on the
// survivors; a file with one replica on the dead node is listed as lost
// and reads as EIO, never as wrong data.
func TestClusterReplicasSurviveKill(t *testing.T) {
	requireTools(t, "getfattr", "setfattr")
	c := newTestCluster(t, "a", "b", "c")
	a, b, cc := c.nodes["a"], c.nodes["b"], c.nodes["c"]
	run(t, "mkdir", a.path("r"))
	run(t, "setfattr", "-n", "user.mooncake.replicas", "-v", "2", a.path("r"))
	srcs := map[string]string{}
	for i, mib := range []int{0, 1, 9, 30} {
		name := fmt.Sprintf("f%d", i)
		srcs[name] = randomFile(t, mib)
		run(t, "cp", srcs[name], b.path("r", name)) // written on b: replicas on b and the freest other
	}
	lonely := randomFile(t, 3)
	run(t, "mkdir", b.path("one"))
	run(t, "setfattr", "-n", "user.mooncake.placement", "-v", "node:b", b.path("one"))
	run(t, "cp", lonely, a.path("one", "only-on-b"))

	b.kill9(t)
	waitFor(t, "replicas restored without b", func() (bool, string) {
		var state []string
		for name := range srcs {
			nodes := replicaNodes(t, a.path("r", name))
			state = append(state, fmt.Sprintf("%s:%v", name, nodes))
			if len(nodes) != 2 || nodes[0] == "b" || nodes[1] == "b" {
				return false, strings.Join(state, " ")
			}
		}
		return true, ""
	})
	for name, src := range srcs {
		run(t, "cmp", src, a.path("r", name))
		run(t, "cmp", src, cc.path("r", name))
	}
	out, err := runErr("cat", cc.path("one", "only-on-b"))
	if err == nil || !strings.Contains(out, "Input/output error") {
		t.Fatalf("reading a lost file: %v %q", err, out)
	}
	st := a.cluster(t)
	if st.LostCount != 1 || len(st.Lost) != 1 || st.Lost[0] != "one/only-on-b" {
		t.Fatalf("lost list: %+v", st)
	}
	goneB := false
	for _, n := range st.Nodes {
		goneB = goneB || (n.Name == "b" && !n.Live)
	}
	if !goneB {
		t.Fatalf("status does not show b as gone: %+v", st.Nodes)
	}
	if !strings.Contains(a.log.String()+cc.log.String(), "lost: no surviving replica") {
		t.Error("no log line names the lost object")
	}
	// b comes back under the same name with empty memory: it joins again
	// and nothing claims bytes on it that it no longer has.
	b2 := c.start(t, "b")
	run(t, "cmp", srcs["f3"], b2.path("r", "f3"))
}

// TestClusterNodeStoppedMidWrite: the node holding a file being written
// dies; the write fails cleanly (EHOSTUNREACH) and no partial file
// becomes visible.
func TestClusterNodeStoppedMidWrite(t *testing.T) { testNodeStoppedMidWrite(t, false) }

// TestClusterNodeRestartedMidWrite: the same, the node started again
// under its name before the writer goes on: its new daemon knows nothing
// of the write's space, and the write fails as if the node were gone.
func TestClusterNodeRestartedMidWrite(t *testing.T) { testNodeStoppedMidWrite(t, true) }

// testNodeStoppedMidWrite runs the test with extra mount flags on every
// node (the RDMA variant is in rdma_test.go), starting the killed node
// again before the writer goes on with restart.
func testNodeStoppedMidWrite(t *testing.T, restart bool, extra ...string) (a *daemon) {
	requireTools(t, "setfattr")
	c := newTestCluster(t)
	for _, n := range []string{"a", "b", "c"} {
		c.start(t, n, extra...)
	}
	a, b, cc := c.nodes["a"], c.nodes["b"], c.nodes["c"]
	run(t, "mkdir", a.path("onb"))
	run(t, "setfattr", "-n", "user.mooncake.placement", "-v", "node:b", a.path("onb"))
	w := background(t, "python3", "-c", `
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.write(fd, b"x" * (8 << 20))
print("written", flush=True)
sys.stdin.readline()
try:
    for i in range(4):
        os.write(fd, b"y" * (8 << 20))
    os.close(fd)
    print("closed ok")
except OSError as e:
    print("failed", e.strerror)
`, a.path("onb", "partial"))
	w.waitOutput(t, "written")
	b.kill9(t)
	if restart {
		c.start(t, "b", extra...)
	}
	w.stdin.Write([]byte("go\n"))
	out := w.mustWait(t)
	if !strings.Contains(out, "failed No route to host") {
		t.Fatalf("writer after its node died: %s", out)
	}
	for _, d := range []*daemon{a, cc} {
		if _, err := os.Stat(d.path("onb", "partial")); err == nil {
			if sz := strings.TrimSpace(run(t, "stat", "-c", "%s", d.path("onb", "partial"))); sz != "0" {
				t.Fatalf("partial file of %s bytes visible on %s", sz, d.dir)
			}
		}
	}
	return a
}

// TestClusterEtcdOutage: with etcd stopped writes fail with a clear error,
// reads of cached objects keep working, and the cluster recovers when etcd
// returns.
func TestClusterEtcdOutage(t *testing.T) {
	c := newTestCluster(t, "a", "b")
	a, b := c.nodes["a"], c.nodes["b"]
	src := randomFile(t, 5)
	run(t, "cp", src, a.path("f"))
	run(t, "cmp", src, b.path("f"))

	c.etcd.Stop()
	out, err := runErr("cp", src, b.path("g"))
	if err == nil || !strings.Contains(out, "timed out") {
		t.Fatalf("write with etcd stopped: %v %q", err, out)
	}
	run(t, "cmp", src, b.path("f"))
	run(t, "cmp", src, a.path("f"))
	if !strings.Contains(b.log.String(), "etcd unavailable") {
		t.Error("b's log does not say etcd is unavailable")
	}

	c.etcd.Start()
	waitFor(t, "a write after etcd returns", func() (bool, string) {
		out, err := runErr("cp", src, b.path("g"))
		return err == nil, out
	})
	waitFor(t, "a reads b's write after etcd returns", func() (bool, string) {
		out, err := runErr("cmp", src, a.path("g"))
		return err == nil, out
	})
}

// TestClusterFullNodeEtcdOutage: with etcd stopped, a write into a full
// node (one that must evict for room, and has no peer to spill to) fails
// with ETIMEDOUT after one request timeout, its files all kept; the
// eviction pass waited one timeout a file before and then said ENOSPC.
// Once etcd is back the write evicts and lands.
func TestClusterFullNodeEtcdOutage(t *testing.T) {
	c := newTestCluster(t, "a")
	a := c.nodes["a"]
	src := randomFile(t, 8)
	const files = 14 // of 8 MiB and a page: 113 MiB of the node's 128, under its high watermark
	for i := range files {
		run(t, "cp", src, a.path(fmt.Sprintf("f%02d", i)))
	}
	big := randomFile(t, 24)
	run(t, "touch", a.path("big")) // its name needs etcd; its bytes room

	c.etcd.Stop()
	start := time.Now()
	out, err := runErr("dd", "if="+big, "of="+a.path("big"), "bs=1M", "conv=notrunc")
	took := time.Since(start)
	if err == nil || !strings.Contains(out, "timed out") {
		t.Fatalf("write into a full node with etcd stopped: %v %q", err, out)
	}
	// A hang guard, not a latency assertion: the daemon's request timeout
	// is 5 s, and the old pass waited it for each of the 14 files.
	if took > 40*time.Second {
		t.Fatalf("write into a full node with etcd stopped took %v", took)
	}
	t.Logf("write into a full node with etcd stopped failed after %v: %s", took, out)
	for i := range files {
		run(t, "cmp", src, a.path(fmt.Sprintf("f%02d", i)))
	}

	c.etcd.Start()
	waitFor(t, "a write into the full node after etcd returns", func() (bool, string) {
		out, err := runErr("cp", big, a.path("big"))
		return err == nil, out
	})
	run(t, "cmp", big, a.path("big"))
}

// TestClusterWrongToken: a node with another token joins etcd but no peer
// serves it: it reads nothing of theirs, and they count the refusals.
func TestClusterWrongToken(t *testing.T) {
	c := newTestCluster(t, "a")
	a := c.nodes["a"]
	src := randomFile(t, 2)
	run(t, "cp", src, a.path("f"))
	bad := filepath.Join(t.TempDir(), "bad-token")
	if err := os.WriteFile(bad, []byte("not-the-cluster-token-at-all"), 0o600); err != nil {
		t.Fatal(err)
	}
	x := c.startWith(t, "x", bad)
	out, err := runErr("cat", x.path("f"))
	if err == nil || !strings.Contains(out, "Input/output error") {
		t.Fatalf("read with the wrong token: %v %q", err, out)
	}
	if st := a.cluster(t); st.Server.AuthFailures == 0 {
		t.Fatalf("a counted no refused peer: %+v", st)
	}
	run(t, "cmp", src, a.path("f"))
}

// TestClusterOpenReaderKeepsVersion: a file open on a whose bytes are on b
// still reads as the version it opened after b replaced the file, past b's
// 5 s free delay: a's daemon asked b to hold the old bytes, and b frees
// them once the file is closed on a.
func TestClusterOpenReaderKeepsVersion(t *testing.T) {
	requireTools(t, "setfattr")
	c := newTestCluster(t, "a", "b")
	a, b := c.nodes["a"], c.nodes["b"]
	run(t, "mkdir", a.path("onb"))
	run(t, "setfattr", "-n", "user.mooncake.placement", "-v", "node:b", a.path("onb"))
	old, nu := randomFile(t, 4), randomFile(t, 2)
	run(t, "cp", old, a.path("onb", "f"))
	want, err := os.ReadFile(old)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(a.path("onb", "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, len(want))
	if _, err := f.ReadAt(got[:1<<20], 0); err != nil {
		t.Fatal(err)
	}
	run(t, "cp", nu, b.path("onb", "f"))
	run(t, "cmp", nu, a.path("onb", "f"))
	holds := func() int {
		var s struct {
			Cluster struct {
				Holds int `json:"holds"`
			} `json:"cluster"`
		}
		if err := json.Unmarshal([]byte(run(t, daemonBin(), "status", "--json", b.dir)), &s); err != nil {
			t.Fatal(err)
		}
		return s.Cluster.Holds
	}
	deadline := time.Now().Add(10 * time.Second)
	for holds() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("b holds %d bodies for a's open reader, want 1", holds())
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(7 * time.Second) // past b's free delay
	if _, err := f.ReadAt(got[1<<20:], 1<<20); err != nil && err != io.EOF {
		t.Fatalf("read the rest of the opened version: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the open file on a changed under its reader")
	}
	f.Close()
	for deadline = time.Now().Add(10 * time.Second); holds() != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("b still holds %d bodies after the reader closed", holds())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestClusterWriterFollowsRename: a file open for writing on b, renamed
// on a (the file, then its directory) while b still writes: b's close
// publishes everything at the new name, as a local rename is followed
// (another node's rename moves nothing in b's kernel, so b asks the
// index where the file went); a put through b's open file after a's
// rename lands there too. b's close returned 0 and left the new name
// with the content before the rename, or empty: the rest was lost.
func TestClusterWriterFollowsRename(t *testing.T) {
	c := newTestCluster(t, "a", "b")
	a, b := c.nodes["a"], c.nodes["b"]
	out := py(t, keysPrelude+`
A, B = sys.argv[2], sys.argv[3]
data = os.urandom(3 << 20)
bad = 0
def check(label, path, want):
    global bad
    for m in (A, B):
        with open(m + path, "rb") as f:
            got = f.read()
        if got != want:
            bad += 1
            print(f"{label} on {m}: {len(got)} B, want {len(want)}")
os.makedirs(A + "/t/d")
fd = os.open(B + "/t/d/x", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, data[:1 << 20])
os.rename(A + "/t/d/x", A + "/t/d/y")
os.write(fd, data[1 << 20:2 << 20])
os.rename(A + "/t/d", A + "/t/e")
os.write(fd, data[2 << 20:])
os.close(fd)
check("file and directory renamed", "/t/e/y", data)
f = mc.File(B + "/t/e/y", "w")
os.rename(A + "/t/e/y", A + "/t/e/z")
f.put(data[:12345])
f.close()
check("put after a rename", "/t/e/z", data[:12345])
print(f"bad={bad}")
`, publicPythonDir(t), a.dir, b.dir)
	checkResults(t, out, map[string]string{"bad": "0"})
}

// TestClusterKilledDaemonEndsItsMount: a daemon killed (kill -9) while
// its node and another create files in one directory exits, and its
// mount fails (ENOTCONN) instead of hanging. The index watch's entry
// invalidation waited in the kernel for the directory's lock, held by a
// create of the same mount waiting for the dead daemon: the daemon never
// finished exiting, and its mount and the creating process hung until
// the connection was aborted by hand (5 of 11 kills in a probe). Its
// watchdog (cmd/mooncake-fs/watchdog.go) aborts the connection now.
func TestClusterKilledDaemonEndsItsMount(t *testing.T) {
	c := newTestCluster(t, "a", "b")
	b := c.nodes["b"]
	run(t, "mkdir", "-p", b.path("t", "d"))
	creator := `
import os, sys, time
d, tag = sys.argv[1], sys.argv[2]
end, i = time.time() + 3, 0
while time.time() < end:
    try:
        open("%s/%s%d" % (d, tag, i), "wb").close()
    except OSError:
        break
    i += 1
`
	for round := range 3 {
		a := c.nodes["a"]
		if round > 0 {
			a = c.start(t, "a")
		}
		ca := background(t, python, "-c", creator, a.path("t", "d"), fmt.Sprintf("a%d-", round))
		cb := background(t, python, "-c", creator, b.path("t", "d"), fmt.Sprintf("b%d-", round))
		time.Sleep(time.Duration(700+200*round) * time.Millisecond) // amid the creates
		a.killed.Store(true)
		_ = a.cmd.Process.Signal(syscall.SIGKILL)
		select {
		case <-a.done:
		case <-time.After(30 * time.Second):
			abortConnection(t, a.dir)
			t.Fatalf("round %d: the killed daemon did not exit within 30 s (its mount hung)", round)
		}
		_, _ = ca.wait() // its creates fail once the daemon is gone
		cb.mustWait(t)
	}
}

// abortConnection ends the FUSE connection of the mount at dir through
// fusectl, as an administrator would end a hung mount.
// (Its device comes from mountinfo: a stat of a hung mount would hang.)
func abortConnection(t *testing.T, dir string) {
	info, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Log(err)
		return
	}
	for line := range strings.SplitSeq(string(info), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == dir {
			if _, minor, ok := strings.Cut(f[2], ":"); ok {
				_ = os.WriteFile("/sys/fs/fuse/connections/"+minor+"/abort", []byte("1"), 0)
			}
		}
	}
}
