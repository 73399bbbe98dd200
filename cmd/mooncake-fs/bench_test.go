package main

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	mfs "github.com/mooncake-fs/mooncake-fs/fs"
)

func TestNearestRank(t *testing.T) {
	seq := func(n int) []int64 {
		xs := make([]int64, n)
		for i := range xs {
			xs[i] = int64(i + 1)
		}
		return xs
	}
	for _, c := range []struct {
		xs       []int64
		p50, p99 int64
	}{
		{nil, 0, 0},
		{[]int64{7}, 7, 7},
		{[]int64{3, 1}, 1, 3},
		{[]int64{5, 1, 4, 2, 3}, 3, 5},
		{seq(100), 50, 99},
		{seq(5000), 2500, 4950},
		{seq(101), 51, 100},
	} {
		xs := slices.Clone(c.xs)
		// Shuffle-free reversal: percentiles must sort.
		slices.Reverse(xs)
		p50, p99 := percentiles(xs)
		if p50 != c.p50 || p99 != c.p99 {
			t.Errorf("percentiles(%d values) = %d, %d; want %d, %d", len(c.xs), p50, p99, c.p50, c.p99)
		}
	}
}

func TestBenchResultJSON(t *testing.T) {
	seqWrite, _ := lookupBenchCase("fuse-seq-write")
	small, _ := lookupBenchCase("fuse-small-files")
	for _, c := range []struct {
		name string
		c    benchCase
		m, k benchSample
		want string
	}{
		{
			name: "throughput",
			c:    seqWrite,
			// 1 GiB in 0.5 s against 1 GiB in 0.25 s.
			m:    benchSample{Bytes: 1 << 30, Ns: 500_000_000, Ops: 1024},
			k:    benchSample{Bytes: 1 << 30, Ns: 250_000_000, Ops: 1024},
			want: `{"case":"fuse-seq-write","bytes":1073741824,"gbps":2.147,"ceiling":"tmpfs-seq-write","ceiling_gbps":4.295,"ratio":0.5,"reps":3}`,
		},
		{
			name: "small",
			c:    small,
			// 5000 files in 0.25 s against 5000 in 0.05 s.
			m: benchSample{Bytes: 5000 * 4096, Ns: 250_000_000, Ops: 5000, P50ns: 41_234, P99ns: 120_060},
			k: benchSample{Bytes: 5000 * 4096, Ns: 50_000_000, Ops: 5000, P50ns: 9_960, P99ns: 20_000},
			want: `{"case":"fuse-small-files","bytes":20480000,"gbps":0.082,"ceiling":"tmpfs-small-files","ceiling_gbps":0.41,"ratio":0.2,` +
				`"ops_per_s":20000,"p50_us":41.2,"p99_us":120.1,"ceiling_ops_per_s":100000,"ceiling_p50_us":10,"ceiling_p99_us":20,"reps":3}`,
		},
		{
			name: "split",
			c:    small,
			// 1000 keys in 10 ms: 4.1 us a key in the caller, 1.5 in the
			// kernel and wake-ups, 2.25 of the daemon's own work.
			m: benchSample{Bytes: 1000 * 4096, Ns: 10_000_000, Ops: 1000, ClientNs: 4_100, FuseNs: 1_500, KeyWorkNs: 2_250, TransferNs: 2_150},
			k: benchSample{Bytes: 1000 * 4096, Ns: 5_000_000, Ops: 1000},
			want: `{"case":"fuse-small-files","bytes":4096000,"gbps":0.41,"ceiling":"tmpfs-small-files","ceiling_gbps":0.819,"ratio":0.5,` +
				`"ops_per_s":100000,"ceiling_ops_per_s":200000,"key_work_us":2.25,"transfer_us":2.15,"client_us":4.1,"fuse_us":1.5,"reps":3}`,
		},
		{
			name: "waits",
			c:    small,
			// The daemon's figures per key: waits, the collector, page
			// faults (a fault in eight keys), the work after the copy and
			// the submitted calls' waits to start.
			m: benchSample{Bytes: 1000 * 4096, Ns: 10_000_000, Ops: 1000, KeyWorkNs: 2_250,
				KeyWaits: KeyWaits{LockNs: 120, SchedNs: 640, GCNs: 310, Faults: 0.125, CommitNs: 1_040, QueueNs: 380}},
			k: benchSample{Bytes: 1000 * 4096, Ns: 5_000_000, Ops: 1000},
			want: `{"case":"fuse-small-files","bytes":4096000,"gbps":0.41,"ceiling":"tmpfs-small-files","ceiling_gbps":0.819,"ratio":0.5,` +
				`"ops_per_s":100000,"ceiling_ops_per_s":200000,"key_work_us":2.25,"key_lock_wait_us":0.12,"key_sched_wait_us":0.64,` +
				`"key_gc_us":0.31,"key_faults":0.125,"key_commit_us":1.04,"key_queue_us":0.38,"reps":3}`,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			b, err := json.Marshal(makeBenchResult(c.c, c.c.ceiling, c.m, c.k, 3))
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != c.want {
				t.Errorf("got  %s\nwant %s", b, c.want)
			}
		})
	}
}

