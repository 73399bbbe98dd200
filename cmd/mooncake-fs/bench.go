package main

// The bench command measures the mount against ceilings taken in the same
// run, on the same machine, by the same worker code: a throughput claim is
// a ratio against its ceiling (STYLE.md, Benchmarks).
//
// Three kinds of process take part:
//
//   - bench (this process) mounts a private daemon and a tmpfs under a
//     temporary directory, runs the cases and reports. It never does I/O
//     on the mount itself: a process that both serves and uses a FUSE
//     mount can deadlock, and its own work would disturb the figures.
//   - the daemon, "mooncake-fs mount" run as a child, in its own process
//     group so that a terminal's ^C reaches only bench, which then stops
//     it with SIGTERM (and Pdeathsig stops it if bench is killed).
//   - workers, "mooncake-fs bench worker PHASE CASE DIR PARAMS" (internal,
//     not for users), one fresh process per phase and repetition. See
//     bench_worker.go for the protocol.
//
// Each repetition runs the mooncake side and then the ceiling side, so
// that noise from other work on the machine falls on both alike.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// benchConfig is everything "bench" takes from its flags.
type benchConfig struct {
	json      bool
	cases     []benchCase
	size      uint64
	storeSize uint64
	tmpfsSize uint64
	reps      int
	files     int
	inFlight  int
	keepGoing bool
	// daemonCPUs is passed to the benchmark's daemon as --cpus.
	daemonCPUs string
	// daemonMetrics is passed to the benchmark's daemon as --metrics, to
	// profile it while a case runs (/debug/pprof).
	daemonMetrics string
}

const (
	benchBlock    = 1 << 20 // bytes per read(2)/write(2) of the sequential cases
	benchFileSize = 4 << 10 // bytes per file of fuse-small-files
)

func parseBenchFlags(args []string) (*benchConfig, error) {
	c := &benchConfig{size: 1 << 30}
	var names string
	fl := flag.NewFlagSet("bench", flag.ContinueOnError)
	fl.BoolVar(&c.json, "json", false, "print one JSON object per case")
	fl.StringVar(&names, "case", "", "comma-separated cases to run; default all: "+strings.Join(benchCaseNames(), ", "))
	fl.Var(sizeFlag{&c.size}, "size", "bytes per pass of the sequential cases")
	fl.Var(sizeFlag{&c.storeSize}, "store-size", "capacity of the benchmark's own mount; default max(3 GiB, 2*size+1 GiB)")
	fl.IntVar(&c.reps, "reps", 3, "repetitions of each side of each case; the median is reported")
	fl.IntVar(&c.files, "files", 5000, "files per pass of fuse-small-files")
	fl.IntVar(&c.inFlight, "in-flight", ioctl.BatchInFlight, "calls of one batch in the daemon at once (kv cases; 1: one after the other)")
	fl.BoolVar(&c.keepGoing, "keep-going", false, "report a failed case and run the next instead of stopping")
	fl.StringVar(&c.daemonMetrics, "daemon-metrics", "", "serve the benchmark's daemon's metrics and profiles (/debug/pprof) at ADDR")
	fl.StringVar(&c.daemonCPUs, "daemon-cpus", "", "run the benchmark's daemon with --cpus LIST (the workers stay where the scheduler puts them)")
	if err := fl.Parse(args); err != nil {
		return nil, err
	}
	var errs []error
	if fl.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments %q", fl.Args()))
	}
	var err error
	if c.cases, err = selectBenchCases(names); err != nil {
		errs = append(errs, err)
	}
	if c.size < benchBlock {
		errs = append(errs, fmt.Errorf("--size %d: at least 1 MiB", c.size))
	}
	if c.daemonCPUs != "" {
		if _, err := parseCPUList(c.daemonCPUs); err != nil {
			errs = append(errs, fmt.Errorf("--daemon-cpus: %w", err))
		}
	}
	if c.reps < 1 {
		errs = append(errs, fmt.Errorf("--reps %d: at least 1", c.reps))
	}
	if c.inFlight < 1 {
		errs = append(errs, fmt.Errorf("--in-flight %d: at least 1", c.inFlight))
	}
	if c.files < 1 {
		errs = append(errs, fmt.Errorf("--files %d: at least 1", c.files))
	}
	// The sequential cases hold one file of --size at a time per side;
	// the rest is slack for small files and the allocator.
	need := c.size + 64<<20 + uint64(c.files)*benchFileSize
	if c.storeSize == 0 {
		c.storeSize = max(3<<30, 2*c.size+1<<30)
	} else if c.storeSize < need {
		errs = append(errs, fmt.Errorf("--store-size %s: the cases need at least %s", formatSize(c.storeSize), formatSize(need)))
	}
	c.storeSize = (c.storeSize + 2<<20 - 1) &^ (2<<20 - 1)
	c.tmpfsSize = need + 256<<20
	return c, errors.Join(errs...)
}

