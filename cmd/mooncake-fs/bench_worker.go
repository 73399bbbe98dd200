package main

// The worker protocol (internal; bench is its only caller):
//
//	mooncake-fs bench worker PHASE CASE DIR PARAMS
//
// PHASE is setup, run, ceiling or teardown; DIR is where the case works
// (the mount, the tmpfs, or "" for cases that use no file system); PARAMS
// is benchParams as JSON. A run (or ceiling, the tmpfs side of a case with
// its own ceiling function) prints one benchSample as a JSON line on
// stdout; setup and teardown print nothing. Failure is a non-zero exit
// with the reason on stderr.
//
// A case is therefore any function of (dir, params) -> sample: setup and
// teardown are untimed and run once per side, run is one repetition and
// times only its own loop. Workers do I/O with raw system calls into
// buffers that are allocated once, page-aligned and outside the Go heap,
// so that O_DIRECT and device memory can be used later.

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// benchParams are the inputs of every case; each case reads what it needs.
type benchParams struct {
	Size     uint64 `json:"size"`      // bytes per sequential pass
	Block    uint64 `json:"block"`     // bytes per read(2)/write(2)
	Files    int    `json:"files"`     // files per small-file pass
	FileSize uint64 `json:"file_size"` // bytes per small file
	Rep      int    `json:"rep"`       // repetition number, for fresh names
	InFlight int    `json:"in_flight"` // calls of one batch at once (ioctl.BatchInFlight)
}

// benchSample is what one run of one side reports.
type benchSample struct {
	Bytes uint64 `json:"bytes"`            // payload moved in the timed loop
	Ns    int64  `json:"ns"`               // wall time of the timed loop
	Ops   int    `json:"ops"`              // operations in the timed loop
	P50ns int64  `json:"p50_ns,omitempty"` // per-operation latency, when timed one by one
	P99ns int64  `json:"p99_ns,omitempty"`
	// KeyWorkNs is the daemon's own work per key of batch calls: handler
	// time minus the batches' transfers, from its status (kv cases).
	KeyWorkNs int64 `json:"key_work_ns,omitempty"`
	// KeyCPUNs is the daemon's CPU time per key of the pass (its
	// process's, copies and FUSE included; kv cases).
	KeyCPUNs int64 `json:"key_cpu_ns,omitempty"`
	// KeyWaits is the daemon's waits per key of the pass: for locks, for
	// a CPU, and its collector's CPU (kv cases; mfs.BatchStats says how
	// approximate they are).
	KeyWaits
	// TransferNs is the batches' transfers per key (started and waited
	// for), the rest of the handler time.
	TransferNs int64 `json:"transfer_ns,omitempty"`
	// CopiesPerKey is the GPU copies the daemon issued per key (GPU kv
	// cases): below 1, neighbouring blocks merged.
	CopiesPerKey float64 `json:"copies_per_key,omitempty"`
	// ClientNs is the caller's own time per key, outside its calls, and
	// FuseNs its calls' time per key beyond the daemon's handler: the
	// kernel's FUSE path and the wake-ups of both sides (tensor cases,
	// whose calls go one at a time).
	ClientNs int64 `json:"client_ns,omitempty"`
	FuseNs   int64 `json:"fuse_ns,omitempty"`
	// CopiesPerByte is the local copies per byte node A's daemon made
	// moving remote bytes (RDMA cases; nil where not measured).
	CopiesPerByte *float64 `json:"copies_per_byte,omitempty"`
	// Ceiling is the same work done by plain memory copies in the same
	// process, right after (cases with target withCopy).
	Ceiling *benchSample `json:"ceiling,omitempty"`
	// Direct is the same work through the direct path, where a case
	// measures an API layered on it (the Mooncake API's cases).
	Direct *benchSample `json:"direct,omitempty"`
}

// gbps is 1e9 bytes per second, i.e. bytes per nanosecond.
func (s benchSample) gbps() float64 {
	if s.Ns <= 0 {
		return 0
	}
	return float64(s.Bytes) / float64(s.Ns)
}

func (s benchSample) opsPerS() float64 {
	if s.Ns <= 0 {
		return 0
	}
	return float64(s.Ops) * 1e9 / float64(s.Ns)
}

// rate is what the median ranks by.
func (s benchSample) rate(small bool) float64 {
	if small {
		return s.opsPerS()
	}
	return s.gbps()
}

// benchTarget says where a case's two sides run.
type benchTarget int

const (
	// onMount: the mooncake side on the mount, the ceiling side on the
	// tmpfs, both by the same function.
	onMount benchTarget = iota
	// inMemory: no file system; the case is its own ceiling (ratio 1).
	inMemory
	// withCopy: the mooncake side on the mount; the worker measures its
	// ceiling itself, in the same process, as copy() of the same bytes
	// (benchSample.Ceiling).
	withCopy
)