func TestMemcpyIsItsOwnCeiling(t *testing.T) {
	c, _ := lookupBenchCase("memcpy")
	s := benchSample{Bytes: 1 << 30, Ns: 1e8, Ops: 16}
	r := makeBenchResult(c, c.ceiling, s, s, 3)
	if r.Ratio != 1 || r.GBps != r.CeilingGBps || r.Ceiling != "memcpy" || r.OpsPerS != 0 {
		t.Errorf("memcpy result %+v: want ratio 1 against itself, no ops figures", r)
	}
}

func TestMedian(t *testing.T) {
	runs := []sideRun{
		{sample: benchSample{Bytes: 100, Ns: 10, Ops: 1}},  // 10 B/ns, 0.1 ops/ns
		{sample: benchSample{Bytes: 100, Ns: 50, Ops: 10}}, // 2 B/ns, 0.2 ops/ns
		{sample: benchSample{Bytes: 100, Ns: 20, Ops: 1}},  // 5 B/ns, 0.05 ops/ns
	}
	if got := median(runs, false).sample.Ns; got != 20 {
		t.Errorf("median by bytes/s picked ns=%d, want 20", got)
	}
	if got := median(runs, true).sample.Ns; got != 10 {
		t.Errorf("median by ops/s picked ns=%d, want 10", got)
	}
	if got := median(runs[:1], false).sample.Ns; got != 10 {
		t.Errorf("median of one picked ns=%d", got)
	}
	if runs[0].sample.Ns != 10 {
		t.Error("median reordered its argument")
	}
}

func TestDirectRunsHaveTheirOwnMedian(t *testing.T) {
	// The median layered run's own direct pass was the slowest of the
	// three: the reported direct rate is the direct passes' median.
	d := func(ns int64) *benchSample { return &benchSample{Bytes: 100, Ns: ns, Ops: 10} }
	runs := []sideRun{
		{sample: benchSample{Bytes: 100, Ns: 10, Ops: 10, Direct: d(9)}},
		{sample: benchSample{Bytes: 100, Ns: 20, Ops: 10, Direct: d(40)}},
		{sample: benchSample{Bytes: 100, Ns: 30, Ops: 10, Direct: d(11)}},
		{sample: benchSample{Bytes: 100, Ns: 30, Ops: 10}}, // no direct pass: left out
	}
	ds := alongside(runs, directOf)
	if len(ds) != 3 {
		t.Fatalf("%d direct runs, want 3", len(ds))
	}
	if got := median(ds, true).sample.Ns; got != 11 {
		t.Errorf("direct median picked ns=%d, want 11", got)
	}
	if m := median(runs, true).sample; m.Ns != 20 || m.Direct.Ns != 40 {
		t.Errorf("layered median %+v", m)
	}
}

func TestSelectBenchCases(t *testing.T) {
	names := func(cs []benchCase) string {
		var s []string
		for _, c := range cs {
			s = append(s, c.name)
		}
		return strings.Join(s, ",")
	}
	// By default every case this machine can run (GPU cases need CUDA).
	var runnable []string
	for _, c := range benchCases() {
		if c.needs == nil || c.needs() == nil {
			runnable = append(runnable, c.name)
		}
	}
	all, err := selectBenchCases("")
	if err != nil || names(all) != strings.Join(runnable, ",") {
		t.Fatalf("all cases: %q, %v", names(all), err)
	}
	// Table order, duplicates once.
	got, err := selectBenchCases(" fuse-small-files,memcpy,memcpy ")
	if err != nil || names(got) != "memcpy,fuse-small-files" {
		t.Errorf("got %q, %v", names(got), err)
	}
	if _, err := selectBenchCases("memcpy,nope,fuse-nope"); err == nil || !strings.Contains(err.Error(), "nope, fuse-nope") {
		t.Errorf("unknown cases: err %v", err)
	}
	if _, err := selectBenchCases(","); err == nil {
		t.Error("empty list accepted")
	}
}

// inProcessCeilings are what withCopy workers measure beside the case:
// a copy of the same bytes, the same GPU copies by the driver, a
// bare ioctl round trip.
var inProcessCeilings = map[string]bool{"copy": true, "cuda-memcpy-pinned": true, "cuda-memcpy-async": true,
	"ioctl-roundtrip": true}