func runBench(args []string) error {
	if len(args) > 0 && args[0] == "worker" {
		return runBenchWorker(args[1:])
	}
	cfg, err := parseBenchFlags(args)
	if err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return errors.New("must run as root: it mounts a tmpfs and a FUSE daemon")
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own binary: %w", err)
	}
	// Signals cancel ctx and stay caught until cleanup is done: a second
	// ^C must not kill bench with mounts still in place.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()

	env := &benchEnv{self: self, daemonCPUs: cfg.daemonCPUs, daemonMetrics: cfg.daemonMetrics, clusterNodeSize: clusterNodeSize(cfg)}
	defer func() {
		if cerr := env.close(); cerr != nil {
			fmt.Fprintf(os.Stderr, "mooncake-fs bench: cleanup: %v\n", cerr)
		}
	}()
	if err := env.start(ctx, cfg.storeSize, cfg.tmpfsSize); err != nil {
		env.failed = ctx.Err() == nil
		return interrupted(ctx, err)
	}
	r := &benchRunner{env: env, cfg: cfg}
	out := &benchOutput{json: cfg.json}
	out.begin(cfg)
	failed := 0
	for _, c := range cfg.cases {
		if c.needs != nil {
			// Named on a machine that cannot run it (no GPU, no RDMA
			// device): said, not run.
			if why := c.needs(); why != nil {
				out.caseSkipped(c.name, why)
				continue
			}
		}
		res, err := r.runCase(ctx, c)
		if err != nil {
			env.failed = ctx.Err() == nil
			if ctx.Err() != nil || !cfg.keepGoing {
				return interrupted(ctx, fmt.Errorf("%s: %w", c.name, err))
			}
			out.caseError(c.name, err)
			failed++
			continue
		}
		res.DaemonCPUs = cfg.daemonCPUs
		if strings.HasPrefix(c.name, "kv-") {
			res.InFlight = cfg.inFlight
		}
		out.result(res)
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d cases failed", failed, len(cfg.cases))
	}
	return nil
}

func interrupted(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted; cleaned up (%v)", err)
	}
	return err
}

// benchRunner runs the cases of one bench invocation.
type benchRunner struct {
	env *benchEnv
	cfg *benchConfig
}

// benchSide is one place a case runs: the mount or its ceiling.
type benchSide struct {
	label  string
	dir    string
	daemon *benchProc // the daemon whose CPU use to sample, if any
	phase  string     // the worker phase that runs it: run or ceiling
}

type sideRun struct {
	sample    benchSample
	daemonCPU float64
	hostSteal float64 // CPUs the hypervisor took, per wall second
}