// benchCase is one row of the case table.
type benchCase struct {
	name    string
	target  benchTarget
	ceiling string // label of the ceiling side
	small   bool   // small operations: ops/s and latency; the ratio is of ops/s
	// setup and teardown are optional, untimed, and run once per side.
	setup, teardown func(dir string, p benchParams) error
	run             func(dir string, p benchParams) (benchSample, error)
	// ceilingRun, if set, runs the tmpfs side of an onMount case instead
	// of run (worker phase "ceiling").
	ceilingRun func(dir string, p benchParams) (benchSample, error)
	// needs, if set, says why the case cannot run on this machine (a GPU
	// case without a GPU); such cases are left out unless named.
	needs func() error
	// cluster, if set, runs the mooncake side on the two-node cluster the
	// benchmark starts (bench_cluster.go), in this directory of node A.
	cluster string
	// rdma picks that cluster: "" (TCP only), "rdma" (the machine's RDMA
	// devices) or "fake" (the software NIC of the tests).
	rdma string
}

// benchCases is the table of cases, in the order they run. New cases
// (ioctl-*, cuda-*, remote-*) are a row here and a function below.
func benchCases() []benchCase {
	cases := []benchCase{
		{name: "memcpy", target: inMemory, ceiling: "memcpy", run: benchMemcpy},
		{name: "fuse-seq-write", target: onMount, ceiling: "tmpfs-seq-write", run: benchSeqWrite},
		{name: "fuse-seq-read", target: onMount, ceiling: "tmpfs-seq-read",
			setup: benchSeqReadSetup, run: benchSeqRead, teardown: benchSeqReadTeardown},
		{name: "fuse-small-files", target: onMount, ceiling: "tmpfs-small-files", small: true, run: benchSmallFiles},
		{name: "ioctl-put-buf", target: withCopy, ceiling: "copy", run: benchIoctlPutBuf},
		{name: "ioctl-get-buf", target: withCopy, ceiling: "copy",
			setup: benchIoctlGetSetup, run: benchIoctlGetBuf, teardown: benchIoctlGetTeardown},
		{name: "ioctl-put-vm", target: withCopy, ceiling: "copy", run: benchIoctlPutVM},
		{name: "ioctl-get-vm", target: withCopy, ceiling: "copy",
			setup: benchIoctlGetSetup, run: benchIoctlGetVM, teardown: benchIoctlGetTeardown},
		{name: "ioctl-small", target: onMount, ceiling: "tmpfs-put-get", small: true,
			run: benchIoctlSmall, ceilingRun: benchTmpfsSmallPutGet},
	}
	cases = append(cases, kvHostCases()...)
	cases = append(cases, opCases()...)
	cases = append(cases, clusterBenchCases()...)
	return append(cases, cudaBenchCases()...)
}

func benchCaseNames() []string {
	var names []string
	for _, c := range benchCases() {
		names = append(names, c.name)
	}
	return names
}

func lookupBenchCase(name string) (benchCase, bool) {
	for _, c := range benchCases() {
		if c.name == name {
			return c, true
		}
	}
	return benchCase{}, false
}

// selectBenchCases resolves --case: a comma list, or all when empty.
// The cases run in table order, each once.
func selectBenchCases(list string) ([]benchCase, error) {
	all := benchCases()
	if strings.TrimSpace(list) == "" {
		var runnable []benchCase
		for _, c := range all {
			if c.needs != nil && c.needs() != nil {
				continue
			}
			runnable = append(runnable, c)
		}
		return runnable, nil
	}
	want := map[string]bool{}
	var unknown []string
	for n := range strings.SplitSeq(list, ",") {
		n = strings.TrimSpace(n)
		if n == "" {
			continue
		}
		if _, ok := lookupBenchCase(n); !ok {
			unknown = append(unknown, n)
		}
		want[n] = true
	}
	if len(unknown) > 0 {
		return nil, fmt.Errorf("--case: unknown %s; known: %s", strings.Join(unknown, ", "), strings.Join(benchCaseNames(), ", "))
	}
	var out []benchCase
	for _, c := range all {
		if want[c.name] {
			out = append(out, c)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("--case: no case named")
	}
	return out, nil
}

func runBenchWorker(args []string) error {
	if len(args) != 4 {
		return fmt.Errorf("worker: want PHASE CASE DIR PARAMS, got %q", args)
	}
	phase, name, dir, raw := args[0], args[1], args[2], args[3]
	if phase == "tcp-sink" {
		return runTCPSink(name, dir)
	}
	c, ok := lookupBenchCase(name)
	if !ok {
		return fmt.Errorf("worker: unknown case %q", name)
	}
	var p benchParams
	if err := json.Unmarshal([]byte(raw), &p); err != nil {
		return fmt.Errorf("worker: params: %w", err)
	}
	if p.InFlight > 0 {
		// This process's batches, and those of the Python scripts it runs.
		ioctl.BatchInFlight = p.InFlight
		if err := os.Setenv("MOONCAKE_FS_IN_FLIGHT", strconv.Itoa(p.InFlight)); err != nil {
			return err
		}
	}
	// One thread for the whole loop: no migration between system calls.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	switch phase {
	case "setup", "teardown":
		f := c.setup
		if phase == "teardown" {
			f = c.teardown
		}
		if f == nil {
			return nil
		}
		return f(dir, p)
	case "run", "ceiling":
		run := c.run
		if phase == "ceiling" && c.ceilingRun != nil {
			run = c.ceilingRun
		}
		s, err := run(dir, p)
		if err != nil {
			return err
		}
		b, err := json.Marshal(s)
		if err != nil {
			return err
		}
		_, err = fmt.Printf("%s\n", b)
		return err
	}
	return fmt.Errorf("worker: unknown phase %q", phase)
}