func TestBenchCaseTable(t *testing.T) {
	seen := map[string]bool{}
	for _, c := range benchCases() {
		if seen[c.name] {
			t.Errorf("case %s twice", c.name)
		}
		seen[c.name] = true
		if c.run == nil || c.ceiling == "" {
			t.Errorf("case %s: needs run and a ceiling label", c.name)
		}
		if c.target == onMount && c.cluster == "" && !strings.HasPrefix(c.ceiling, "tmpfs-") {
			t.Errorf("case %s: ceiling %q on the tmpfs should say so", c.name, c.ceiling)
		}
		if c.ceilingRun != nil && c.target != onMount {
			t.Errorf("case %s: a ceiling function needs a tmpfs side", c.name)
		}
		if c.target == onMount && c.cluster != "" && c.ceiling != "single-node" {
			t.Errorf("case %s: the other side of a cluster case is the single-node mount, labelled %q", c.name, c.ceiling)
		}
		if c.cluster != "" && c.needs == nil {
			t.Errorf("case %s: a cluster case needs etcd and must say so", c.name)
		}
		if c.target == withCopy && !inProcessCeilings[c.ceiling] && !strings.HasPrefix(c.name, "safetensors-") &&
			!(c.cluster != "" && c.ceiling == "tcp-stream") {
			t.Errorf("case %s: the in-process ceiling is labelled %q, not one of the known ones", c.name, c.ceiling)
		}
	}
}

func TestParseBenchFlags(t *testing.T) {
	c, err := parseBenchFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.size != 1<<30 || c.storeSize != 3<<30 || c.reps != 3 || c.files != 5000 || c.json || c.keepGoing {
		t.Errorf("defaults: %+v", c)
	}
	c, err = parseBenchFlags([]string{"--json", "--size", "2GiB", "--case", "memcpy", "--keep-going"})
	if err != nil {
		t.Fatal(err)
	}
	if c.size != 2<<30 || c.storeSize != 5<<30 || !c.json || !c.keepGoing || len(c.cases) != 1 {
		t.Errorf("flags: %+v", c)
	}
	// Every bad flag is reported at once.
	_, err = parseBenchFlags([]string{"--size", "1KiB", "--reps", "0", "--case", "x", "--store-size", "1MiB"})
	if err == nil {
		t.Fatal("bad flags accepted")
	}
	for _, want := range []string{"--size", "--reps", "--case", "--store-size"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
}

func TestWorkerProtocol(t *testing.T) {
	// The memcpy case needs no file system: run it through the worker
	// entry point in this process and decode its line like bench does.
	p := benchParams{Size: memcpyBuf}
	raw, _ := json.Marshal(p)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = w
	err = runBench([]string{"worker", "run", "memcpy", "", string(raw)})
	os.Stdout = stdout
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	var buf [4096]byte
	n, _ := r.Read(buf[:])
	var s benchSample
	if err := json.Unmarshal(buf[:n], &s); err != nil {
		t.Fatalf("worker line %q: %v", buf[:n], err)
	}
	if s.Bytes != memcpyBuf || s.Ns <= 0 || s.Ops != 1 {
		t.Errorf("sample %+v", s)
	}
	for _, bad := range [][]string{
		{"worker", "run", "memcpy", ""},
		{"worker", "run", "nope", "", "{}"},
		{"worker", "sing", "memcpy", "", "{}"},
		{"worker", "run", "memcpy", "", "{"},
	} {
		if err := runBench(bad); err == nil {
			t.Errorf("runBench(%q) succeeded", bad)
		}
	}
}

func TestProcCPU(t *testing.T) {
	if _, err := procCPU(os.Getpid()); err != nil {
		t.Fatal(err)
	}
}

// TestSteal: the steal field of /proc/stat's first line, in USER_HZ
// ticks; a line without one is an error, not a zero.
func TestSteal(t *testing.T) {
	got, err := parseSteal([]byte("cpu  17491 0 11130 493167 384 0 1064 8248 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"))
	if err != nil || got != 82480*time.Millisecond {
		t.Errorf("parseSteal = %v, %v; want 82.48s", got, err)
	}
	for _, bad := range []string{"", "cpu 1 2 3 4 5 6 7\n", "cpu0 1 2 3 4 5 6 7 8 9 10\n", "cpu 1 2 3 4 5 6 7 x 0 0\n"} {
		if _, err := parseSteal([]byte(bad)); err == nil {
			t.Errorf("parseSteal(%q) succeeded", bad)
		}
	}
	if _, err := hostSteal(); err != nil {
		t.Fatal(err)
	}
}

// TestCopyCeilings: a withCopy case reports each side's own median: the
// mooncake runs by their rate, the copies measured beside them by theirs.
func TestCopyCeilings(t *testing.T) {
	mk := func(ns, cns int64) sideRun {
		return sideRun{sample: benchSample{Bytes: 1000, Ns: ns, Ops: 1, Ceiling: &benchSample{Bytes: 1000, Ns: cns, Ops: 1}}}
	}
	runs := []sideRun{mk(10, 300), mk(30, 100), mk(20, 200)}
	if got := median(runs, false).sample.Ns; got != 20 {
		t.Errorf("mooncake median ns=%d, want 20", got)
	}
	cs := alongside(runs, ceilingOf)
	if len(cs) != 3 {
		t.Fatalf("%d ceilings", len(cs))
	}
	if got := median(cs, false).sample.Ns; got != 200 {
		t.Errorf("ceiling median ns=%d, want 200", got)
	}
	b, err := json.Marshal(runs[0].sample)
	if err != nil || !strings.Contains(string(b), `"ceiling":{"bytes":1000,"ns":300,"ops":1}`) {
		t.Errorf("sample JSON %s, %v", b, err)
	}
}

// TestIoctlCases: the ioctl cases are in the table with their targets.
func TestIoctlCases(t *testing.T) {
	for name, target := range map[string]benchTarget{
		"ioctl-put-buf": withCopy, "ioctl-get-buf": withCopy, "ioctl-put-vm": withCopy, "ioctl-get-vm": withCopy, "ioctl-small": onMount,
	} {
		c, ok := lookupBenchCase(name)
		if !ok || c.target != target {
			t.Errorf("case %s: found %v, target %v", name, ok, c.target)
		}
	}
	if c, _ := lookupBenchCase("ioctl-small"); !c.small || c.ceilingRun == nil {
		t.Error("ioctl-small: want a small case with its own tmpfs ceiling function")
	}
}

// TestStopClusters: starting a cluster stops the ones running, each
// closed (its mounts and directory gone) and forgotten, so that its next
// case starts it again.
func TestStopClusters(t *testing.T) {
	e := &benchEnv{clusters: map[string]*benchCluster{}}
	for _, kind := range []string{"", "fake"} {
		c := &benchCluster{root: filepath.Join(t.TempDir(), "cluster-"+kind)}
		mnt := filepath.Join(c.root, "a")
		if err := os.MkdirAll(mnt, 0o755); err != nil {
			t.Fatal(err)
		}
		c.mnts = []string{mnt}
		e.clusters[kind] = c
	}
	roots := []string{e.clusters[""].root, e.clusters["fake"].root}
	if err := e.stopClusters(); err != nil {
		t.Fatal(err)
	}
	if len(e.clusters) != 0 {
		t.Fatalf("%d clusters still kept", len(e.clusters))
	}
	for _, r := range roots {
		if _, err := os.Stat(r); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s: %v; want it removed", r, err)
		}
	}
	if err := e.stopClusters(); err != nil {
		t.Fatalf("with none running: %v", err)
	}
}