func (r *benchRunner) runCase(ctx context.Context, c benchCase) (benchResult, error) {
	var sides []benchSide
	mnt, daemon, ceilDir := r.env.mnt, r.env.daemon, r.env.tmpfs
	if c.cluster != "" {
		cl, err := r.env.startCluster(ctx, c.rdma)
		if err != nil {
			return benchResult{}, err
		}
		// The writer's daemon is sampled; the single-node mount is the
		// other side of cluster-small.
		mnt, daemon, ceilDir = cl.dir(c.cluster), cl.a, r.env.mnt
	}
	switch c.target {
	case onMount:
		ceil := "run"
		if c.ceilingRun != nil {
			ceil = "ceiling"
		}
		sides = []benchSide{{"mooncake", mnt, daemon, "run"}, {c.ceiling, ceilDir, nil, ceil}}
	case withCopy:
		sides = []benchSide{{"mooncake", mnt, daemon, "run"}}
	case inMemory:
		sides = []benchSide{{c.name, "", nil, "run"}}
	}
	p := benchParams{Size: r.cfg.size, Block: benchBlock, Files: r.cfg.files, FileSize: benchFileSize, InFlight: r.cfg.inFlight}
	if c.setup != nil {
		for _, s := range sides {
			if _, err := r.env.worker(ctx, "setup", c.name, s.dir, p, nil); err != nil {
				return benchResult{}, err
			}
		}
	}
	runs := make([][]sideRun, len(sides))
	var err error
	for rep := 0; rep < r.cfg.reps && err == nil; rep++ {
		p.Rep = rep
		for i, s := range sides {
			var sr sideRun
			if sr, err = r.env.worker(ctx, s.phase, c.name, s.dir, p, s.daemon); err != nil {
				break
			}
			if c.target == withCopy && sr.sample.Ceiling == nil {
				err = fmt.Errorf("worker run on %s: no ceiling in the sample", s.dir)
				break
			}
			runs[i] = append(runs[i], sr)
		}
	}
	if c.teardown != nil && ctx.Err() == nil {
		for _, s := range sides {
			if _, terr := r.env.worker(ctx, "teardown", c.name, s.dir, p, nil); terr != nil && err == nil {
				err = terr
			}
		}
	}
	if err != nil {
		return benchResult{}, err
	}
	m := median(runs[0], c.small)
	ceil, label := m, sides[len(sides)-1].label
	switch {
	case c.target == withCopy:
		// Each side's own median: the ceiling is a measurement of its
		// own, taken in the same processes.
		ceil, label = median(alongside(runs[0], ceilingOf), c.small), c.ceiling
	case len(sides) > 1:
		ceil = median(runs[1], c.small)
	}
	if m.sample.Direct != nil {
		// The direct path too: its own median over the repetitions, as
		// the ceiling's (one disturbed direct pass moved the ratio by a
		// fifth on the shared GPU host).
		d := median(alongside(runs[0], directOf), c.small).sample
		m.sample.Direct = &d
	}
	res := makeBenchResult(c, label, m.sample, ceil.sample, len(runs[0]))
	if c.target != inMemory {
		res.DaemonCPU = round(m.daemonCPU, 2)
	}
	res.HostSteal = round(m.hostSteal, 2)
	return res, nil
}

// alongside returns the samples that workers measured alongside runs
// and pick finds in theirs (the ceiling of withCopy cases, the direct
// path of cases layered on it), as runs of their own.
func alongside(runs []sideRun, pick func(*benchSample) *benchSample) []sideRun {
	var out []sideRun
	for i := range runs {
		if s := pick(&runs[i].sample); s != nil {
			out = append(out, sideRun{sample: *s})
		}
	}
	return out
}

func ceilingOf(s *benchSample) *benchSample { return s.Ceiling }

func directOf(s *benchSample) *benchSample { return s.Direct }

// median returns the run with the median rate (ops/s for small-operation
// cases, bytes/s otherwise); with an even count, the faster of the middle
// two. The median, not the best, because the machine is shared: it drops
// one disturbed repetition either way. Both sides use it.
func median(runs []sideRun, small bool) sideRun {
	s := append([]sideRun(nil), runs...)
	sort.SliceStable(s, func(i, j int) bool { return s[i].sample.rate(small) < s[j].sample.rate(small) })
	return s[len(s)/2]
}