// benchBuf is anonymous memory: page-aligned, outside the Go heap, and
// filled (so prefaulted) with the bench pattern.
type benchBuf []byte

func newBenchBuf(n uint64) (benchBuf, error) {
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("mmap %d B: %w", n, err)
	}
	for i := range b {
		b[i] = patternByte(i)
	}
	return b, nil
}

func (b benchBuf) free() { _ = unix.Munmap(b) }

// patternByte is byte i of every block the sequential cases write; a
// prime period keeps it from lining up with pages.
func patternByte(i int) byte { return byte(i % 251) }

func openRetry(path string, flags int, mode uint32) (int, error) {
	for {
		fd, err := unix.Open(path, flags|unix.O_CLOEXEC, mode)
		if err != unix.EINTR {
			return fd, err
		}
	}
}

func writeFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return errors.New("write returned 0")
		}
		b = b[n:]
	}
	return nil
}

func unlinkIfExists(path string) error {
	if err := unix.Unlink(path); err != nil && err != unix.ENOENT {
		return fmt.Errorf("unlink %s: %w", path, err)
	}
	return nil
}

// writeSeq creates path and writes size bytes in blocks of buf, close
// included (on the mount, close commits). It returns the time taken.
func writeSeq(path string, size uint64, buf benchBuf) (time.Duration, error) {
	t0 := time.Now()
	fd, err := openRetry(path, unix.O_CREAT|unix.O_TRUNC|unix.O_WRONLY, 0o644)
	if err != nil {
		return 0, fmt.Errorf("create %s: %w", path, err)
	}
	for off := uint64(0); off < size; {
		n := min(uint64(len(buf)), size-off)
		if err := writeFull(fd, buf[:n]); err != nil {
			unix.Close(fd)
			return 0, fmt.Errorf("write %s at %d: %w", path, off, err)
		}
		off += n
	}
	if err := unix.Close(fd); err != nil {
		return 0, fmt.Errorf("close %s: %w", path, err)
	}
	return time.Since(t0), nil
}

func benchSeqWrite(dir string, p benchParams) (benchSample, error) {
	path := filepath.Join(dir, "seq-write.dat")
	buf, err := newBenchBuf(p.Block)
	if err != nil {
		return benchSample{}, err
	}
	defer buf.free()
	if err := unlinkIfExists(path); err != nil {
		return benchSample{}, err
	}
	d, err := writeSeq(path, p.Size, buf)
	if err != nil {
		return benchSample{}, err
	}
	// Untimed: the next repetition writes a new file again.
	if err := unlinkIfExists(path); err != nil {
		return benchSample{}, err
	}
	return benchSample{Bytes: p.Size, Ns: d.Nanoseconds(), Ops: blocks(p.Size, p.Block)}, nil
}

func blocks(size, block uint64) int { return int((size + block - 1) / block) }

func seqReadPath(dir string) string { return filepath.Join(dir, "seq-read.dat") }

func benchSeqReadSetup(dir string, p benchParams) error {
	buf, err := newBenchBuf(p.Block)
	if err != nil {
		return err
	}
	defer buf.free()
	_, err = writeSeq(seqReadPath(dir), p.Size, buf)
	return err
}

func benchSeqReadTeardown(dir string, _ benchParams) error {
	return unlinkIfExists(seqReadPath(dir))
}