// TestClusterCasesByKind: the cluster cases come grouped by their
// cluster, so that a full run starts each (one runs at a time) once.
func TestClusterCasesByKind(t *testing.T) {
	done := map[string]bool{}
	last := ""
	for i, c := range clusterBenchCases() {
		if i > 0 && c.rdma != last {
			done[last] = true
			if done[c.rdma] {
				t.Fatalf("%s: the %q cluster again, after other cases", c.name, c.rdma)
			}
		}
		last = c.rdma
	}
}

// TestKeyWaits: the daemon's figures between two readings, per key of
// the pass; a pass of no keys says nothing, and a count that went down
// (another daemon's reading) counts as none.
func TestKeyWaits(t *testing.T) {
	before := mfs.BatchStats{Keys: 100, LockWaitNs: 1_000, SchedWaitNs: 5_000, GCCPUNs: 0, MinorFaults: 40, CommitNs: 7_000}
	after := mfs.BatchStats{Keys: 1_100, LockWaitNs: 201_000, SchedWaitNs: 5_000, GCCPUNs: 90_000, MinorFaults: 290, CommitNs: 707_000}
	if got, want := keyWaits(before, after), (KeyWaits{LockNs: 200, SchedNs: 0, GCNs: 90, Faults: 0.25, CommitNs: 700}); got != want {
		t.Errorf("keyWaits: %+v, want %+v", got, want)
	}
	if got := keyWaits(after, after); got != (KeyWaits{}) {
		t.Errorf("no keys: %+v", got)
	}
	after.MinorFaults = 10
	if got := keyWaits(before, after); got.Faults != 0 {
		t.Errorf("fewer faults after: %v a key", got.Faults)
	}
}