// benchResult is one line of "bench --json".
type benchResult struct {
	Case           string  `json:"case"`
	Bytes          uint64  `json:"bytes"`
	GBps           float64 `json:"gbps"`
	Ceiling        string  `json:"ceiling"`
	CeilingGBps    float64 `json:"ceiling_gbps"`
	Ratio          float64 `json:"ratio"`
	OpsPerS        float64 `json:"ops_per_s,omitempty"`
	P50us          float64 `json:"p50_us,omitempty"`
	P99us          float64 `json:"p99_us,omitempty"`
	CeilingOpsPerS float64 `json:"ceiling_ops_per_s,omitempty"`
	CeilingP50us   float64 `json:"ceiling_p50_us,omitempty"`
	CeilingP99us   float64 `json:"ceiling_p99_us,omitempty"`
	// DirectOpsPerS is the direct path's rate in the same repetition, and
	// DirectRatio the case's share of it (cases of an API layered on it).
	DirectOpsPerS float64 `json:"direct_ops_per_s,omitempty"`
	DirectRatio   float64 `json:"direct_ratio,omitempty"`
	// KeyWorkUs is the daemon's own work per key of batch calls (handler
	// time minus the copies), kv cases.
	KeyWorkUs float64 `json:"key_work_us,omitempty"`
	// KeyCPUUs is the daemon's CPU time per key of the pass (kv cases):
	// with several calls in flight, their handler times overlap and
	// key_work_us adds up waits; this does not.
	KeyCPUUs float64 `json:"key_cpu_us,omitempty"`
	// KeyLockWaitUs, KeySchedWaitUs and KeyGCUs are the daemon's
	// goroutines' time blocked on locks, their time ready for a CPU and
	// the collector's CPU, per key of the pass (kv cases): where
	// key_work_us goes beyond the work itself. The runtime's figures,
	// approximate (fs.BatchStats).
	KeyLockWaitUs float64 `json:"key_lock_wait_us,omitempty"`
	// KeyLockPollUs is the time the daemon polled its store's contended
	// locks per key of the pass (kv cases): CPU time spent waiting for
	// the other calls, inside key_work_us, which key_lock_wait_us (parked
	// waits only) leaves out.
	KeyLockPollUs  float64 `json:"key_lock_poll_us,omitempty"`
	KeySchedWaitUs float64 `json:"key_sched_wait_us,omitempty"`
	KeyGCUs        float64 `json:"key_gc_us,omitempty"`
	// KeyFaults is the daemon's minor page faults per key of the pass
	// (kv cases): memory it had to have mapped again, heap pages given
	// back to the kernel among them.
	KeyFaults float64 `json:"key_faults,omitempty"`
	// KeyCommitUs is the part of key_work_us done after the key's copy
	// (put cases): committing it. The rest is checking and reserving.
	KeyCommitUs float64 `json:"key_commit_us,omitempty"`
	// KeyQueueUs is the time submitted calls waited for a thread to start
	// them, per key (tensor cases, several calls in flight): latency that
	// key_work_us leaves out.
	KeyQueueUs float64 `json:"key_queue_us,omitempty"`
	// TransferUs is the batches' transfer time per key (kv cases).
	TransferUs float64 `json:"transfer_us,omitempty"`
	// CopiesPerKey is the daemon's GPU copies per key (GPU kv cases).
	CopiesPerKey float64 `json:"copies_per_key,omitempty"`
	// ClientUs is the caller's own time per key (outside its ioctls) and
	// FuseUs its ioctls' time per key beyond the daemon's handler (the
	// kernel's FUSE path, wake-ups): with key_work_us and transfer_us,
	// where a key's time goes (tensor cases).
	ClientUs float64 `json:"client_us,omitempty"`
	FuseUs   float64 `json:"fuse_us,omitempty"`
	// CopiesPerByte is node A's local copies per remote byte (RDMA
	// cases; present even when 0).
	CopiesPerByte *float64 `json:"copies_per_byte,omitempty"`
	// DaemonCPU is the daemon's CPU time per wall second while the
	// reported mooncake repetition ran (1 = one core busy).
	DaemonCPU float64 `json:"daemon_cpu,omitempty"`
	// HostSteal is the CPU time the hypervisor gave to other guests per
	// wall second while the reported repetition ran, all of this
	// machine's CPUs together (1 = one CPU's worth): a shared host's
	// figures move with it. Absent on bare metal and on a quiet host.
	HostSteal float64 `json:"host_steal,omitempty"`
	Reps      int     `json:"reps"`
	// InFlight is how many calls of one batch may be in the daemon at
	// once (--in-flight; kv cases).
	InFlight int `json:"in_flight,omitempty"`
	// DaemonCPUs is the daemon's --cpus, when the run set one.
	DaemonCPUs string `json:"daemon_cpus,omitempty"`
}