// benchSeqRead reads the file of setup into one reused buffer. On the
// mount every byte comes from the daemon: it opens files with
// FOPEN_DIRECT_IO, so the page cache holds nothing. On tmpfs the page
// cache is the file, which is what makes it the ceiling.
func benchSeqRead(dir string, p benchParams) (benchSample, error) {
	path := seqReadPath(dir)
	buf, err := newBenchBuf(p.Block)
	if err != nil {
		return benchSample{}, err
	}
	defer buf.free()
	clear(buf)
	var total uint64
	last := 0
	ops := 0
	t0 := time.Now()
	fd, err := openRetry(path, unix.O_RDONLY, 0)
	if err != nil {
		return benchSample{}, fmt.Errorf("open %s: %w", path, err)
	}
	for {
		n, err := unix.Read(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			unix.Close(fd)
			return benchSample{}, fmt.Errorf("read %s at %d: %w", path, total, err)
		}
		if n == 0 {
			break
		}
		total += uint64(n)
		last = n
		ops++
	}
	if err := unix.Close(fd); err != nil {
		return benchSample{}, fmt.Errorf("close %s: %w", path, err)
	}
	d := time.Since(t0)
	if total != p.Size {
		return benchSample{}, fmt.Errorf("read %s: got %d B, want %d", path, total, p.Size)
	}
	// Untimed check that real data came back (reads are block-aligned,
	// so the last one starts at a block boundary).
	for i := range last {
		if buf[i] != patternByte(i) {
			return benchSample{}, fmt.Errorf("read %s: byte %d of the last block is %#x, want %#x", path, i, buf[i], patternByte(i))
		}
	}
	return benchSample{Bytes: total, Ns: d.Nanoseconds(), Ops: ops}, nil
}

// benchSmallFiles creates, writes and closes p.Files new files of
// p.FileSize in a fresh directory, timing each file.
func benchSmallFiles(dir string, p benchParams) (benchSample, error) {
	sub := filepath.Join(dir, fmt.Sprintf("small-%d", p.Rep))
	if err := os.RemoveAll(sub); err != nil {
		return benchSample{}, err
	}
	if err := unix.Mkdir(sub, 0o755); err != nil {
		return benchSample{}, fmt.Errorf("mkdir %s: %w", sub, err)
	}
	buf, err := newBenchBuf(max(p.FileSize, 1))
	if err != nil {
		return benchSample{}, err
	}
	defer buf.free()
	data := buf[:p.FileSize]
	names := make([]string, p.Files)
	for i := range names {
		names[i] = filepath.Join(sub, fmt.Sprintf("f%07d", i))
	}
	lat := make([]int64, p.Files)
	t0 := time.Now()
	for i, name := range names {
		s := time.Now()
		fd, err := openRetry(name, unix.O_CREAT|unix.O_TRUNC|unix.O_WRONLY, 0o644)
		if err != nil {
			return benchSample{}, fmt.Errorf("create %s: %w", name, err)
		}
		if err := writeFull(fd, data); err != nil {
			unix.Close(fd)
			return benchSample{}, fmt.Errorf("write %s: %w", name, err)
		}
		if err := unix.Close(fd); err != nil {
			return benchSample{}, fmt.Errorf("close %s: %w", name, err)
		}
		lat[i] = time.Since(s).Nanoseconds()
	}
	d := time.Since(t0)
	// Untimed: leave the store as it was.
	for _, name := range names {
		if err := unlinkIfExists(name); err != nil {
			return benchSample{}, err
		}
	}
	if err := unix.Rmdir(sub); err != nil {
		return benchSample{}, fmt.Errorf("rmdir %s: %w", sub, err)
	}
	p50, p99 := percentiles(lat)
	return benchSample{Bytes: uint64(p.Files) * p.FileSize, Ns: d.Nanoseconds(), Ops: p.Files, P50ns: p50, P99ns: p99}, nil
}

// percentiles returns the 50th and 99th percentile of xs by nearest rank
// (the smallest value with at least p% of the values at or below it). It
// sorts xs.
func percentiles(xs []int64) (p50, p99 int64) {
	slices.Sort(xs)
	return nearestRank(xs, 50), nearestRank(xs, 99)
}

// nearestRank returns the p-th percentile of sorted xs; 0 when empty.
func nearestRank(sorted []int64, p int) int64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	// rank = ceil(p/100 * n), in integers.
	rank := (p*n + 99) / 100
	rank = min(max(rank, 1), n)
	return sorted[rank-1]
}

const memcpyBuf = 64 << 20

// benchMemcpy copies a 64 MiB buffer into another, single-threaded, until
// p.Size bytes (at least one buffer) have been copied: the machine's
// memory bandwidth as one core sees it, a reference line for the rest.
func benchMemcpy(_ string, p benchParams) (benchSample, error) {
	src, err := newBenchBuf(memcpyBuf)
	if err != nil {
		return benchSample{}, err
	}
	defer src.free()
	dst, err := newBenchBuf(memcpyBuf)
	if err != nil {
		return benchSample{}, err
	}
	defer dst.free()
	n := max(1, p.Size/memcpyBuf)
	t0 := time.Now()
	for range n {
		copy(dst, src)
	}
	d := time.Since(t0)
	return benchSample{Bytes: n * memcpyBuf, Ns: d.Nanoseconds(), Ops: int(n)}, nil
}