// makeBenchResult turns the reported samples of both sides into a line.
// GB/s is 1e9 bytes per second, which is bytes per nanosecond.
func makeBenchResult(c benchCase, ceiling string, m, ceil benchSample, reps int) benchResult {
	res := benchResult{
		Case:        c.name,
		Bytes:       m.Bytes,
		GBps:        round(m.gbps(), 3),
		Ceiling:     ceiling,
		CeilingGBps: round(ceil.gbps(), 3),
		Reps:        reps,
	}
	if c.small {
		res.OpsPerS = round(m.opsPerS(), 0)
		res.P50us, res.P99us = round(float64(m.P50ns)/1e3, 1), round(float64(m.P99ns)/1e3, 1)
		res.CeilingOpsPerS = round(ceil.opsPerS(), 0)
		res.CeilingP50us, res.CeilingP99us = round(float64(ceil.P50ns)/1e3, 1), round(float64(ceil.P99ns)/1e3, 1)
		res.Ratio = round(ratio(m.opsPerS(), ceil.opsPerS()), 3)
		res.KeyWorkUs = round(float64(m.KeyWorkNs)/1e3, 2)
		res.KeyCPUUs = round(float64(m.KeyCPUNs)/1e3, 2)
		res.KeyLockWaitUs, res.KeySchedWaitUs = round(float64(m.LockNs)/1e3, 2), round(float64(m.SchedNs)/1e3, 2)
		res.KeyGCUs = round(float64(m.GCNs)/1e3, 2)
		res.KeyLockPollUs = round(float64(m.PollNs)/1e3, 2)
		res.KeyFaults = round(m.Faults, 3)
		res.KeyCommitUs = round(float64(m.CommitNs)/1e3, 2)
		res.KeyQueueUs = round(float64(m.QueueNs)/1e3, 2)
		res.CopiesPerKey = round(m.CopiesPerKey, 3)
		res.TransferUs = round(float64(m.TransferNs)/1e3, 2)
		res.ClientUs, res.FuseUs = round(float64(m.ClientNs)/1e3, 2), round(float64(m.FuseNs)/1e3, 2)
		if m.Direct != nil {
			res.DirectOpsPerS = round(m.Direct.opsPerS(), 0)
			res.DirectRatio = round(ratio(m.opsPerS(), m.Direct.opsPerS()), 3)
		}
	} else {
		res.Ratio = round(ratio(m.gbps(), ceil.gbps()), 3)
	}
	if m.CopiesPerByte != nil {
		v := round(*m.CopiesPerByte, 3)
		res.CopiesPerByte = &v
	}
	return res
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// round rounds x to digits decimal places.
func round(x float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(x*p) / p
}

// benchOutput prints results as they come: JSON lines, or a table.
type benchOutput struct {
	json bool
}

const benchRow = "%-18s %8s  %-18s %8s %6s %9s %8s %8s %10s %7s %6s\n"

func (o *benchOutput) begin(cfg *benchConfig) {
	if o.json {
		return
	}
	fmt.Printf("# median of %d repetitions per side; GB/s = 1e9 B/s; ratio = mooncake / ceiling (ops/s for small files)\n", cfg.reps)
	fmt.Printf("# mount: %s store, sequential passes of %s in %s blocks, %d files of %s\n",
		formatSize(cfg.storeSize), formatSize(cfg.size), formatSize(benchBlock), cfg.files, formatSize(benchFileSize))
	if cfg.daemonCPUs != "" {
		fmt.Printf("# daemon on CPUs %s\n", cfg.daemonCPUs)
	}
	fmt.Printf(benchRow, "CASE", "GB/s", "CEILING", "GB/s", "RATIO", "OPS/S", "P50 us", "P99 us", "CEIL OPS/S", "DAEMON", "STEAL")
}

func (o *benchOutput) result(r benchResult) {
	if o.json {
		b, _ := json.Marshal(r)
		fmt.Println(string(b))
		return
	}
	f := func(x float64, digits int) string { return fmt.Sprintf("%.*f", digits, x) }
	ops, p50, p99, cops, cpu, steal := "-", "-", "-", "-", "-", "-"
	if r.OpsPerS > 0 {
		ops, p50, p99, cops = f(r.OpsPerS, 0), f(r.P50us, 1), f(r.P99us, 1), f(r.CeilingOpsPerS, 0)
	}
	if r.DaemonCPU > 0 {
		cpu = f(r.DaemonCPU, 2)
	}
	if r.HostSteal > 0 {
		steal = f(r.HostSteal, 2)
	}
	fmt.Printf(benchRow, r.Case, f(r.GBps, 3), r.Ceiling, f(r.CeilingGBps, 3), f(r.Ratio, 3), ops, p50, p99, cops, cpu, steal)
}

func (o *benchOutput) caseSkipped(name string, why error) {
	if o.json {
		b, _ := json.Marshal(struct {
			Case    string `json:"case"`
			Skipped string `json:"skipped"`
		}{name, why.Error()})
		fmt.Println(string(b))
		return
	}
	fmt.Printf("%-18s skipped: %v\n", name, why)
}

func (o *benchOutput) caseError(name string, err error) {
	if o.json {
		b, _ := json.Marshal(struct {
			Case  string `json:"case"`
			Error string `json:"error"`
		}{name, err.Error()})
		fmt.Println(string(b))
		return
	}
	fmt.Printf("%-18s error: %v\n", name, err)
}
